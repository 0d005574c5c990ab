"""Responses tools → the chat tools the template and the parsers see, and back.

- `function` tools pass through (name, description, JSON schema).
- `custom` tools (freeform text, optionally a Lark or regex grammar) become a function
  with one string parameter, `input`; a call comes back as a `custom_tool_call` whose
  `input` is that string, verbatim. When a custom tool is forced by name, the whole
  output is its input instead, constrained by its grammar (see adapter.py).
- `namespace` tools (MCP servers) are flattened to `<namespace>__<name>` functions; a
  call comes back with separate `namespace` and `name`.
- Hosted tools (`web_search`, `image_generation`, `tool_search`, ...) are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from compat_serve.engine.types import Grammar
from compat_serve.server.output_format import bad, lark_grammar, regex_grammar
from compat_serve.server.responses.lark_regex import lark_to_regex
from compat_serve.server.tool_schemas import prompt_schema

CUSTOM_INPUT = "input"


@dataclass(frozen=True)
class ToolEntry:
    kind: str  # "function" | "custom"
    name: str  # the name the client knows
    namespace: str | None = None
    # A custom tool's input grammar (None: free text).
    grammar: Grammar | None = None


@dataclass
class ResponseTools:
    """A request's tools: template-shaped chat tools, and how a call maps back."""

    chat_tools: list[dict[str, Any]] = field(default_factory=list)
    by_chat_name: dict[str, ToolEntry] = field(default_factory=dict)

    def entry(self, chat_name: str) -> ToolEntry:
        """What a generated call names (an unknown name stays a function call)."""
        return self.by_chat_name.get(chat_name) or ToolEntry("function", chat_name)

    def find(self, name: str, namespace: str | None = None) -> str | None:
        """The chat name of a client's tool, None if it has none."""
        for chat_name, entry in self.by_chat_name.items():
            if entry.name == name and entry.namespace == namespace:
                return chat_name
        return None

    def only(self, chat_names: set[str]) -> ResponseTools:
        keep = [t for t in self.chat_tools if t["function"]["name"] in chat_names]
        return ResponseTools(keep, {n: e for n, e in self.by_chat_name.items() if n in chat_names})


def custom_input_schemas(tools: ResponseTools) -> list[tuple[str, str]]:
    """(field, JSON schema text) of each custom tool's input string with a pattern, as
    the call grammar of all tools embeds it. The route compiles each alone, so a pattern
    that does not compile is a 400 naming its tool's `format.definition` rather than
    `tools` (the whole call grammar)."""
    out = []
    for tool in tools.chat_tools:
        function = tool["function"]
        entry = tools.by_chat_name.get(function["name"])
        if entry is None or entry.kind != "custom" or entry.grammar is None:
            continue  # function tools' parameters are any JSON schema: not ours to read
        value = function["parameters"]["properties"][CUSTOM_INPUT]  # _custom's own shape
        if "pattern" in value:
            out.append((entry.grammar.field, json.dumps(value)))
    return out


def chat_name(name: str, namespace: str | None) -> str:
    """How a tool's name appears to the model (and in history sent back)."""
    if not namespace:
        return name
    joiner = "" if namespace.endswith(("_", ".", "/")) else "__"
    return f"{namespace}{joiner}{name}"


def _text(value: object, where: str, *, required: bool = False) -> str | None:
    if value is None:
        if required:
            raise bad(where, "field required")
        return None
    if not isinstance(value, str) or (required and not value):
        raise bad(where, "must be a non-empty string" if required else "must be a string")
    return value


def _custom_grammar(fmt: object, where: str) -> Grammar | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad(where, "must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind != "grammar":
        raise bad(f"{where}.type", f"must be 'text' or 'grammar', not {kind!r}")
    syntax = fmt.get("syntax")
    definition = fmt.get("definition")
    if syntax == "lark":
        return lark_grammar(definition, f"{where}.definition")
    if syntax == "regex":
        return regex_grammar(definition, f"{where}.definition")
    raise bad(f"{where}.syntax", f"must be 'lark' or 'regex', not {syntax!r}")


def _function(tool: dict[str, Any], where: str, namespace: str | None) -> dict[str, Any]:
    name = _text(tool.get("name"), f"{where}.name", required=True)
    assert name is not None
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad(f"{where}.parameters", "must be a JSON schema object")
    strict = tool.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"{where}.strict", "must be a boolean")
    function: dict[str, Any] = {"name": chat_name(name, namespace)}
    description = _text(tool.get("description"), f"{where}.description")
    if description:
        function["description"] = description
    function["parameters"] = prompt_schema(parameters or {"type": "object", "properties": {}})
    return function


def _custom(
    tool: dict[str, Any], where: str, namespace: str | None
) -> tuple[dict[str, Any], Grammar | None]:
    name = _text(tool.get("name"), f"{where}.name", required=True)
    assert name is not None
    grammar = _custom_grammar(tool.get("format"), f"{where}.format")
    description = _text(tool.get("description"), f"{where}.description") or ""
    value: dict[str, Any] = {"type": "string", "description": "the raw input"}
    if grammar is not None and grammar.kind == "regex":
        # The call's JSON string is constrained too.
        value["pattern"] = f"^(?:{grammar.source})$"
    elif grammar is not None and grammar.kind == "lark":
        # A regular Lark grammar (Codex's apply_patch) becomes the JSON string's pattern;
        # any other applies only when the tool is forced (see adapter.py).
        pattern = lark_to_regex(grammar.source)
        if pattern is not None:
            value["pattern"] = f"^(?:{pattern})$"
    function = {
        "name": chat_name(name, namespace),
        "description": (description + "\n" if description else "")
        + "Freeform tool: put the raw input text in `input`.",
        "parameters": {
            "type": "object",
            "properties": {CUSTOM_INPUT: value},
            "required": [CUSTOM_INPUT],
        },
    }
    return function, grammar


def response_tools(tools: list[Any] | None) -> ResponseTools:
    out = ResponseTools()

    def add(tool: object, where: str, namespace: str | None) -> None:
        if not isinstance(tool, dict):
            raise bad(where, "must be a tool object")
        kind = tool.get("type")
        if kind == "function":
            function = _function(tool, where, namespace)
            entry = ToolEntry("function", tool["name"], namespace)
        elif kind == "custom":
            function, grammar = _custom(tool, where, namespace)
            entry = ToolEntry("custom", tool["name"], namespace, grammar)
        elif kind == "namespace" and namespace is None:
            ns = _text(tool.get("name"), f"{where}.name", required=True)
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise bad(f"{where}.tools", "must be a list of function or custom tools")
            for k, sub in enumerate(inner):
                if isinstance(sub, dict) and sub.get("type") not in ("function", "custom"):
                    raise bad(f"{where}.tools[{k}].type", "must be 'function' or 'custom'")
                add(sub, f"{where}.tools[{k}]", ns)
            return
        elif isinstance(kind, str) and kind:
            return  # a hosted tool (web_search, tool_search, ...): not ours to run
        else:
            raise bad(f"{where}.type", "field required")
        if function["name"] in out.by_chat_name:
            raise bad(f"{where}.name", f"duplicate tool name {function['name']!r}")
        out.chat_tools.append({"type": "function", "function": function})
        out.by_chat_name[function["name"]] = entry

    for i, tool in enumerate(tools or []):
        add(tool, f"tools[{i}]", None)
    return out
