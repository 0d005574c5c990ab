"""Typed access to the metadata dict `mx.load(path, return_metadata=True)` returns for a GGUF.

MLX hands scalars back as 0-d `mx.array`s, string arrays as `list[str]` and numeric arrays as
1-d `mx.array`s; this wrapper turns them into plain Python values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from compat_serve.models.errors import ModelLoadError

__all__ = ["GGUFMetadata"]


def _to_python(value: Any) -> Any:
    if isinstance(value, (str, bool, int, float, list)):
        return value
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    return value


class GGUFMetadata:
    """The key/value header of a GGUF file."""

    def __init__(self, raw: Mapping[str, Any], *, path: str = "<gguf>") -> None:
        # Plain Python values from here on: the tokenizer is built from them off the
        # engine thread (models/load_steps.py), with no MLX array left to read.
        self._raw = {key: _to_python(value) for key, value in raw.items()}
        self.path = path

    def __contains__(self, key: str) -> bool:
        return key in self._raw

    def keys(self) -> list[str]:
        return list(self._raw)

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self._raw:
            return default
        return _to_python(self._raw[key])

    def _missing(self, key: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: GGUF metadata has no {key!r}")

    def get_int(self, key: str, default: int | None = None) -> int | None:
        value = self.get(key)
        if value is None:
            return default
        if isinstance(value, list):  # a 1-element array
            value = value[0]
        return int(value)

    def require_int(self, key: str) -> int:
        value = self.get_int(key)
        if value is None:
            raise self._missing(key)
        return value

    def get_float(self, key: str, default: float | None = None) -> float | None:
        value = self.get(key)
        if value is None:
            return default
        if isinstance(value, list):
            value = value[0]
        # f32 metadata (1e-5, 1e5) comes back as the nearest f32: round to 7 significant digits.
        return float(f"{float(value):.7g}")

    def get_bool(self, key: str, default: bool | None = None) -> bool | None:
        value = self.get(key)
        if value is None:
            return default
        return bool(value)

    def get_str(self, key: str, default: str | None = None) -> str | None:
        value = self.get(key)
        if value is None:
            return default
        return str(value)

    def get_str_list(self, key: str) -> list[str] | None:
        value = self.get(key)
        if value is None:
            return None
        return [str(v) for v in value]

    def get_int_list(self, key: str) -> list[int] | None:
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, list):
            value = [value]
        return [int(v) for v in value]

    @property
    def architecture(self) -> str:
        arch = self.get_str("general.architecture")
        if arch is None:
            raise self._missing("general.architecture")
        return arch
