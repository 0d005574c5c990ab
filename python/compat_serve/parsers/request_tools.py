"""What a request's tools are, as the parsers and grammars see them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


class Vocabulary(Protocol):
    special_token_ids: frozenset[int]

    def token_to_id(self, token: str) -> int | None: ...


@dataclass(frozen=True)
class RequestTools:
    """The calls a request accepts: tool name → JSON schema of its parameters.

    Empty: no calls are parsed (no tools, or `tool_choice: none`), the output is text.
    """

    schemas: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # 1 when parallel tool use is disabled, or one named tool is forced
    max_calls: int | None = None

    @classmethod
    def from_chat_tools(
        cls,
        tools: Iterable[Mapping[str, Any]] | None,
        *,
        only: str | None = None,
        parallel: bool = True,
    ) -> RequestTools:
        """From template-shaped tools (`{"type": "function", "function": {...}}`).

        `only`: the tool a client forces by name (Anthropic `{"type": "tool"}`, OpenAI
        `{"type": "function"}`): exactly one call to it, whatever `parallel` says (a model
        that goes on writing calls would otherwise repeat it until `max_tokens`)."""
        schemas: dict[str, Mapping[str, Any]] = {}
        for tool in tools or ():
            function = tool.get("function") or {}
            name = function.get("name")
            if isinstance(name, str) and (only is None or name == only):
                parameters = function.get("parameters")
                schemas[name] = parameters if isinstance(parameters, Mapping) else {}
        return cls(schemas, None if parallel and only is None else 1)
