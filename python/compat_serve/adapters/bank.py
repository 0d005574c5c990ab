"""The adapters a loaded model serves, each applied to its own rows of a forward.

`AdapterBank.install(model)` switches the class of every linear inside the decoder
layers (`nn.Linear`, `nn.QuantizedLinear`, and the CPU path's `SkinnyLinear`: whatever
class is there, subclassed) to one that adds a low-rank delta per row:

    y = base(x) + (x @ A[slot_r]) @ B[slot_r]

`A` `[slots, in, r]` and `B` `[slots, r, out]` stack every adapter's matrices for that
linear (the scale folded into `B`, ranks zero-padded to the largest; slot 0 is "no
adapter" and holds zeros, as does the slot of an adapter that does not target this
linear). The base weights are never touched, so the model's parameters, names and
outputs without adapters stay what they were.

The runner sets the rows' slots around each forward (`use`): one slot for a request's
prefill chunk, one per row for batched decode. A forward whose rows all have no adapter
skips the delta entirely. The CPU path's fused modules (a llama block's decode step in
two Rust calls, the fused SwiGLU feed-forward: models/cpu_decode_block.py,
models/cpu_linear.py) read the projection weights themselves and would never call the
linears; while a forward has adapter rows they run their stock mlx-lm `__call__`
instead, which does.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.quantized import QuantizedLinear

from compat_serve.adapters.files import AdapterError, AdapterFiles, AdapterWeights


class _Rows:
    """The slots of the forward being built, shared by every wrapped module."""

    def __init__(self) -> None:
        # Per-row slot indices `[rows]`; None: no row has an adapter.
        self.slots: mx.array | None = None
        # The slot when every row has the same one (a prefill chunk): no gather.
        self.single: int | None = None


class _Stack:
    """One linear's stacked adapter matrices."""

    def __init__(self, a: mx.array, b: mx.array) -> None:
        self.a = a  # [slots, in, r]
        self.b = b  # [slots, r, out], scale folded in


def _lora_delta(rows: _Rows, stack: _Stack, x: mx.array) -> mx.array:
    if rows.single is not None:
        return (x @ stack.a[rows.single]) @ stack.b[rows.single]
    assert rows.slots is not None
    # x [rows, tokens, in] @ a [rows, in, r] @ b [rows, r, out], each row its own pair.
    if x.ndim != 3 or x.shape[0] != rows.slots.shape[0]:
        raise ValueError(f"adapter slots for {rows.slots.shape[0]} rows, input {x.shape}")
    return (x @ stack.a[rows.slots]) @ stack.b[rows.slots]


@functools.cache
def _lora_class(base: type) -> type:
    base_call = base.__call__

    def with_deltas(self: Any, x: mx.array) -> mx.array:
        y: mx.array = base_call(self, x)
        rows: _Rows = self._compat_lora_rows
        stack: _Stack | None = self._compat_lora
        if rows.slots is None or stack is None:
            return y
        return y + _lora_delta(rows, stack, x).astype(y.dtype)

    cls = type(base.__name__, (base,), {"__call__": with_deltas})
    cls.__qualname__ = f"LoRA[{base.__qualname__}]"
    return cls


@functools.cache
def _stock_when_active_class(fused: type) -> type:
    """A CPU fast-path module that runs its stock class's `__call__` while a forward has
    adapter rows (the stock code calls the linears, which add the deltas)."""
    fused_call, stock_call = fused.__call__, fused.__mro__[1].__call__

    def stock_when_active(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._compat_lora_rows.slots is not None:
            return stock_call(self, *args, **kwargs)
        return fused_call(self, *args, **kwargs)

    cls = type(fused.__name__, (fused,), {"__call__": stock_when_active})
    cls.__qualname__ = f"AdapterAware[{fused.__qualname__}]"
    return cls


def _fused_fast_paths() -> set[type]:
    from compat_serve.models.cpu_linear import fused_swiglu_classes

    return fused_swiglu_classes()


def _in_out(module: Any) -> tuple[int, int]:
    out_dims, packed = module.weight.shape
    if isinstance(module, QuantizedLinear):
        return packed * 32 // module.bits, out_dims
    return packed, out_dims


def _float_dtype(module: Any) -> mx.Dtype:
    """The activations' dtype the linear works in (its scales' for a quantized one)."""
    weight = module.scales if isinstance(module, QuantizedLinear) else module.weight
    return weight.dtype if mx.issubdtype(weight.dtype, mx.floating) else mx.float32


class AdapterBank:
    """The adapters of one loaded model; only the engine thread changes or uses it."""

    def __init__(self, targets: dict[str, Any], rows: _Rows, args: object = None) -> None:
        # The model's config (mlx-lm's `ModelArgs`), to compare with a named base model.
        self._args = args
        self._targets = targets  # module path → wrapped linear
        self._rows = rows
        self._adapters: dict[str, AdapterWeights] = {}
        self._slots: dict[str, int] = {}  # name → slot (1...)
        self._rank = 0  # the stacks' padded rank

    @classmethod
    def install(cls, model: Module) -> AdapterBank:
        """Wrap the decoder layers' linears of `model` (once per model: a second call
        returns the bank installed first). With no adapter added nothing changes."""
        untyped: Any = model
        existing = getattr(untyped, "_compat_adapter_bank", None)
        if isinstance(existing, AdapterBank):
            return existing
        rows = _Rows()
        targets: dict[str, Any] = {}
        fused = _fused_fast_paths()
        for path, module in untyped.named_modules():
            kind: type = type(module)
            if hasattr(module, "_compat_decode_block") or kind in fused:
                module._compat_lora_rows = rows
                module.__class__ = _stock_when_active_class(kind)
            elif ".layers." in f".{path}" and isinstance(module, (Linear, QuantizedLinear)):
                module._compat_lora_rows = rows
                module._compat_lora = None
                module.__class__ = _lora_class(kind)
                targets[path] = module
        bank = cls(targets, rows, getattr(untyped, "args", None))
        untyped._compat_adapter_bank = bank
        return bank

    # ---- the adapters --------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._adapters)

    def info(self, name: str) -> AdapterFiles:
        return self._adapter(name).files

    def slot(self, name: str) -> int:
        self._adapter(name)
        return self._slots[name]

    def add(self, name: str, weights: AdapterWeights) -> None:
        """Serve `weights` as `name` (replacing an adapter of that name). AdapterError
        when a matrix targets no linear of this model or its shape does not fit."""
        resolved = self._resolve(weights)
        self._check_base(weights.files)
        slot = self._slots.get(name) or self._free_slot()
        self._adapters[name] = weights
        self._slots[name] = slot
        self._rebuild(dict(resolved))

    def remove(self, name: str) -> None:
        self._adapter(name)
        del self._adapters[name]
        del self._slots[name]
        self._rebuild({})

    def _adapter(self, name: str) -> AdapterWeights:
        weights = self._adapters.get(name)
        if weights is None:
            raise KeyError(
                f"no adapter named {name!r} (loaded: {', '.join(self._adapters) or 'none'})"
            )
        return weights

    def _free_slot(self) -> int:
        used = set(self._slots.values())
        return next(s for s in range(1, len(used) + 2) if s not in used)

    def _resolve(self, weights: AdapterWeights) -> list[tuple[str, str]]:
        """(adapter's module name, this model's module path) per matrix pair, checked."""
        files = weights.files
        where = f"{files.path}: adapter {files.name!r}"
        out = []
        for module, (a, b) in weights.modules.items():
            path = self._target_path(module)
            if path is None:
                raise AdapterError(f"{where}: {module} is not a linear layer of this model")
            in_dims, out_dims = _in_out(self._targets[path])
            if a.shape[0] != in_dims or b.shape[1] != out_dims:
                raise AdapterError(
                    f"{where}: {module} has LoRA matrices {a.shape} and {b.shape}, which do "
                    f"not fit the model's {in_dims} -> {out_dims} layer (another base model?)"
                )
            out.append((path, module))
        return out

    def _target_path(self, module: str) -> str | None:
        if module in self._targets:
            return module
        # A model whose tree nests the language model differently (a VLM's
        # language_model.model.layers...): match from "layers." on, if unique.
        at = module.find("layers.")
        if at < 0:
            return None
        tail = "." + module[at:]
        matches = [p for p in self._targets if ("." + p).endswith(tail)]
        return matches[0] if len(matches) == 1 else None

    def _check_base(self, files: AdapterFiles) -> None:
        """When the config names a base model that is a local directory, its config
        must agree with this model's on the architecture (a hub id or a missing folder
        is not checked: the shapes were)."""
        if files.base_model is None or self._args is None:
            return
        config_path = Path(files.base_model).expanduser() / "config.json"
        try:
            named = json.loads(config_path.read_text())
        except (OSError, ValueError):
            return
        if not isinstance(named, dict):
            return
        for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
            ours = getattr(self._args, key, None)
            if ours is not None and key in named and named[key] != ours:
                raise AdapterError(
                    f"{files.path}: adapter {files.name!r} was trained on {files.base_model} "
                    f"({key} {named[key]}), not this model ({key} {ours})"
                )

    def _rebuild(self, paths_of: dict[str, str]) -> None:
        """Restack every targeted linear's matrices from the adapters now held."""
        per_path: dict[str, list[tuple[int, np.ndarray, np.ndarray, float]]] = {}
        rank = 0
        for name, weights in self._adapters.items():
            slot = self._slots[name]
            for module, (a, b) in weights.modules.items():
                path = paths_of.get(module) or self._target_path(module)
                assert path is not None  # checked when added
                per_path.setdefault(path, []).append((slot, a, b, weights.files.scale))
                rank = max(rank, a.shape[1])
        slots = max(self._slots.values(), default=0) + 1
        for path, module in self._targets.items():
            entries = per_path.get(path)
            if not entries:
                module._compat_lora = None
                continue
            in_dims, out_dims = _in_out(module)
            a_stack = np.zeros((slots, in_dims, rank), dtype=np.float32)
            b_stack = np.zeros((slots, rank, out_dims), dtype=np.float32)
            for slot, a, b, scale in entries:
                a_stack[slot, :, : a.shape[1]] = a
                b_stack[slot, : b.shape[0], :] = scale * b.astype(np.float32)
            dtype = _float_dtype(module)
            stack = _Stack(mx.array(a_stack).astype(dtype), mx.array(b_stack).astype(dtype))
            mx.eval(stack.a, stack.b)
            module._compat_lora = stack
        self._rank = rank

    # ---- a forward -----------------------------------------------------------------

    @contextlib.contextmanager
    def use(self, adapters: Sequence[str | None] | None) -> Iterator[None]:
        """Build the forward inside with each row's adapter (`adapters[row]`, None: the
        base model). An unknown name is a KeyError (the engine checked it at submit)."""
        slots = [0 if n is None else self.slot(n) for n in adapters or ()]
        rows = self._rows
        if any(slots):
            rows.slots = mx.array(slots, dtype=mx.int32)
            rows.single = slots[0] if len(set(slots)) == 1 else None
        try:
            yield
        finally:
            rows.slots = None
            rows.single = None


def bank_of(model: Module) -> AdapterBank | None:
    """The bank installed on `model`, if any."""
    found = getattr(model, "_compat_adapter_bank", None)
    return found if isinstance(found, AdapterBank) else None
