"""Model loading: the embedded default GGUF, GGUF files, MLX/HF directories and hub ids.

Importing this package (or `compat_serve.models.blas`) never imports mlx: the fast-BLAS hook
must run before `mlx.core` is loaded. Everything that needs mlx is imported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from compat_serve.models.blas import BlasStatus, ensure_fast_blas, fast_blas_status
from compat_serve.models.errors import EmbeddedModelMissingError, ModelLoadError

if TYPE_CHECKING:
    from compat_serve.models.convert import convert_gguf
    from compat_serve.models.loader import load_model
    from compat_serve.models.tokenizer import Tokenizer
    from compat_serve.models.types import LoadedModel

__all__ = [
    "BlasStatus",
    "EmbeddedModelMissingError",
    "LoadedModel",
    "ModelLoadError",
    "Tokenizer",
    "convert_gguf",
    "ensure_fast_blas",
    "fast_blas_status",
    "load_model",
]

_LAZY = {
    "load_model": "compat_serve.models.loader",
    "convert_gguf": "compat_serve.models.convert",
    "Tokenizer": "compat_serve.models.tokenizer",
    "LoadedModel": "compat_serve.models.types",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
