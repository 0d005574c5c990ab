"""Every shared chat template x a set of conversations: our Rust renderer must equal
transformers' jinja2 rendering byte for byte, or both must raise.

jinja2 runs live (no stored expected strings) in the environment of
`tests/python/jinja_reference.py`, a rebuild of transformers'
`_cached_compile_jinja_template` on jinja2's `SandboxedEnvironment` (templates may
change lists and dicts, as Kimi K2's tool-call queue does);
`test_reference_matches_transformers` checks that rebuild, made immutable, against
transformers' own compiled templates. `strftime_now` is frozen to the same instant
on both sides.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
import pytest

from compat_serve.templating import ChatTemplate, TemplateError
from tests.python.jinja_reference import compile_template
from tests.shared_data import manifest_rows, templates_dir

FROZEN_NOW = datetime(2025, 3, 7, 8, 9, 10)


TEMPLATES_DIR = templates_dir()
TEMPLATE_FILES = sorted(TEMPLATES_DIR.glob("*.jinja"))


def frozen_strftime_now(fmt: str) -> str:
    return FROZEN_NOW.strftime(fmt)


MANIFEST = {row["file"]: row for row in manifest_rows()}

# ---------------------------------------------------------------------------
# Conversations
# ---------------------------------------------------------------------------

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather forecast for a city (°C or °F).",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. 'Paris' or \"Zürich\""},
                "units": {
                    "type": "string",
                    "enum": ["celsius", "fahrenheit"],
                    "default": "celsius",
                },
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "threshold": {"type": "number", "default": 0.5},
                "include_hourly": {"type": "boolean", "default": False},
            },
            "required": ["city"],
        },
    },
}

SEARCH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search_files",
        "description": "Search files <by> glob & regex.\nReturns matches.",
        "parameters": {
            "type": "object",
            "properties": {
                "patterns": {
                    "type": "array",
                    "description": "Patterns to try",
                    "items": {
                        "type": "object",
                        "properties": {
                            "glob": {"type": "string"},
                            "regex": {"type": ["string", "null"]},
                        },
                        "required": ["glob"],
                    },
                },
                "options": {
                    "type": "object",
                    "properties": {
                        "max_results": {"type": "integer", "default": 100},
                        "case_sensitive": {"type": "boolean"},
                    },
                },
            },
            "required": ["patterns"],
        },
    },
}

TOOLS = [WEATHER_TOOL, SEARCH_TOOL]

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def tool_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS: dict[str, dict[str, Any]] = {
    "single_turn": {"messages": [{"role": "user", "content": "Hello!"}]},
    "system_multi_turn": {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "2+2 is 4."},
            {"role": "user", "content": "And 3+3?"},
        ]
    },
    "tool_definitions": {
        "messages": [SYSTEM, {"role": "user", "content": "Weather in Paris?"}],
        "tools": TOOLS,
    },
    "tool_call_roundtrip": {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "Weather in Paris for 3 days?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    tool_call(
                        "call_1", "get_weather", {"city": "Paris", "days": 3, "threshold": 0.25}
                    )
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "name": "get_weather",
                "content": '{"temp_c": 21.5, "sky": "clear"}',
            },
            {"role": "assistant", "content": "It will be sunny, about 21.5 °C."},
            {"role": "user", "content": "Thanks!"},
        ],
        "tools": TOOLS,
    },
    "parallel_tool_calls": {
        "messages": [
            {"role": "user", "content": "Find *.rs files and check Oslo weather."},
            {
                "role": "assistant",
                "content": "Let me do both.",
                "tool_calls": [
                    tool_call(
                        "call_a",
                        "search_files",
                        {
                            "patterns": [{"glob": "**/*.rs", "regex": None}],
                            "options": {"max_results": 10, "case_sensitive": True},
                        },
                    ),
                    tool_call("call_b", "get_weather", {"city": "Oslo", "include_hourly": False}),
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "call_a",
                "name": "search_files",
                "content": "src/lib.rs",
            },
            {
                "role": "tool",
                "tool_call_id": "call_b",
                "name": "get_weather",
                "content": "-3 °C, snow",
            },
        ],
        "tools": TOOLS,
    },
    "unicode_content": {
        "messages": [
            SYSTEM,
            {
                "role": "user",
                "content": 'Ünïcödé 你好 👨‍👩‍👧 — it\'s "quoted" <b>&amp;</b>\\path\ttab\nnew line',
            },
            {"role": "assistant", "content": "Got it: 😀 ✓ ß→SS"},
            {"role": "user", "content": "  leading and trailing spaces  "},
        ]
    },
    "reasoning_enable_thinking": {
        "messages": [
            {"role": "user", "content": "Think about 17*23."},
            {
                "role": "assistant",
                "content": "17*23 = 391.",
                "reasoning_content": "17*20=340, 17*3=51, total 391.",
            },
            {"role": "user", "content": "Now 19*21?"},
        ],
        "kwargs": {"enable_thinking": True, "reasoning_effort": "high", "keep_past_thinking": True},
    },
    "thinking_disabled": {
        "messages": [SYSTEM, {"role": "user", "content": "Quick answer: capital of France?"}],
        "kwargs": {"enable_thinking": False},
    },
    # The inline-system probe of message normalization: [system, user, system, user].
    "inline_system": {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "First question."},
            {"role": "system", "content": "Reminder: answer briefly."},
            {"role": "user", "content": "Second question."},
        ]
    },
    "content_blocks": {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Part one."},
                    {"type": "text", "text": "Part two: ✓"},
                ],
            },
        ]
    },
    # An agent's tool loop: a call, its result, two parallel calls, their results,
    # the answer. Kimi K2 queues each call's id and pops one per result.
    "tool_loop_three_turns": {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "Find the Rust files, then the weather in Oslo and Rome."},
            {
                "role": "assistant",
                "content": "Searching first.",
                "tool_calls": [
                    tool_call("call_s", "search_files", {"patterns": [{"glob": "*.rs"}]})
                ],
            },
            {"role": "tool", "tool_call_id": "call_s", "name": "search_files", "content": "a.rs"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    tool_call("call_o", "get_weather", {"city": "Oslo"}),
                    tool_call("call_r", "get_weather", {"city": "Rome", "days": 2}),
                ],
            },
            {"role": "tool", "tool_call_id": "call_o", "name": "get_weather", "content": "-3 °C"},
            {"role": "tool", "tool_call_id": "call_r", "name": "get_weather", "content": "18 °C"},
            {"role": "assistant", "content": "a.rs; Oslo -3 °C, Rome 18 °C."},
            {"role": "user", "content": "Thanks."},
        ],
        "tools": TOOLS,
    },
    # Calls without ids and with string arguments (OpenAI's wire form): Kimi K2
    # Instruct numbers them `functions.NAME:N` and prints the string as it is.
    "tool_calls_without_ids": {
        "messages": [
            {"role": "user", "content": "Weather in Lyon and Nice?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Lyon"}},
                    },
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'},
                    },
                ],
            },
            {"role": "tool", "name": "get_weather", "content": "12 °C"},
            {"role": "tool", "name": "get_weather", "content": "16 °C"},
            {"role": "tool", "name": "get_weather", "content": "extra result, no call left"},
        ],
        "tools": [WEATHER_TOOL],
    },
    "null_content_tool_call": {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [tool_call("call_9", "get_weather", {"city": "Tōkyō", "days": 1})],
            },
            {"role": "tool", "tool_call_id": "call_9", "content": "晴れ 25.0 °C"},
        ],
        "tools": [WEATHER_TOOL],
    },
}

# Variables some templates cannot render without (MANIFEST `extra_context_vars`
# and notes: firefunction reads a `functions` string and a `datetime`).
REQUIRED_EXTRA_CONTEXT: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "fireworks-ai-llama-3-firefunction-v2.jinja": lambda conv: {
        "functions": json.dumps(
            [tool["function"] for tool in conv.get("tools") or TOOLS], indent=4
        ),
        "datetime": FROZEN_NOW.strftime("%Y-%m-%d %H:%M"),
    },
}


def special_tokens(template: str) -> dict[str, str]:
    row = MANIFEST.get(template, {})
    tokens = {}
    for name, column in (("bos_token", "probe_bos"), ("eos_token", "probe_eos")):
        if row.get(column):
            tokens[name] = row[column]
    return tokens


def build_context(template: str, conversation: str, add_generation_prompt: bool) -> dict[str, Any]:
    conv = CONVERSATIONS[conversation]
    context: dict[str, Any] = {
        "messages": copy.deepcopy(conv["messages"]),
        "tools": copy.deepcopy(conv.get("tools")),
        "add_generation_prompt": add_generation_prompt,
        **special_tokens(template),
        **copy.deepcopy(conv.get("kwargs", {})),
    }
    extra = REQUIRED_EXTRA_CONTEXT.get(template)
    if extra is not None:
        context.update(extra(conv))
    return context


def render_jinja2(source: str, context: dict[str, Any], *, immutable: bool = False) -> str:
    # As transformers calls it: tools and documents are always passed.
    template = compile_template(source, frozen_strftime_now, immutable=immutable)
    return template.render(**{"documents": None, **context})


@functools.lru_cache(maxsize=64)
def rust_template(source: str) -> ChatTemplate:
    """One compiled template per source, rendered for every conversation (as the server
    renders each request with its model's one template)."""
    return ChatTemplate(source, now=FROZEN_NOW)


def render_rust(source: str, context: dict[str, Any]) -> str:
    context = dict(context)
    messages = context.pop("messages")
    tools = context.pop("tools")
    add_generation_prompt = context.pop("add_generation_prompt")
    return rust_template(source).render(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, **context
    )


def parity_cases() -> list[Any]:
    if not TEMPLATE_FILES:
        return [pytest.param(None, "", False, id="templates-missing")]
    return [
        pytest.param(path.name, conv, gen, id=f"{path.stem}-{conv}-{'gen' if gen else 'nogen'}")
        for path in TEMPLATE_FILES
        for conv in CONVERSATIONS
        for gen in (True, False)
    ]


def test_templates_present() -> None:
    assert TEMPLATE_FILES, f"no *.jinja templates under {TEMPLATES_DIR} (set COMPAT_SHARED_DIR)"
    assert MANIFEST, f"missing {TEMPLATES_DIR / 'MANIFEST.tsv'}"


def test_required_extras_are_in_manifest() -> None:
    for template, make_extras in REQUIRED_EXTRA_CONTEXT.items():
        declared = MANIFEST[template]["extra_context_vars"].split(",")
        extras = make_extras(CONVERSATIONS["single_turn"])
        assert set(extras) <= set(declared), (template, declared)


@pytest.mark.parametrize(("template", "conversation", "add_generation_prompt"), parity_cases())
def test_parity(template: str | None, conversation: str, add_generation_prompt: bool) -> None:
    assert template is not None, f"no templates found under {TEMPLATES_DIR}"
    source = (TEMPLATES_DIR / template).read_text(encoding="utf-8")
    context = build_context(template, conversation, add_generation_prompt)

    expected: str | None = None
    expected_error: Exception | None = None
    try:
        expected = render_jinja2(source, copy.deepcopy(context))
    except Exception as exc:
        expected_error = exc

    if expected_error is not None:
        with pytest.raises(TemplateError) as info:
            render_rust(source, context)
        if type(expected_error) is jinja2.exceptions.TemplateError:
            # raise_exception(): the template's own message comes back verbatim.
            assert str(info.value) == str(expected_error)
        return

    assert render_rust(source, context) == expected


KIMI_K2_TEMPLATES = ("moonshotai-Kimi-K2-Instruct.jinja", "moonshotai-Kimi-K2.jinja")


@pytest.mark.parametrize("template", KIMI_K2_TEMPLATES)
def test_kimi_k2_renders_tool_loops(template: str) -> None:
    """Parity above also passes when both sides raise: here both must render."""
    source = (TEMPLATES_DIR / template).read_text(encoding="utf-8")
    context = build_context(template, "tool_loop_three_turns", True)
    prompt = render_rust(source, copy.deepcopy(context))
    assert prompt == render_jinja2(source, context)
    assert prompt.count("<|tool_call_begin|>") == 3
    assert prompt.count("## Return of ") == 3
    if template == "moonshotai-Kimi-K2-Instruct.jinja":
        # Each result is labelled with the queued id of its call, in order.
        for call_id in ("call_s", "call_o", "call_r"):
            assert f"## Return of {call_id}\n" in prompt
        unnamed = build_context(template, "tool_calls_without_ids", True)
        prompt = render_rust(source, copy.deepcopy(unnamed))
        assert prompt == render_jinja2(source, unnamed)
        assert "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>" in prompt
        assert 'functions.get_weather:2<|tool_call_argument_begin|>{"city": "Nice"}' in prompt
        assert "## Return of functions.get_weather:3\nextra result" in prompt


def test_reference_matches_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference environment renders exactly like transformers' own."""
    ctu = pytest.importorskip("transformers.utils.chat_template_utils")

    class FrozenDatetime(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> FrozenDatetime:
            return cls.fromtimestamp(FROZEN_NOW.timestamp(), tz)

    monkeypatch.setattr(ctu, "datetime", FrozenDatetime)
    assert TEMPLATE_FILES
    for path in TEMPLATE_FILES:
        source = path.read_text(encoding="utf-8")
        for conversation in ("tool_call_roundtrip", "unicode_content"):
            context = build_context(path.name, conversation, True)
            try:
                ours = render_jinja2(source, copy.deepcopy(context), immutable=True)
            except Exception as exc:
                ours = f"raised {type(exc).__name__}"
            hf_template = ctu._cached_compile_jinja_template(source)
            try:
                theirs = hf_template.render(**{"documents": None, **copy.deepcopy(context)})
            except Exception as exc:
                theirs = f"raised {type(exc).__name__}"
            assert ours == theirs, path.name
