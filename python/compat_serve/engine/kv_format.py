"""What the model's KV cache is made of, and how big the weights are: for the dashboard.

Read from shapes and dtypes only (no array is evaluated), so any thread may call these.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any


def _dtype_name(array: Any) -> str:
    return str(array.dtype).removeprefix("mlx.core.")


def describe_kv_cache(cache: Iterable[Any]) -> dict[str, Any]:
    """Layer cache kinds with their counts (`{"KVCache": 30}`), the K/V element type
    ("float16", "uint32" for packed quantized K/V) and the quantization bits when quantized.
    Nested caches (`caches`) are walked."""
    kinds: Counter[str] = Counter()
    dtypes: set[str] = set()
    bits: set[int] = set()

    def walk(layers: Iterable[Any]) -> None:
        for layer in layers:
            nested = getattr(layer, "caches", None)
            if isinstance(nested, (list, tuple)):
                walk(nested)
                continue
            kinds[type(layer).__name__] += 1
            keys = getattr(layer, "keys", None)
            first = keys[0] if isinstance(keys, (tuple, list)) and keys else keys
            if first is not None and hasattr(first, "dtype"):
                dtypes.add(_dtype_name(first))
            if isinstance(getattr(layer, "bits", None), int):
                bits.add(layer.bits)

    walk(cache)
    out: dict[str, Any] = {
        "layers": dict(sorted(kinds.items())),
        "dtype": "/".join(sorted(dtypes)) or None,
    }
    if bits:
        out["bits"] = sorted(bits)
    return out


def parameter_bytes(model: Any) -> int:
    """Bytes of every parameter array of an mlx `Module` (quantized weights as stored)."""
    from mlx.utils import tree_flatten

    arrays: Any = tree_flatten(model.parameters())
    return sum(int(array.nbytes) for _, array in arrays)
