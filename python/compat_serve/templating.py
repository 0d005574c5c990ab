"""Chat templating: Hugging Face chat templates rendered by the Rust core.

Renders like transformers' `apply_chat_template(..., tokenize=False)` (its jinja2
environment, byte for byte) but compiled once in Rust and rendered without the GIL.
Messages, tools and extra variables are plain JSON-like data; the whole context is
converted to JSON once per render.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from compat_serve._native import ChatTemplate as _NativeChatTemplate
from compat_serve._native import TemplateError

__all__ = ["ChatTemplate", "TemplateError"]


class ChatTemplate:
    """A compiled chat template.

    `now` pins what `strftime_now()` reports (naive local time); by default the
    wall clock is read at each render, as transformers does.

    Raises `TemplateError` if the source does not compile.
    """

    __slots__ = ("_native",)

    def __init__(self, source: str, *, now: datetime | None = None) -> None:
        self._native = _NativeChatTemplate(source, now=now)

    @property
    def source(self) -> str:
        return self._native.source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        bos_token: str | None = None,
        eos_token: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders the prompt text.

        `tools` and `documents` reach the template as `None` when not given (as in
        transformers); `bos_token`/`eos_token` only when given. Extra keyword
        arguments (`enable_thinking=...`, `documents=...`) become template variables.
        Raises `TemplateError` when the template fails or calls `raise_exception`.
        """
        return self._native.render(
            messages,
            tools,
            add_generation_prompt,
            bos_token,
            eos_token,
            **kwargs,
        )

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} bytes)"
