"""Every native tool-call format's argument grammar enforces the schema it is given
(#34): `enum` (with and without `type`), `const`, `maxLength`, number bounds and
`required`, on a forced single call.

On the grammar itself (no model): one call, written as the format writes it, is
accepted and parses back exactly; the same call with one argument breaking the schema
is refused, whatever the argument; and seeded random walks through the grammar only
ever produce arguments valid against the schema. Gemma 4 wrote any value for an
`enum` without `type` (`unit: {"enum": ["c", "f"]}` came back as free text); one real
forced call on the embedded model checks its fix end to end.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

import httpx
import jsonschema
import pytest

from compat_serve.parsers.registry import TOOL_FORMATS
from compat_serve.parsers.request_tools import RequestTools
from tests.conftest import start_server
from tests.python.test_tool_grammars import (
    ARRAY_FORMATS,
    Vocab,
    Walk,
    _array_rendered,
    _compile,
    _native_rendered,
    _parse,
    _vocab,
)
from tests.shared_data import templates_dir

if TYPE_CHECKING:
    from compat_serve.models.tokenizer import Tokenizer
    from compat_serve.models.types import LoadedModel

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"enum": ["ls", "pwd"]},  # no `type`: what Gemma 4 ignored
        "unit": {"type": "string", "enum": ["c", "f"]},
        "mode": {"const": "fast"},
        "note": {"type": "string", "maxLength": 5},
        "timeout": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["command", "timeout"],
    "additionalProperties": False,
}
TOOLS = RequestTools({"run_command": SCHEMA}, max_calls=1)
VALID = {"command": "pwd", "unit": "f", "mode": "fast", "note": "hi", "timeout": 3}
# One argument broken at a time; each must be refused.
INVALID = {
    "enum without type": {**VALID, "command": "rm"},
    "enum": {**VALID, "unit": "k"},
    "const": {**VALID, "mode": "slow"},
    "maxLength": {**VALID, "note": "longer"},
    "maximum": {**VALID, "timeout": 9},
    "minimum": {**VALID, "timeout": 0},
    "required": {k: v for k, v in VALID.items() if k != "command"},
}
FORMATS = list(TOOL_FORMATS)
# Formats that write each argument as tagged text: a string the schema types as one is
# raw text there, any other value JSON (argument_grammar.tagged_arguments).
TAGGED = {
    "qwen3_coder": ("<tool_call>\n<function=run_command>\n", "</function>\n</tool_call>"),
    "seed_oss": ("<seed:tool_call>\n<function=run_command>\n", "</function>\n</seed:tool_call>"),
    "glm45": ("\n<tool_call>run_command\n", "</tool_call>"),
    "minimax_m2": (
        '<minimax:tool_call>\n<invoke name="run_command">\n',
        "</invoke>\n</minimax:tool_call>",
    ),
}


def _tagged_value(key: str, value: Any) -> str:
    return value if SCHEMA["properties"][key].get("type") == "string" else json.dumps(value)


def _tagged_pair(name: str, key: str, value: Any) -> str:
    text = _tagged_value(key, value)
    return {
        "qwen3_coder": f"<parameter={key}>\n{text}\n</parameter>\n",
        "seed_oss": f"<parameter={key}>{text}</parameter>\n",
        "glm45": f"<arg_key>{key}</arg_key>\n<arg_value>{text}</arg_value>\n",
        "minimax_m2": f'<parameter name="{key}">{text}</parameter>\n',
    }[name]


def _gemma_value(value: Any) -> str:
    return f'<|"|>{value}<|"|>' if isinstance(value, str) else json.dumps(value)


def one_call(name: str, args: dict[str, Any]) -> str:
    """A forced call to run_command with `args`, as the format (and its template) writes
    it."""
    if name in TAGGED:
        head, tail = TAGGED[name]
        return head + "".join(_tagged_pair(name, k, v) for k, v in args.items()) + tail
    if name == "gemma4":  # keys sorted, as the template's dictsort renders them
        pairs = ",".join(f"{k}:{_gemma_value(args[k])}" for k in sorted(args))
        return f"<|tool_call>call:run_command{{{pairs}}}<tool_call|>"
    if name == "lfm2":
        pairs = ", ".join(f"{k}={json.dumps(v)}" for k, v in args.items())
        return f"<|tool_call_start|>[run_command({pairs})]<|tool_call_end|>"
    if name in ARRAY_FORMATS:
        return _array_rendered(name, [args])
    if name == "harmony":
        return _native_rendered(name, [args])
    arguments = json.dumps(args)
    hermes = f'<tool_call>\n{{"name": "run_command", "arguments": {arguments}}}\n</tool_call>'
    return {
        "hermes": hermes,
        "generic": hermes,
        "llama3": f'{{"name": "run_command", "parameters": {arguments}}}',
        "mistral": f"[TOOL_CALLS]run_command[ARGS]{arguments}",
        "mistral_call_id": f"[TOOL_CALLS]run_command[CALL_ID]abc123xyz[ARGS]{arguments}",
        "mistral_args": f"[TOOL_CALLS]run_command[ARGS]{arguments}",
        "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"  # noqa: RUF001
        f"run_command\n```json\n{arguments}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",  # noqa: RUF001
        "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.run_command:0"
        f"<|tool_call_argument_begin|>{arguments}<|tool_call_end|><|tool_calls_section_end|>",
    }[name]


@pytest.fixture(scope="module")
def plain(gguf_tokenizer: Tokenizer) -> Vocab:
    return _vocab(gguf_tokenizer)


def _forced(vocab: Vocab, name: str, seed: int = 0) -> Walk:
    return Walk(vocab, _compile(vocab, TOOL_FORMATS[name], TOOLS, mode="required"), seed)


@pytest.mark.parametrize("name", FORMATS)
def test_a_call_within_the_schema_is_accepted_and_parses_back(plain: Vocab, name: str) -> None:
    walk = _forced(plain, name)
    walk.write(one_call(name, VALID))
    assert walk.matcher.is_accepting()
    calls = _parse(plain, TOOL_FORMATS[name], TOOLS, walk, "none").tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("run_command", VALID)]


@pytest.mark.parametrize("broken", list(INVALID))
@pytest.mark.parametrize("name", FORMATS)
def test_a_call_breaking_the_schema_is_refused(plain: Vocab, name: str, broken: str) -> None:
    args = INVALID[broken]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(args, SCHEMA)  # the case really is invalid
    assert not _forced(plain, name).can_write(one_call(name, args)), one_call(name, args)


@pytest.mark.parametrize("name", FORMATS)
def test_random_walks_write_only_valid_arguments(plain: Vocab, name: str) -> None:
    for seed in range(2):
        walk = _forced(plain, name, seed)
        walk.finish()
        calls = _parse(plain, TOOL_FORMATS[name], TOOLS, walk, "none").tool_calls
        assert len(calls) == 1, walk.text()
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)


WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["c", "f"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


def test_gemma4_forced_call_keeps_to_the_enum(embedded_model: LoadedModel) -> None:
    """The issue's case on the embedded model, with the body an Anthropic client sends."""
    text = (templates_dir() / "google-gemma-4-31B-it.jinja").read_text(encoding="utf-8")
    loaded = dataclasses.replace(
        embedded_model,
        tokenizer=embedded_model.tokenizer.with_chat_template(text),
        chat_template=text,
    )
    server = start_server(loaded)
    try:
        body = {
            "model": "m",
            "max_tokens": 1024,
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"},
        }
        reply = httpx.post(f"{server.base_url}/v1/messages", json=body, timeout=600).json()
    finally:
        server.stop()
    assert reply["stop_reason"] == "tool_use", reply
    (call,) = [b for b in reply["content"] if b["type"] == "tool_use"]
    assert call["name"] == "get_weather"
    assert call["input"]["unit"] in ("c", "f"), call
    jsonschema.validate(call["input"], WEATHER["input_schema"])
