"""`compat-serve convert-gguf IN OUT`: turn a GGUF of any supported family
(`models/gguf_families/`) into an mlx-lm model directory.

The directory holds config.json (the family's mlx-lm config), model.safetensors (mlx-lm's
parameter names: llama Q/K rows un-permuted to the HF layout, Gemma norms without llama.cpp's
+1, experts stacked as `switch_mlp`), tokenizer.json, tokenizer_config.json, generation_config.json
and chat_template.jinja; `mlx_lm.load(out_dir)` loads it.

`dtype="quantized"` keeps the GGUF's quantized tensors exactly as `mx.load` produced them
(this file: 4-bit linears, 8-bit embedding, group size 32); the config's `quantization` holds
the most common setting plus per-layer overrides, e.g.
`{"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8, ...}}`,
which mlx-lm's loader applies per module path. Float dtypes dequantize (in float32) first.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.gguf import dense_weights, quantization_config, read_gguf_parts
from compat_serve.models.tokenizer import Tokenizer
from compat_serve.models.weights import mx_dtype

__all__ = ["CONVERT_DTYPES", "ConvertDtype", "convert_gguf"]

logger = logging.getLogger(__name__)

ConvertDtype = Literal["quantized", "float32", "float16", "bfloat16"]
CONVERT_DTYPES: tuple[str, ...] = ("quantized", "float32", "float16", "bfloat16")
MAX_SHARD_BYTES = 5 << 30


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _tokenizer_config(
    tokenizer: Tokenizer, chat_template: str | None, context_length: int
) -> dict[str, Any]:
    added: dict[str, dict[str, Any]] = {}
    for tid, token in sorted(tokenizer.backend.get_added_tokens_decoder().items()):
        added[str(tid)] = {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tokenizer.add_bos_token,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def _save_weights(out: Path, weights: dict[str, mx.array]) -> None:
    shards: list[dict[str, mx.array]] = []
    size = 0
    for name in sorted(weights):
        tensor = weights[name]
        if not shards or size + int(tensor.nbytes) > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += int(tensor.nbytes)
    if len(shards) == 1:
        mx.save_safetensors(str(out / "model.safetensors"), shards[0], metadata={"format": "mlx"})
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out / file), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(int(t.nbytes) for t in weights.values())
    _write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )


def convert_gguf(
    src: str,
    out_dir: str,
    *,
    dtype: ConvertDtype | str = "quantized",
    overwrite: bool = False,
) -> Path:
    """Write an mlx-lm-loadable model directory for the GGUF `src`; returns its path."""
    if dtype not in CONVERT_DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {', '.join(CONVERT_DTYPES)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ModelLoadError(f"{out} exists and is not empty (pass overwrite=True to replace)")
    t0 = time.perf_counter()
    parts = read_gguf_parts(src, keep_quantized=dtype == "quantized")
    if parts.rope_freqs is not None:
        raise ModelLoadError(
            f"{src}: per-frequency rope factors (rope_freqs, Llama 3.1-style) cannot be "
            "expressed in an mlx-lm config yet; serve the .gguf file directly instead"
        )
    config: dict[str, Any] = dict(parts.config)
    if dtype == "quantized":
        weights = dict(parts.weights)
        quant = quantization_config(parts.quant)
        if quant is not None:
            config["quantization"] = quant
            config["quantization_config"] = quant
        logger.info("writing %d quantized layers as stored", len(parts.quant))
    else:
        weights = dense_weights(parts.weights, parts.quant, mx_dtype(dtype))
        config["torch_dtype"] = dtype
        logger.info("dequantizing %d layers to %s", len(parts.quant), dtype)
    mx.eval(weights)

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    _save_weights(out, weights)
    _write_json(out / "config.json", dict(sorted(config.items())))

    info = parts.tokenizer
    tokenizer = info.tokenizer
    tokenizer.backend.save(str(out / "tokenizer.json"))
    context_length = int(config["max_position_embeddings"])
    _write_json(
        out / "tokenizer_config.json",
        _tokenizer_config(tokenizer, info.chat_template, context_length),
    )
    eos = sorted(tokenizer.eos_token_ids)
    generation: dict[str, Any] = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
    }
    if tokenizer.pad_token_id is not None:
        generation["pad_token_id"] = tokenizer.pad_token_id
    _write_json(out / "generation_config.json", generation)
    if info.chat_template is not None:
        (out / "chat_template.jinja").write_text(info.chat_template, encoding="utf-8")
    logger.info("wrote %s (%s) in %.2fs", out, dtype, time.perf_counter() - t0)
    return out
