"""Decode-sized products of dense layers through compat-kernels' skinny matmul (CPU).

A decode step multiplies one row per running request by every weight matrix. OpenBLAS's
`sgemm` streams the weights at about half of memory bandwidth when the product has 2-16
rows, and MLX has no faster CPU kernel: the step is bound by those products.
`compat_serve._native.matmul_nt` (Rust, AVX-512, both cores) streams each weight row once
for up to 8 rows at a time, reading the MLX weight in place.

`install_skinny_linears(model)` switches the class of each exact dense float32 `Linear`
(and of the embedding, when it doubles as the LM head) to a subclass that sends products
of at most `MAX_KERNEL_ROWS` rows to the kernel and everything larger (prefill chunks) to
MLX as before. Parameters, names and shapes are unchanged. The kernel needs the weight
row-major `[out, in]`, mlx-lm's own layout, so this path replaces the input-major one of
`cpu_layout`. A row's result does not depend on the other rows of the batch, so batched
decode gives each request the bits it gets alone. `benches/cpu_paths.py` measures it.

Each kernel call evaluates its input first (MLX is lazy; the kernel needs numbers), so a
decode step synchronises once per dense layer: about 30 µs each, against the 0.3-1 ms the
kernel saves per product at batch 8.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear

from compat_serve._native import matmul_kernel, matmul_nt, swiglu_mlp
from compat_serve.models.kernel_perturbation import PERTURB, nudge

log = logging.getLogger(__name__)

# Products with at most this many rows go to the kernel: at 16 rows (two passes over the
# weights) it still beats OpenBLAS; from about 32 rows sgemm is faster (cpu_paths bench).
MAX_KERNEL_ROWS = 16


# `COMPAT_SERVE_CPU_KERNELS=off` loads models as on a CPU without AVX-512 (input-major
# weights, no Rust decode kernels), so CI runs that fallback on a machine that has them.
CPU_KERNELS_ENV = "COMPAT_SERVE_CPU_KERNELS"
_OFF = ("off", "0", "false", "no")


def kernels_disabled() -> bool:
    """True when the environment turns the Rust CPU kernels off (`CPU_KERNELS_ENV`)."""
    return os.environ.get(CPU_KERNELS_ENV, "").strip().lower() in _OFF


def kernel_available() -> bool:
    """True when the skinny kernel has a SIMD path on this CPU and is not turned off."""
    return not kernels_disabled() and matmul_kernel() != "scalar"


def _takes_kernel(x: mx.array, weight: mx.array) -> bool:
    rows = x.size // max(x.shape[-1], 1)
    return 0 < rows <= MAX_KERNEL_ROWS and x.dtype == mx.float32 and weight.dtype == mx.float32


def kernel_output(kernel: Callable[..., None], shape: tuple[int, ...], *operands: Any) -> mx.array:
    """Runs a `compat_serve._native` kernel: evaluates the MLX operands (the kernel reads
    their numbers), calls `kernel(*operands, out)` with a new float32 `out` of `shape` and
    returns `out` as an MLX array."""
    mx.eval([op for op in operands if isinstance(op, mx.array)])
    out = np.empty(shape, dtype=np.float32)
    kernel(*operands, out)
    if PERTURB:
        nudge(out)
    return mx.array(out)


def skinny_product(x: mx.array, weight: mx.array) -> mx.array:
    """`x @ weight.T` on the kernel: `x` `[..., in]`, `weight` `[out, in]` row-major."""
    out_shape = (*x.shape[:-1], weight.shape[0])
    return kernel_output(matmul_nt, out_shape, mx.contiguous(x), weight)


class SkinnyLinear(Linear):
    """`Linear` whose decode-sized products run on the skinny kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        if not _takes_kernel(x, weight):
            return super().__call__(x)
        y = skinny_product(x, weight)
        return y + self["bias"] if "bias" in self else y


class SkinnyEmbedding(Embedding):
    """Tied embedding whose LM-head products of few rows run on the skinny kernel."""

    def as_linear(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        if not _takes_kernel(x, weight):
            head: mx.array = super().as_linear(x)  # type: ignore[no-untyped-call]
            return head
        return skinny_product(x, weight)


# The feed-forward body of most mlx-lm models (llama, qwen, mistral, ...). A block whose
# `__call__` is exactly this line, with bias-free dense projections, runs in one kernel
# call when few rows come in: three products, the SiLU and the product in between.
_SWIGLU_BODY = "return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))"
_swiglu_classes: dict[type, type] = {}


def _is_plain_swiglu(cls: type) -> bool:
    call = cls.__dict__.get("__call__")
    if call is None:  # the block's own class must define the body
        return False
    try:
        lines = inspect.getsource(call).strip().splitlines()
    except (OSError, TypeError):
        return False
    from mlx_lm.models.activations import swiglu

    body = [line.strip() for line in lines[1:] if line.strip()]
    return body == [_SWIGLU_BODY] and getattr(call, "__globals__", {}).get("swiglu") is swiglu


def _skinny_swiglu_call(stock: Callable[[Any, mx.array], mx.array]) -> Any:
    def fused_call(self: Any, x: mx.array) -> mx.array:
        gate, up, down = self.gate_proj["weight"], self.up_proj["weight"], self.down_proj["weight"]
        if not _takes_kernel(x, gate):
            return stock(self, x)
        return kernel_output(swiglu_mlp, x.shape, mx.contiguous(x), gate, up, down)

    return fused_call


def fused_swiglu_classes() -> set[type]:
    """The SwiGLU block classes made so far whose decode steps run fused."""
    return set(_swiglu_classes.values())


def _fused_swiglu_class(cls: type) -> type:
    fused = _swiglu_classes.get(cls)
    if fused is None:
        fused = type(cls.__name__, (cls,), {"__call__": _skinny_swiglu_call(cls.__call__)})
        fused.__qualname__ = f"SkinnySwiGLU[{cls.__qualname__}]"
        _swiglu_classes[cls] = fused
    return fused


def _fuses_swiglu(module: Any) -> bool:
    if type(module) in _swiglu_classes.values() or not _is_plain_swiglu(type(module)):
        return False
    projections = [module.get(name) for name in ("gate_proj", "up_proj", "down_proj")]
    # A SkinnyLinear was installed only over a row-major float32 weight.
    return all(isinstance(p, SkinnyLinear) and "bias" not in p for p in projections)


def _modules(model: Module) -> list[Any]:
    untyped: Any = model
    return [module for _, module in untyped.named_modules()]


def _row_major_float32(weight: object) -> bool:
    if not (isinstance(weight, mx.array) and weight.ndim == 2 and weight.dtype == mx.float32):
        return False
    exported: Any = weight  # MLX arrays export the buffer protocol without declaring it
    return memoryview(exported).c_contiguous


def install_skinny_linears(model: Module) -> int:
    """Route decode-sized products of dense float32 layers to the kernel; returns how many.

    Only exact `Linear`/`Embedding` instances with a row-major 2-D float32 weight change:
    quantized layers, other dtypes, subclasses with their own arithmetic and anything else
    keep MLX. Idempotent.
    """
    changed = 0
    for module in _modules(model):
        kind = type(module)
        if kind not in (Linear, Embedding) or not _row_major_float32(module.get("weight")):
            continue
        module.__class__ = SkinnyLinear if kind is Linear else SkinnyEmbedding
        changed += 1
    fused = 0
    for module in _modules(model):
        if _fuses_swiglu(module):
            module.__class__ = _fused_swiglu_class(type(module))
            fused += 1
    log.debug(
        "%d dense layers use the skinny decode kernel; %d SwiGLU blocks run fused",
        changed,
        fused,
    )
    return changed
