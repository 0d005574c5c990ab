"""Backend detection, the dtype rule, and (de)quantization helpers shared by the loaders.

The dtype rule (`resolve_dtype`):
- CPU backend, `dtype=None`/"auto": every weight becomes dense float32. MLX's CPU quantized
  matmul is a scalar kernel (~3 GFLOP/s) and f16/bf16 inputs are slower still, while dense f32
  goes through BLAS (50+ GFLOP/s with the fast BLAS from `blas.py`).
- Metal/CUDA, `dtype=None`/"auto": weights stay as stored (quantized stays quantized).
- "float32"/"float16"/"bfloat16": dequantize everything and cast to that dtype.
- "quantized": keep quantized weights quantized on any backend (slow on the CPU).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, cast

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.quantized import QuantizedEmbedding, QuantizedLinear
from mlx.utils import tree_flatten, tree_unflatten

from compat_serve.models.errors import ModelLoadError

__all__ = [
    "DTYPE_CHOICES",
    "Backend",
    "QuantParams",
    "WeightPlan",
    "cast_floating",
    "compute_backend",
    "dequantize",
    "dequantize_model",
    "flat_arrays",
    "infer_quant_params",
    "model_arrays",
    "mx_dtype",
    "param_shapes",
    "quantized_prefixes",
    "resolve_dtype",
]

logger = logging.getLogger(__name__)

Backend = Literal["cpu", "metal", "cuda"]
DTYPE_CHOICES: tuple[str, ...] = ("auto", "float32", "float16", "bfloat16", "quantized")
_FLOAT_DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
}


def compute_backend() -> Backend:
    """The backend MLX runs on by default in this process."""
    if mx.default_device() == mx.gpu:
        if mx.metal.is_available():
            return "metal"
        cuda = getattr(mx, "cuda", None)
        if cuda is not None and cuda.is_available():
            return "cuda"
    return "cpu"


def mx_dtype(name: str) -> mx.Dtype:
    try:
        return _FLOAT_DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"unknown float dtype {name!r}") from None


@dataclass(frozen=True)
class WeightPlan:
    """What to do with the weights: `dense` None means "keep quantized ones quantized"."""

    backend: Backend
    dense: str | None  # "float32" | "float16" | "bfloat16" | None
    requested: str

    @property
    def keep_quantized(self) -> bool:
        return self.dense is None


def resolve_dtype(
    requested: str | None, backend: Backend | None = None, *, warn: bool = True
) -> WeightPlan:
    """Apply the dtype rule (module docstring) to a user request."""
    backend = backend or compute_backend()
    req = (requested or "auto").lower()
    if req not in DTYPE_CHOICES:
        raise ModelLoadError(
            f"unknown dtype {requested!r}; choose one of {', '.join(DTYPE_CHOICES)}"
        )
    if req == "auto":
        return WeightPlan(backend, "float32" if backend == "cpu" else None, req)
    if req == "quantized":
        if backend == "cpu" and warn:
            logger.warning(
                "keeping weights quantized on the CPU backend: MLX's CPU quantized matmul is "
                "~15x slower than dense float32"
            )
        return WeightPlan(backend, None, req)
    return WeightPlan(backend, req, req)


@dataclass(frozen=True)
class QuantParams:
    group_size: int
    bits: int
    mode: str = "affine"

    def as_dict(self) -> dict[str, Any]:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}


def infer_quant_params(
    weight: mx.array, scales: mx.array, in_dims: int, *, name: str = "?"
) -> QuantParams:
    """Bits and group size of an MLX affine-quantized weight whose dense shape is [..., in_dims]."""
    packed = int(weight.shape[-1])
    bits, rem = divmod(packed * 32, in_dims)
    group_size, grem = divmod(in_dims, int(scales.shape[-1]))
    if rem or grem or bits not in (2, 3, 4, 5, 6, 8):
        raise ModelLoadError(
            f"cannot infer quantization of {name}: packed width {packed}, "
            f"{scales.shape[-1]} groups, {in_dims} input features"
        )
    return QuantParams(group_size=group_size, bits=bits)


def dequantize(
    weight: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    params: QuantParams,
    dtype: mx.Dtype = mx.float32,
    global_scale: mx.array | None = None,
) -> mx.array:
    """Dense weight, computed in float32 (GGUF stores f16 scales/minimums; llama.cpp dequantizes
    them in f32 too) and then cast to `dtype`. The floating-point modes (mxfp4 — gpt-oss's
    own format —, nvfp4, mxfp8) keep their 8-bit scales as stored: MLX reads them as
    uint8 exponents / e4m3 values, not as numbers to cast."""
    affine = params.mode == "affine"
    dense = mx.dequantize(
        weight,
        scales.astype(mx.float32) if affine else scales,
        None if biases is None else biases.astype(mx.float32),
        group_size=params.group_size,
        bits=params.bits,
        mode=params.mode,
        global_scale=global_scale,
        dtype=mx.float32,
    )
    return dense if dense.dtype == dtype else dense.astype(dtype)


def quantized_prefixes(names: Iterable[str]) -> list[str]:
    """Module paths that have a packed `.weight` plus `.scales`."""
    names = set(names)
    return sorted(n[: -len(".scales")] for n in names if n.endswith(".scales"))


def dequantize_model(model: Module, dtype: mx.Dtype = mx.float32) -> int:
    """Replace every quantized layer of an mlx-lm model with a dense one, in place.

    Returns how many layers were replaced. Dequantization is computed in float32.
    """
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    replaced: list[tuple[str, Module]] = []
    untyped: Any = model
    for name, module in untyped.named_modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding, QuantizedSwitchLinear)):
            mode = str(getattr(module, "mode", "affine"))
            params = QuantParams(int(module.group_size), int(module.bits), mode)
            biases = module.get("biases") if "biases" in module else None
            scale = module.get("global_scale") if "global_scale" in module else None
            weight = dequantize(module["weight"], module["scales"], biases, params, dtype, scale)
            has_bias = "bias" in module
            dense: Module
            if isinstance(module, QuantizedEmbedding):
                dense = Embedding(int(weight.shape[0]), int(weight.shape[1]))
            elif isinstance(module, QuantizedLinear):
                dense = Linear(int(weight.shape[1]), int(weight.shape[0]), bias=has_bias)
            else:
                n_exp, out_dims, in_dims = (int(d) for d in weight.shape)
                dense = SwitchLinear(in_dims, out_dims, n_exp, bias=has_bias)
            dense["weight"] = weight
            if has_bias:
                dense["bias"] = module["bias"]
            replaced.append((name, dense))
    if replaced:
        model.update_modules(cast(dict[str, Any], tree_unflatten(replaced)))
    return len(replaced)


def cast_floating(model: Module, dtype: mx.Dtype) -> None:
    """Cast every floating-point parameter of `model` to `dtype` (integers untouched)."""
    model.set_dtype(dtype, lambda d: bool(mx.issubdtype(d, mx.floating)))


def model_arrays(model: Module) -> dict[str, mx.array]:
    """Parameter name -> array of a module (mlx's `Module.parameters` is untyped)."""
    untyped: Any = model
    return flat_arrays(untyped.parameters())


def flat_arrays(tree: Any) -> dict[str, mx.array]:
    """Dotted name -> array for every array leaf of an MLX parameter tree."""
    flat: dict[str, Any] = {}
    tree_flatten(tree, destination=flat)
    return {k: v for k, v in flat.items() if isinstance(v, mx.array)}


def param_shapes(model: Module) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, without materializing anything."""
    return {k: tuple(int(d) for d in v.shape) for k, v in model_arrays(model).items()}
