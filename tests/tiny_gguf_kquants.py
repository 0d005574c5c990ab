"""Tiny GGUFs with tensors of any llama.cpp block type (K-quants, IQ4, MXFP4...), which the
`gguf` package can dequantize but not all write: random blocks stand in for quantized
weights, and the reference directory holds `gguf.quants.dequantize` of the same blocks."""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from gguf.quants import dequantize

from tests.tiny_gguf import (
    Field,
    GGUFCase,
    Q,
    add_tokenizer,
    attention_hparams,
    random_model,
)
from tests.tiny_models import FAMILY_CONFIGS

# Qwen3 with every row a multiple of 256 values, for K-quant super-blocks.
QWEN3_256 = GGUFCase(
    "qwen3",
    {**FAMILY_CONFIGS["qwen3"], "hidden_size": 256, "head_dim": 64, "intermediate_size": 256},
    gguf.MODEL_ARCH.QWEN3,
    attention_hparams,
)


# Where each type keeps its float16 scales: (byte offset from the block's start, count);
# a negative offset counts from the block's end. MXFP4's one-byte E8M0 exponent is separate.
_F16_SCALES = {
    "Q4_0": (0, 1), "Q5_0": (0, 1), "Q8_0": (0, 1), "IQ4_NL": (0, 1), "IQ4_XS": (0, 1),
    "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
    "Q2_K": (-4, 2), "Q3_K": (-2, 1), "Q6_K": (-2, 1),
}  # fmt: skip


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `qtype` (all codes and sub-block scales random) with small finite
    float16 scales (MXFP4: exponents near 2^0)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    if qtype == Q.MXFP4:
        raw[:, 0] = rng.integers(118, 130, raw.shape[0])
    else:
        at, count = _F16_SCALES[qtype.name]
        scales = rng.uniform(1e-4, 3e-4, (raw.shape[0], count)).astype(np.float16)
        start = at if at >= 0 else size + at
        raw[:, start : start + 2 * count] = scales.view(np.uint8)
    return raw.reshape(rows, cols // block * size)


def write_k_quant_case(
    out: Path, qtype_name: str, tokenizer_fields: dict[str, Field], *, seed: int = 0
) -> tuple[Path, Path]:
    """QWEN3_256 with every 2-D weight random `qtype_name` blocks (Qwen3's converter moves no
    rows, so the reference holds `gguf.quants.dequantize` of the same blocks as they are)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import save_config, save_model

    qtype = Q[qtype_name]
    vocab = len(tokenizer_fields["tokenizer.ggml.tokens"][0])
    model, config = random_model(QWEN3_256, vocab, seed)
    rng = np.random.default_rng(seed)
    weights = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}
    blocks = {
        name: random_blocks(qtype, *value.shape, rng)
        for name, value in weights.items()
        if value.ndim == 2
    }
    model.load_weights(
        [
            (name, mx.array(dequantize(raw, qtype).astype(np.float32)))
            for name, raw in blocks.items()
        ],
        strict=False,
    )
    ref = out / "ref"
    ref.mkdir(parents=True, exist_ok=True)
    save_model(ref, model)
    save_config(dict(config), ref / "config.json")
    path = out / f"model.{qtype_name}.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_vocab_size(vocab)
    QWEN3_256.hparams(writer, config)
    add_tokenizer(writer, tokenizer_fields)
    names = gguf.get_tensor_name_map(QWEN3_256.arch, config["num_hidden_layers"])
    for name, value in weights.items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None
        if name in blocks:
            raw = blocks[name]
            writer.add_tensor(gguf_name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return ref, path
