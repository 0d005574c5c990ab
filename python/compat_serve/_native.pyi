"""Type stubs for the Rust extension `compat_serve._native` (checked by mypy.stubtest)."""

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, final

__all__ = ["ChatTemplate", "TemplateError", "__version__"]

__version__: str

class TemplateError(Exception):
    """A chat template failed to compile, failed to render, or called raise_exception()."""

@final
class ChatTemplate:
    """A compiled Hugging Face chat template, rendered like transformers does."""

    def __new__(cls, source: str, *, now: datetime | None = None) -> ChatTemplate: ...
    @property
    def source(self) -> str:
        """The template source as given."""

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        bos_token: str | None = None,
        eos_token: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders `messages` (plus `tools`, `documents` and any extra variables)."""
