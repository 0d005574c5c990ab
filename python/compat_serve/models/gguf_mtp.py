"""The MTP layer of a GGUF file: llama.cpp's `nextn` tensors and the decoder layer beside
them, read when `--speculative mtp` asks for them (engine/mtp_families.py).

llama.cpp's converter writes GLM-4.5's MTP layer as the last block,
`blk.{num_hidden_layers}.*` (`{arch}.nextn_predict_layers` says how many; `block_count`
counts them): the layer's attention and MoE tensors under their usual names, plus
`nextn.eh_proj`, `nextn.enorm`, `nextn.hnorm`, `nextn.shared_head_norm` and the optional
copies `nextn.embed_tokens`/`nextn.shared_head_head`. The family's renames
(models/gguf_families/) give them the Hugging Face names of that layer, so the head is built
exactly as from a checkpoint directory; only that block's tensors are read.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from compat_serve.models.gguf_families import family_for
from compat_serve.models.gguf_families.common import Hparams, rename_tensors
from compat_serve.models.gguf_header import read_header
from compat_serve.models.gguf_metadata import GGUFMetadata
from compat_serve.models.gguf_tensors import read_tensors
from compat_serve.models.mtp_weights import mtp_prefix

__all__ = ["gguf_tensor_name", "mtp_blocks", "read_gguf_mtp_tensors"]


def mtp_blocks(meta: GGUFMetadata) -> tuple[str, ...]:
    """The `blk.N.` prefixes of the file's MTP layers: the last `{arch}.nextn_predict_layers`
    of its `block_count` blocks (none for a file without them). The main model's load
    leaves them unread."""
    h = Hparams(meta)
    count = h.get_int("nextn_predict_layers", 0) or 0
    total = h.get_int("block_count", 0) or 0
    return tuple(f"blk.{i}." for i in range(max(total - count, 0), total))


def read_gguf_mtp_tensors(
    path: str, config: dict[str, Any], *, keep_quantized: bool
) -> dict[str, mx.array]:
    """The first MTP layer's tensors of the GGUF at `path` (names relative to the layer, as
    `read_mtp_tensors` gives a directory's); empty when the file has none. `keep_quantized`:
    quantized tensors in MLX's layout, else dense float32 (as the main model was read)."""
    prefix = mtp_prefix(config)
    if prefix is None:
        return {}
    header = read_header(path)
    block = f"blk.{int(config['num_hidden_layers'])}."
    table = [t for t in header.tensors if t.name.startswith(block)]
    if not table:
        return {}
    family = family_for(GGUFMetadata(header.metadata, path=path))
    read = read_tensors(path, table, keep_quantized=keep_quantized)
    renamed, _rope = rename_tensors(family, read.weights)
    weights = family.fixup(renamed, config)
    return {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}


def gguf_tensor_name(path: str, config: dict[str, Any], name: str) -> str:
    """llama.cpp's name of the MTP layer's tensor `name` (relative, mlx-lm's naming): what
    an error about a missing or misshapen tensor should say."""
    family = family_for(GGUFMetadata(read_header(path).metadata, path=path))
    block = f"blk.{int(config['num_hidden_layers'])}"
    if name.endswith(".e_score_correction_bias"):
        name = name.replace(".e_score_correction_bias", ".e_score_correction.bias")
    module, _, suffix = name.rpartition(".")
    by_module = {mapped: base for base, mapped in family.layer_names.items()}
    base = by_module.get(module)
    return f"{block}.{base}.{suffix}" if base else f"{block}.{name}"
