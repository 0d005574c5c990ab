"""Load a llama-family `.gguf` file into mlx-lm's `llama.Model`.

`mx.load(path, return_metadata=True)` reads the file: Q4_0/Q4_1/Q8_0 tensors come back as MLX
affine-quantized triples (`weight` uint32, `scales`, `biases`), other tensors as dense arrays.
This module turns the metadata into an mlx-lm llama config, renames llama.cpp's tensors to
mlx-lm's parameter names and undoes llama.cpp's Q/K row permutation.

Q/K permutation: llama.cpp's converter reorders the rows of `attn_q`/`attn_k` inside every head
(`reshape(n_head, 2, head_dim/2, ...).swapaxes(1, 2)`) so its rope can rotate adjacent pairs.
We undo it (`unpermute_rows`) instead of running the model with `rope_traditional=True`:
it is a pure row permutation (exact, and applies to packed quantized rows, scales and
biases as they are, since quantization groups run along the input dimension), and it gives
the standard Hugging Face layout, so the model is the stock `llama.Model` with the stock rope
and `convert.py` writes a directory any mlx-lm/transformers reader understands.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.quantized import quantize

from compat_serve.models import load_steps
from compat_serve.models.errors import ModelLoadError
from compat_serve.models.gguf_metadata import GGUFMetadata
from compat_serve.models.gguf_tokenizer import GGUFTokenizerInfo, build_gguf_tokenizer
from compat_serve.models.load_steps import (
    WORKER,
    LoadSteps,
    evaluate,
    evaluate_in_slices,
    host,
    run_inline,
)
from compat_serve.models.types import LoadedModel
from compat_serve.models.weights import (
    QuantParams,
    WeightPlan,
    dequantize,
    infer_quant_params,
    model_arrays,
    mx_dtype,
    param_shapes,
    quantized_prefixes,
    resolve_dtype,
)

__all__ = [
    "GGUFModelParts",
    "GGUFRoPE",
    "gguf_model_name",
    "gguf_parts_steps",
    "llama_config_from_gguf",
    "load_gguf",
    "load_gguf_steps",
    "map_gguf_weights",
    "read_gguf",
    "unpermute_rows",
]

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama",)

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# mx.load names: `.weight` (dense or packed), `.scales`/`.biases` (quantization), `.bias`.
_TENSOR_RE = re.compile(r"^(?:blk\.(\d+)\.)?([a-z_]+)\.(weight|scales|biases|bias)$")
_IGNORED = {"rope_freqs", "rope_factors_long", "rope_factors_short"}


def read_gguf(path: str) -> tuple[dict[str, mx.array], GGUFMetadata]:
    """Tensors and metadata of a GGUF file."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        loaded: Any = mx.load(path, return_metadata=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF {path}: {exc}") from exc
    weights, raw_meta = loaded
    return dict(weights), GGUFMetadata(raw_meta, path=path)


def _kv_heads(meta: GGUFMetadata, key: str, default: int) -> int:
    values = meta.get_int_list(key)
    if not values:
        return default
    if len(set(values)) != 1:
        raise ModelLoadError(f"{meta.path}: per-layer {key} values are not supported")
    return values[0]


def llama_config_from_gguf(meta: GGUFMetadata, weights: Mapping[str, mx.array]) -> dict[str, Any]:
    """An HF/mlx-lm style `config.json` dict for a llama-architecture GGUF."""
    arch = meta.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{meta.path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); "
            "use an MLX/HF model directory for other architectures"
        )
    p = f"{arch}."
    hidden = meta.require_int(p + "embedding_length")
    heads = _kv_heads(meta, p + "attention.head_count", 0)
    if heads <= 0:
        raise ModelLoadError(f"{meta.path}: GGUF metadata has no {p}attention.head_count")
    kv_heads = _kv_heads(meta, p + "attention.head_count_kv", heads)
    head_dim = (
        meta.get_int(p + "attention.key_length")
        or meta.get_int(p + "rope.dimension_count")
        or hidden // heads
    )
    tokens = meta.get_str_list("tokenizer.ggml.tokens") or []
    embed = weights.get("token_embd.weight")
    vocab = (
        meta.get_int(p + "vocab_size")
        or (int(embed.shape[0]) if embed is not None else 0)
        or len(tokens)
    )
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": meta.require_int(p + "block_count"),
        "intermediate_size": meta.require_int(p + "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": meta.get_float(p + "attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": meta.get_float(p + "rope.freq_base", 10000.0),
        "rope_traditional": False,  # Q/K rows are un-permuted to the HF layout
        "max_position_embeddings": meta.get_int(p + "context_length", 4096),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in weights,
        "attention_bias": "blk.0.attn_q.bias" in weights,
        "mlp_bias": "blk.0.ffn_gate.bias" in weights,
    }
    scaling = meta.get_str(p + "rope.scaling.type")
    factor = meta.get_float(p + "rope.scaling.factor")
    if scaling == "linear" and factor and factor != 1.0:
        config["rope_scaling"] = {"type": "linear", "factor": factor}
    elif scaling not in (None, "none", "linear"):
        logger.warning(
            "%s: rope scaling %r is not reproduced; quality may drop past %s tokens",
            meta.path,
            scaling,
            meta.get_int(p + "rope.scaling.original_context_length"),
        )
    for key, name in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
    ):
        if (tid := meta.get_int(key)) is not None:
            config[name] = tid
    return config


def unpermute_rows(x: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's per-head Q/K row permutation (works on packed rows, scales, biases)."""
    rows = int(x.shape[0])
    if rows % (2 * n_head):
        raise ModelLoadError(f"cannot un-permute {rows} rows into {n_head} heads")
    rest = tuple(int(d) for d in x.shape[1:])
    return x.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(x.shape)


def _permute_rows(x: mx.array, n_head: int) -> mx.array:
    """llama.cpp's permutation (`convert_hf_to_gguf.py`; the inverse of `unpermute_rows`)."""
    rows = int(x.shape[0])
    rest = tuple(int(d) for d in x.shape[1:])
    return x.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(x.shape)


def map_gguf_weights(
    weights: Mapping[str, mx.array], config: Mapping[str, Any]
) -> tuple[dict[str, mx.array], mx.array | None]:
    """Rename llama.cpp tensors to mlx-lm names and un-permute Q/K.

    Returns (mapped weights, `rope_freqs` tensor or None). Quantized tensors stay quantized.
    """
    heads = int(config["num_attention_heads"])
    kv_heads = int(config["num_key_value_heads"])
    out: dict[str, mx.array] = {}
    rope_freqs: mx.array | None = None
    for name, tensor in weights.items():
        m = _TENSOR_RE.match(name)
        if m is None:
            raise ModelLoadError(f"unexpected tensor {name!r} in GGUF")
        layer, base, suffix = m.group(1), m.group(2), m.group(3)
        if layer is None and base == "rope_freqs":
            rope_freqs = tensor
            continue
        if base in _IGNORED:
            logger.warning("ignoring GGUF tensor %s", name)
            continue
        if layer is None:
            target = _TOP_LEVEL.get(base)
        else:
            mapped = _PER_LAYER.get(base)
            target = None if mapped is None else f"model.layers.{layer}.{mapped}"
        if target is None:
            raise ModelLoadError(f"unsupported tensor {name!r} in a llama GGUF")
        if base == "attn_q":
            out[f"{target}.{suffix}"] = unpermute_rows(tensor, heads)
        elif base == "attn_k":
            out[f"{target}.{suffix}"] = unpermute_rows(tensor, kv_heads)
        else:
            out[f"{target}.{suffix}"] = tensor
    if config.get("tie_word_embeddings"):
        out.pop("lm_head.weight", None)
    return out, rope_freqs


class GGUFRoPE(Module):
    """Rope with per-frequency factors from a GGUF `rope_freqs` tensor (Llama 3.1-style).

    llama.cpp divides each rotation frequency by its factor; `mx.fast.rope` takes the inverse
    frequencies (`freqs`), so those are multiplied by it.
    """

    def __init__(self, dims: int, base: float, factors: mx.array) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.dims = dims
        exponents = mx.arange(0, dims, 2, dtype=mx.float32) / dims
        self._freqs = (base**exponents) * factors.astype(mx.float32)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs
        )


@dataclass
class GGUFModelParts:
    """A GGUF turned into mlx-lm pieces (used by `load_gguf` and `convert.py`)."""

    config: dict[str, Any]
    weights: dict[str, mx.array]  # mlx-lm names; quantized triples still packed
    quant: dict[str, QuantParams]  # module path -> quantization of its stored weight
    tokenizer: GGUFTokenizerInfo
    metadata: GGUFMetadata
    rope_freqs: mx.array | None = None
    timings: dict[str, float] = field(default_factory=dict)


def build_llama(config: Mapping[str, Any]) -> Module:
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs.from_dict(dict(config))  # type: ignore[no-untyped-call]
    model: Module = Model(args)
    return model


def read_gguf_parts(path: str) -> GGUFModelParts:
    """Read, rename and un-permute a GGUF; infer each quantized layer's bits and group size."""
    return run_inline(gguf_parts_steps(path))


def gguf_parts_steps(path: str) -> LoadSteps[GGUFModelParts]:
    """`read_gguf_parts` as load steps (models/load_steps.py): MLX reads the whole file
    eagerly in one host slice; the tokenizer is built from its metadata off the host."""
    t0 = time.perf_counter()
    logger.info("loading GGUF %s", path)
    yield host("read GGUF")
    raw_weights, meta = read_gguf(path)
    t_read = time.perf_counter()
    logger.info("read %d tensors in %.2fs", len(raw_weights), t_read - t0)
    config = llama_config_from_gguf(meta, raw_weights)
    weights, rope_freqs = map_gguf_weights(raw_weights, config)
    del raw_weights
    shapes = param_shapes(build_llama(config))
    quant: dict[str, QuantParams] = {}
    for prefix in quantized_prefixes(weights):
        dense_shape = shapes.get(f"{prefix}.weight")
        if dense_shape is None:
            raise ModelLoadError(f"{path}: quantized tensor {prefix} has no model parameter")
        quant[prefix] = infer_quant_params(
            weights[f"{prefix}.weight"], weights[f"{prefix}.scales"], dense_shape[-1], name=prefix
        )
    yield WORKER
    t_tok0 = time.perf_counter()
    tokenizer = build_gguf_tokenizer(meta)
    t_tok = time.perf_counter()
    logger.info(
        "tokenizer: %d tokens (pre-tokenizer %r) in %.2fs",
        tokenizer.tokenizer.vocab_size,
        tokenizer.pre,
        t_tok - t_tok0,
    )
    return GGUFModelParts(
        config=config,
        weights=weights,
        quant=quant,
        tokenizer=tokenizer,
        metadata=meta,
        rope_freqs=rope_freqs,
        timings={"read": t_read - t0, "tokenizer": t_tok - t_tok0},
    )


def dense_weights(
    weights: Mapping[str, mx.array], quant: Mapping[str, QuantParams], dtype: mx.Dtype
) -> dict[str, mx.array]:
    """Every weight dense in `dtype` (lazy: nothing is computed until evaluated)."""
    out: dict[str, mx.array] = {}
    for prefix, params in quant.items():
        out[f"{prefix}.weight"] = dequantize(
            weights[f"{prefix}.weight"],
            weights[f"{prefix}.scales"],
            weights.get(f"{prefix}.biases"),
            params,
            dtype,
        )
    for name, tensor in weights.items():
        prefix = name.rpartition(".")[0]
        if prefix in quant:
            continue
        out[name] = tensor.astype(dtype) if mx.issubdtype(tensor.dtype, mx.floating) else tensor
    return out


def dense_weights_steps(
    weights: Mapping[str, mx.array], quant: Mapping[str, QuantParams], dtype: mx.Dtype
) -> LoadSteps[dict[str, mx.array]]:
    """`dense_weights`, with each dense weight larger than a load slice (the token
    embedding) computed in row blocks of about `SLICE_BYTES`, one host slice each, then
    joined (one copy, evaluated with the other weights): no slice dequantizes it whole."""
    out = dense_weights(weights, quant, dtype)
    limit = load_steps.SLICE_BYTES
    for name, dense in list(out.items()):
        rows = int(dense.shape[0]) if dense.ndim == 2 else 0
        prefix = name.rpartition(".")[0]
        floating = mx.issubdtype(weights[name].dtype, mx.floating)
        if int(dense.nbytes) <= 2 * limit or rows < 2 or not (prefix in quant or floating):
            continue
        step = max(1, rows * limit // int(dense.nbytes))
        pieces: list[mx.array] = []
        for start in range(0, rows, step):
            rows_here = slice(start, min(rows, start + step))
            if prefix in quant:
                biases = weights.get(f"{prefix}.biases")
                piece = dequantize(
                    weights[name][rows_here],
                    weights[f"{prefix}.scales"][rows_here],
                    None if biases is None else biases[rows_here],
                    quant[prefix],
                    dtype,
                )
            else:
                piece = weights[name][rows_here].astype(dtype)
            yield host(f"{name} rows {start}+")
            evaluate([piece], f"{name} rows")
            pieces.append(piece)
        out[name] = mx.concatenate(pieces)
    return out


def quantization_config(quant: Mapping[str, QuantParams]) -> dict[str, Any] | None:
    """mlx-lm's `quantization` config: the most common params plus per-layer overrides."""
    if not quant:
        return None
    counts: dict[QuantParams, int] = {}
    for params in quant.values():
        counts[params] = counts.get(params, 0) + 1
    default = max(counts, key=lambda q: counts[q])
    config: dict[str, Any] = {"group_size": default.group_size, "bits": default.bits}
    if default.mode != "affine":
        config["mode"] = default.mode
    for prefix, params in sorted(quant.items()):
        if params != default:
            config[prefix] = params.as_dict()
    return config


def apply_rope_freqs(model: Module, config: Mapping[str, Any], rope_freqs: mx.array) -> None:
    dims = int(config["head_dim"])
    rope = GGUFRoPE(dims, float(config["rope_theta"]), rope_freqs)
    layers: Any = model.layers
    for layer in layers:
        layer.self_attn.rope = rope


def gguf_model_name(path: str) -> str:
    """`SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`."""
    stem = os.path.basename(path)
    if stem.lower().endswith(".gguf"):
        stem = stem[: -len(".gguf")]
    return (
        re.sub(r"[.\-_](?:I?Q\d[\w]*|F16|F32|BF16|fp16|fp32)$", "", stem, flags=re.IGNORECASE)
        or stem
    )


def load_gguf(path: str, *, dtype: str | None = None, source: str | None = None) -> LoadedModel:
    """Load a llama-family GGUF; dense float32 on the CPU backend, quantized kept on GPUs."""
    return run_inline(load_gguf_steps(path, dtype=dtype, source=source))


def load_gguf_steps(
    path: str, *, dtype: str | None = None, source: str | None = None
) -> LoadSteps[LoadedModel]:
    """`load_gguf` as load steps (models/load_steps.py)."""
    plan: WeightPlan = resolve_dtype(dtype)
    t0 = time.perf_counter()
    parts = yield from gguf_parts_steps(path)
    yield host("build the model")
    config = parts.config
    model = build_llama(config)
    if plan.keep_quantized:
        quant = parts.quant

        def predicate(p: str, _m: Module) -> bool | dict[str, Any]:
            return quant[p].as_dict() if p in quant else False

        quantize(model, class_predicate=predicate)
        weights = parts.weights
        qconfig = quantization_config(quant)
        dtype_name = (
            f"quantized-{qconfig['bits']}bit"
            if qconfig is not None
            else str(parts.weights["model.norm.weight"].dtype).removeprefix("mlx.core.")
        )
        phase = "loading quantized weights"
    else:
        dense = plan.dense or "float32"
        weights = yield from dense_weights_steps(parts.weights, parts.quant, mx_dtype(dense))
        dtype_name = dense
        phase = f"dequantizing to {dense}" if parts.quant else f"casting to {dense}"
    if parts.rope_freqs is not None:
        apply_rope_freqs(model, config, parts.rope_freqs)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    t_build = time.perf_counter()
    logger.info("%s (%s backend)", phase, plan.backend)
    yield from evaluate_in_slices(model, phase, log=logger)
    t_done = time.perf_counter()
    nbytes = sum(int(v.nbytes) for v in _leaves(model))
    logger.info(
        "model ready in %.2fs (%s, %.0f MB, %d layers)",
        t_done - t0,
        dtype_name,
        nbytes / 1e6,
        config["num_hidden_layers"],
    )
    tokenizer = parts.tokenizer.tokenizer
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        chat_template=parts.tokenizer.chat_template,
        context_length=int(config["max_position_embeddings"]),
        name=gguf_model_name(path),
        source=source or path,
        dtype=dtype_name,
        model_type="llama",
        extra={
            "format": "gguf",
            "config": config,
            "backend": plan.backend,
            "quantization": quantization_config(parts.quant),
            "gguf_pre_tokenizer": parts.tokenizer.pre,
            "weights_nbytes": nbytes,
            "load_seconds": {
                **parts.timings,
                "weights": t_done - t_build,
                "total": t_done - t0,
            },
        },
    )


def _leaves(model: Module) -> list[mx.array]:
    return list(model_arrays(model).values())
