"""Probe a chat template once at load time to choose how to render conversations.

Two questions, answered by rendering small marker conversations with the real template:

* Inline system messages (role `system` after the first turn, as Claude Code sends):
  `preserve` when the template renders them in place with their own role and leaves
  everything before them untouched (best for prefix caching); otherwise `fold`
  (merge into the neighbouring user turn). A template that raises, drops the message,
  moves it, or renders it exactly like a user message gets `fold`.
* Alternation: if two consecutive user turns make the template raise, consecutive
  same-role messages must be merged before rendering.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from compat_serve.chat.types import Message

# render(messages, add_generation_prompt) -> text; raises on template errors.
Render = Callable[[list[Message], bool], str]
# render_tools(messages, tools) -> text, with add_generation_prompt.
RenderTools = Callable[[list[Message], list[dict[str, object]]], str]

_S0 = "Leading system text 7Q1."
_U1 = "First user question 7Q2."
_SX = "Inline system note 7Q4."
_U2 = "Second user question 7Q5."
_T1 = "Tool output 7Q6."


def _msg(role: str, content: str) -> Message:
    return {"role": role, "content": content}


_TOOL_CALL: Message = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "id": "call_probe",
            "type": "function",
            "function": {"name": "lookup", "arguments": {"q": "x"}},
        }
    ],
}
_TOOL_RESULT: Message = {"role": "tool", "tool_call_id": "call_probe", "content": _T1}

# (name, messages before the inline system message, anchor text that must precede it,
#  messages after it, add_generation_prompt)
_SCENARIOS: list[tuple[str, list[Message], str, list[Message], bool]] = [
    ("mid", [_msg("system", _S0), _msg("user", _U1)], _U1, [_msg("user", _U2)], True),
    ("trailing", [_msg("system", _S0), _msg("user", _U1)], _U1, [], True),
    ("after-tool-result", [_msg("system", _S0), _msg("user", _U1), _TOOL_CALL, _TOOL_RESULT],
     _T1, [_msg("user", _U2)], True),
]  # fmt: skip


@dataclass(frozen=True)
class TemplateTraits:
    inline_system: str  # "preserve" | "fold"
    inline_system_reason: str
    requires_alternation: bool
    # False when the template ignores `tools`: tool-using clients' definitions vanish.
    renders_tools: bool = True
    # What the template writes to end an assistant turn ("<|im_end|>", "[e~[", ...; ""
    # when it cannot tell): where an echoed reply's rendering ends (chat/reply_splice.py).
    assistant_turn_end: str = ""


def _render(render: Render, messages: list[Message], gen: bool) -> str | Exception:
    try:
        return render(messages, gen)
    except Exception as exc:  # any template failure is an answer, not a crash
        return exc


def _inline_verdict(render: Render) -> tuple[str, str]:
    for name, before, anchor, after, gen in _SCENARIOS:
        # The same conversation without the inline message: the text before it must not
        # change. (Strict-alternation templates reject that; then compare with what was
        # rendered before the inline message arrived.)
        baseline = _render(render, [*before, *after], gen)
        if isinstance(baseline, Exception):
            baseline = _render(render, before, False)
        if isinstance(baseline, Exception) or anchor not in baseline:
            if name == "after-tool-result":
                continue  # the template cannot render tool results at all: nothing to learn
            return "fold", f"{name}: template cannot render the conversation before it"
        with_inline = _render(render, [*before, _msg("system", _SX), *after], gen)
        if isinstance(with_inline, Exception):
            return "fold", f"{name}: template raises ({type(with_inline).__name__})"
        if with_inline.count(_SX) != 1:
            return "fold", f"{name}: template drops the inline system message"
        at, anchor_at = with_inline.index(_SX), with_inline.find(anchor)
        if anchor_at == -1 or anchor_at > at:
            return "fold", f"{name}: template moves the inline system message"
        if after and with_inline.find(_U2) < at:
            return "fold", f"{name}: template moves the inline system message"
        cut = anchor_at + len(anchor)
        if baseline[:cut] != with_inline[:cut]:
            return "fold", f"{name}: inline system message changes the text before it"
        as_user = _render(render, [*before, _msg("user", _SX), *after], gen)
        if as_user == with_inline:
            return "fold", f"{name}: template renders it exactly like a user message"
    return "preserve", "template renders inline system messages in place"


def _requires_alternation(render: Render) -> bool:
    pair = [_msg("user", _U1), _msg("user", _U2)]
    return isinstance(_render(render, pair, True), Exception) and not isinstance(
        _render(render, [_msg("user", _U1 + "\n" + _U2)], True), Exception
    )


_PROBE_TOOL: dict[str, object] = {
    "type": "function",
    "function": {
        "name": "probe_tool_7q8",
        "description": "Probe tool.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}


def _renders_tools(render_tools: RenderTools) -> bool:
    try:
        return "probe_tool_7q8" in render_tools([_msg("user", _U1)], [_PROBE_TOOL])
    except Exception:  # a template that raises on tools does not render them either
        return False


_ANSWER = "Probe answer 7Q9."


def _assistant_turn_end(render: Render) -> str:
    """The text after an assistant message's content when it ends the conversation,
    without white space."""
    text = _render(render, [_msg("user", _U1), _msg("assistant", _ANSWER)], False)
    if isinstance(text, Exception) or text.count(_ANSWER) != 1:
        return ""
    return text[text.index(_ANSWER) + len(_ANSWER) :].strip()


def probe_template(render: Render, render_tools: RenderTools | None = None) -> TemplateTraits:
    policy, reason = _inline_verdict(render)
    tools = _renders_tools(render_tools) if render_tools is not None else True
    return TemplateTraits(
        policy, reason, _requires_alternation(render), tools, _assistant_turn_end(render)
    )
