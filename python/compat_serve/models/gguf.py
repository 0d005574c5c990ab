"""Load a `.gguf` file of a supported architecture into its mlx-lm model class.

compat-serve reads the file itself (gguf_header.py, gguf_tensors.py): quantized tensors come
back in MLX's nearest quantized layout (`weight` uint32, `scales`, `biases`; gguf_layout.py)
where weights stay quantized, else as dense float32 equal to llama.cpp's dequantization
(gguf_dequant.py). `gguf_families/` turns the metadata into the family's mlx-lm config and
llama.cpp's tensors into mlx-lm's parameters (renames, Q/K row un-permutation for llama,
Gemma's +1 norms, MLA splits); this module refuses the types it cannot read (one line
naming the tensor), keeps quantized layers quantized where the backend wants them, and
builds the `LoadedModel`.
"""

from __future__ import annotations

import importlib
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
from compat_serve.models.float32_activations import embeddings_output_float32
from compat_serve.models.gguf_families import (
    SUPPORTED_ARCHITECTURES,
    Family,
    family_for,
    permute_rows,
    unpermute_rows,
)
from compat_serve.models.gguf_families.common import Hparams, rename_tensors
from compat_serve.models.gguf_header import GGUFTensorInfo, read_header
from compat_serve.models.gguf_layout import GROUP, LAYOUTS
from compat_serve.models.gguf_metadata import GGUFMetadata
from compat_serve.models.gguf_mtp import mtp_blocks
from compat_serve.models.gguf_tensors import READABLE_TYPES, read_tensors, unreadable
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
    "SUPPORTED_ARCHITECTURES",
    "GGUFModelParts",
    "GGUFRoPE",
    "build_model",
    "gguf_model_name",
    "gguf_parts_steps",
    "load_gguf",
    "load_gguf_steps",
    "read_gguf",
    "unpermute_rows",
]

logger = logging.getLogger(__name__)

_permute_rows = permute_rows  # the tests write llama.cpp's layout with it


def _refuse_unreadable(path: str, table: list[GGUFTensorInfo]) -> None:
    """A one-line refusal for any tensor type the loader cannot read."""
    bad = unreadable(table)
    if bad:
        first = bad[0]
        more = f" and {len(bad) - 1} more tensors" if len(bad) > 1 else ""
        raise ModelLoadError(
            f"{path}: tensor {first.name}{more} stored as {first.type_name}, a GGUF type "
            f"compat-serve cannot read (loadable: {', '.join(sorted(READABLE_TYPES))}); "
            "requantize the file (llama.cpp: llama-quantize --allow-requantize IN.gguf "
            "OUT.gguf Q8_0) or serve the original weights as an MLX/HF model directory"
        )


def read_gguf(
    path: str, *, keep_quantized: bool = True
) -> tuple[dict[str, mx.array], GGUFMetadata]:
    """Tensors (llama.cpp names) and metadata of a GGUF file (refused if a tensor's type is
    unreadable). `keep_quantized`: quantized tensors in MLX's layout (gguf_layout.py), else
    dense float32 equal to llama.cpp's dequantization."""
    weights, meta, _quant, _types = _read_typed(path, keep_quantized=keep_quantized)
    return weights, meta


def _read_typed(
    path: str, *, keep_quantized: bool
) -> tuple[dict[str, mx.array], GGUFMetadata, dict[str, QuantParams], dict[str, str]]:
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file not found: {path}")
    header = read_header(path)
    meta = GGUFMetadata(header.metadata, path=path)
    # The MTP layers (llama.cpp's `nextn` blocks) are no part of the main model: read by
    # models/gguf_mtp.py when `--speculative mtp` builds its head.
    mtp = mtp_blocks(meta)
    table = [t for t in header.tensors if not t.name.startswith(mtp)] if mtp else header.tensors
    if len(table) < len(header.tensors):
        logger.info("leaving %d MTP tensors unread", len(header.tensors) - len(table))
    _refuse_unreadable(path, table)
    read = read_tensors(path, table, keep_quantized=keep_quantized)
    types = {t.name: t.type_name for t in header.tensors}
    return read.weights, meta, read.quant, types


def _stored_quantization(family: Family, types: Mapping[str, str]) -> dict[str, QuantParams]:
    """mlx-lm module path -> the layout of each quantized tensor kept quantized: what the file
    holds, reported on dense loads too (`extra["quantization"]`)."""
    out: dict[str, QuantParams] = {}
    for name, type_name in types.items():
        layout = LAYOUTS.get(type_name)
        if layout is None or not name.endswith(".weight"):
            continue
        renamed, _rope = rename_tensors(family, {name: mx.array(0)})
        for mlx_name in renamed:
            out[mlx_name.removesuffix(".weight")] = QuantParams(GROUP, layout.bits, layout.mode)
    return out


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
    family: Family
    rope_freqs: mx.array | None = None
    stored_quant: dict[str, QuantParams] = field(default_factory=dict)  # what the file holds
    timings: dict[str, float] = field(default_factory=dict)


def build_model(config: Mapping[str, Any], weights: dict[str, mx.array]) -> Module:
    """The mlx-lm model of `config` (random weights), after its own `sanitize` saw `weights`:
    some classes drop a tied head's module there (gemma3_text)."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    args = module.ModelArgs.from_dict(dict(config))
    model: Module = module.Model(args)
    sanitize = getattr(model, "sanitize", None)
    if callable(sanitize):
        sanitized = sanitize(dict(weights))
        if set(sanitized) != set(weights):
            raise ModelLoadError(
                f"mlx-lm's {config['model_type']} sanitize changed the GGUF's weight names"
            )
    return model


def read_gguf_parts(path: str, *, keep_quantized: bool = True) -> GGUFModelParts:
    """Read, rename and fix up a GGUF; infer each quantized layer's bits and group size."""
    return run_inline(gguf_parts_steps(path, keep_quantized=keep_quantized))


def gguf_parts_steps(path: str, *, keep_quantized: bool = True) -> LoadSteps[GGUFModelParts]:
    """`read_gguf_parts` as load steps (models/load_steps.py): the whole file is read in one
    host slice; the tokenizer is built from its metadata off the host. `keep_quantized`:
    quantized tensors in MLX's nearest layout (gguf_layout.py), else dense float32."""
    t0 = time.perf_counter()
    logger.info("loading GGUF %s", path)
    yield host("read GGUF")
    raw_weights, meta, _quant, types = _read_typed(path, keep_quantized=keep_quantized)
    t_read = time.perf_counter()
    logger.info("read %d tensors in %.2fs", len(raw_weights), t_read - t0)
    family = family_for(meta)
    config = family.config(Hparams(meta), raw_weights)
    renamed, rope = rename_tensors(family, raw_weights)
    del raw_weights
    weights = family.fixup(renamed, config)
    rope_freqs = rope.get("rope_freqs")
    if rope_freqs is not None and not family.takes_rope_freqs:
        raise ModelLoadError(f"{path}: rope_freqs in a {meta.architecture} GGUF is not supported")
    shapes = param_shapes(build_model(config, weights))
    missing = sorted(set(shapes) - set(weights) - _quantized_parts(weights))
    quant: dict[str, QuantParams] = {}
    for prefix in quantized_prefixes(weights):
        dense_shape = shapes.get(f"{prefix}.weight")
        if dense_shape is None:
            raise ModelLoadError(f"{path}: quantized tensor {prefix} has no model parameter")
        scales = weights[f"{prefix}.scales"]
        params = infer_quant_params(
            weights[f"{prefix}.weight"], scales, dense_shape[-1], name=prefix
        )
        if scales.dtype == mx.uint8:  # E8M0 exponents: MXFP4 (gguf_layout.py)
            params = QuantParams(params.group_size, params.bits, "mxfp4")
        quant[prefix] = params
    if missing:
        raise ModelLoadError(f"{path}: the GGUF lacks {', '.join(missing[:3])} ({len(missing)})")
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
        stored_quant=_stored_quantization(family, types),
        tokenizer=tokenizer,
        metadata=meta,
        family=family,
        rope_freqs=rope_freqs,
        timings={"read": t_read - t0, "tokenizer": t_tok - t_tok0},
    )


def _quantized_parts(weights: Mapping[str, mx.array]) -> set[str]:
    return {name for name in weights if name.endswith((".scales", ".biases"))}


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
        prefix, _, suffix = name.rpartition(".")
        if prefix in quant and suffix in ("weight", "scales", "biases"):
            continue  # dequantized above; a layer's `.bias` (Qwen2's q/k/v) is kept
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
        prefix = name.removesuffix(".weight") if name.endswith(".weight") else name
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
    """Load a GGUF; dense float32 on the CPU backend, quantized kept on GPUs."""
    return run_inline(load_gguf_steps(path, dtype=dtype, source=source))


def load_gguf_steps(
    path: str, *, dtype: str | None = None, source: str | None = None
) -> LoadSteps[LoadedModel]:
    """`load_gguf` as load steps (models/load_steps.py)."""
    plan: WeightPlan = resolve_dtype(dtype)
    t0 = time.perf_counter()
    parts = yield from gguf_parts_steps(path, keep_quantized=plan.keep_quantized)
    yield host("build the model")
    config = parts.config
    model = build_model(config, parts.weights)
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
    embeddings_output_float32(model)  # llama.cpp's float32 activations, on either path
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
        model_type=str(config["model_type"]),
        extra={
            "format": "gguf",
            "gguf_file": path,
            "config": config,
            "backend": plan.backend,
            "quantization": quantization_config(parts.stored_quant),
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
