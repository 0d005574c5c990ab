"""Forced tool calls with the bodies clients send by default (#25 items 1 and 3).

For one chat template per native tool-call format of ../shared/templates (and the
embedded model's own template, which ignores tools: the JSON envelope), a server runs
the embedded SmolLM2-135M and gets N requests of each forced shape, as the SDKs send
them: no `disable_parallel_tool_use`, no `parallel_tool_calls: false`, no temperature,
`max_tokens` 1,024 (Anthropic; OpenAI's default sends none, the server's cap applies,
here 1,024 too):

- Anthropic `tool_choice` `{"type": "tool", "name": "Bash"}` and `{"type": "any"}`;
- OpenAI chat `tool_choice` `{"type": "function", ...}` and `"required"`;
- Responses `tool_choice` `{"type": "function", "name": "Bash"}` and `"required"`.

A request passes when it ends in tool calls (`tool_use` / `tool_calls` / a completed
response) with exactly one call for a named tool and at least one otherwise, no call
repeated, and every call's input valid against its tool's schema (`required` included).
Prints one row per format: passes per shape out of N.

    .venv/bin/python benches/forced_calls.py [N] [template-substring ...]
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from compat_serve.models.blas import ensure_fast_blas

ensure_fast_blas()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import jsonschema  # noqa: E402
from tests.conftest import start_server  # noqa: E402
from tests.python.echo_turns import tool_templates  # noqa: E402
from tests.shared_data import templates_dir  # noqa: E402

from compat_serve.models.loader import load_model  # noqa: E402
from compat_serve.parsers.registry import detect_tool_format  # noqa: E402

BASH = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "description": "The command to execute"},
        "timeout": {"type": "number", "description": "Optional timeout in milliseconds"},
        "description": {"type": "string", "description": "What the command does"},
    },
    "required": ["command"],
    "additionalProperties": False,
}
READ = {
    "type": "object",
    "properties": {
        "file_path": {"type": "string", "description": "The absolute path to the file"},
        "offset": {"type": "number"},
        "limit": {"type": "number"},
    },
    "required": ["file_path"],
    "additionalProperties": False,
}
SCHEMAS = {"Bash": BASH, "Read": READ}
DESCRIPTIONS = {"Bash": "Run a shell command", "Read": "Read a file"}
ASK = "List the files in /tmp."
MAX_TOKENS = 1024
SHAPES = (
    "anthropic tool",
    "anthropic any",
    "chat function",
    "chat required",
    "resp function",
    "resp required",
)


def _request(shape: str) -> tuple[str, dict[str, Any]]:
    named = shape.endswith(("tool", "function"))
    if shape.startswith("anthropic"):
        tools = [
            {"name": n, "description": DESCRIPTIONS[n], "input_schema": s}
            for n, s in SCHEMAS.items()
        ]
        choice = {"type": "tool", "name": "Bash"} if named else {"type": "any"}
        body = {
            "model": "m",
            "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": ASK}],
            "tools": tools,
            "tool_choice": choice,
        }
        return "/v1/messages", body
    if shape.startswith("chat"):
        tools = [
            {
                "type": "function",
                "function": {"name": n, "description": DESCRIPTIONS[n], "parameters": s},
            }
            for n, s in SCHEMAS.items()
        ]
        choice: Any = {"type": "function", "function": {"name": "Bash"}} if named else "required"
        body = {"model": "m", "messages": [{"role": "user", "content": ASK}], "tools": tools}
        return "/v1/chat/completions", {**body, "tool_choice": choice}
    tools = [
        {"type": "function", "name": n, "description": DESCRIPTIONS[n], "parameters": s}
        for n, s in SCHEMAS.items()
    ]
    choice = {"type": "function", "name": "Bash"} if named else "required"
    body = {"model": "m", "input": ASK, "tools": tools, "tool_choice": choice}
    return "/v1/responses", {**body, "max_output_tokens": MAX_TOKENS}


def _calls(shape: str, reply: dict[str, Any]) -> tuple[bool, list[tuple[str, Any]]]:
    """Whether the reply ended in tool calls, and its calls (name, input)."""
    if shape.startswith("anthropic"):
        calls = [(b["name"], b["input"]) for b in reply["content"] if b["type"] == "tool_use"]
        return reply["stop_reason"] == "tool_use", calls
    if shape.startswith("chat"):
        choice = reply["choices"][0]
        made = choice["message"].get("tool_calls") or []
        calls = [(c["function"]["name"], _loads(c["function"]["arguments"])) for c in made]
        return choice["finish_reason"] == "tool_calls", calls
    items = [i for i in reply["output"] if i["type"] == "function_call"]
    calls = [(i["name"], _loads(i["arguments"])) for i in items]
    return reply["status"] == "completed", calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _passes(shape: str, reply: dict[str, Any]) -> tuple[bool, bool]:
    """(ended with the right number of calls, no repeat; every call valid)."""
    ended, calls = _calls(shape, reply)
    named = shape.endswith(("tool", "function"))
    count_ok = len(calls) == 1 if named else len(calls) >= 1
    distinct = all(calls[i] not in calls[:i] for i in range(len(calls)))
    valid = bool(calls)
    for name, arguments in calls:
        try:
            jsonschema.validate(arguments, SCHEMAS[name])
        except (jsonschema.ValidationError, KeyError):
            valid = False
    if named and any(name != "Bash" for name, _ in calls):
        valid = False
    return ended and count_ok and distinct, valid


async def _run_format(base_url: str, n: int) -> dict[str, tuple[int, int, list[str]]]:
    results: dict[str, tuple[int, int, list[str]]] = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=1800) as client:

        async def one(shape: str) -> tuple[bool, bool, str]:
            path, body = _request(shape)
            response = await client.post(path, json=body)
            if response.status_code != 200:
                return False, False, f"{response.status_code} {response.text[:120]}"
            reply = response.json()
            ended, valid = _passes(shape, reply)
            return ended, valid, "" if ended and valid else json.dumps(reply)[:400]

        jobs = [(shape, one(shape)) for _ in range(n) for shape in SHAPES]
        done = await asyncio.gather(*(job for _, job in jobs))
        for (shape, _), (ended, valid, failure) in zip(jobs, done, strict=True):
            ok, good, failures = results.get(shape, (0, 0, []))
            results[shape] = (ok + ended, good + valid, failures + ([failure] if failure else []))
    return results


def _templates(filters: list[str]) -> list[tuple[str, str | None]]:
    """(format, template file) per native format, first template of each; the envelope
    (the embedded model's own template) as None."""
    chosen: dict[str, str | None] = {"envelope": None}
    for file in tool_templates():
        text = (templates_dir() / file).read_text(encoding="utf-8")
        chosen.setdefault(detect_tool_format(text).name, file)
    rows = sorted(chosen.items())
    if filters:
        rows = [(f, t) for f, t in rows if any(x in f or x in (t or "") for x in filters)]
    return rows


def main() -> None:
    args = sys.argv[1:]
    n = int(args.pop(0)) if args and args[0].isdigit() else 10
    embedded = load_model(None)
    print(f"{'format':<18} {'template':<44} " + " ".join(f"{s:>15}" for s in SHAPES))
    totals = {s: [0, 0] for s in SHAPES}
    for fmt, file in _templates(args):
        loaded = embedded
        if file is not None:
            text = (templates_dir() / file).read_text(encoding="utf-8")
            loaded = dataclasses.replace(
                embedded,
                tokenizer=embedded.tokenizer.with_chat_template(text),
                chat_template=text,
            )
        server = start_server(loaded, max_output_tokens=MAX_TOKENS)
        started = time.monotonic()
        try:
            results = asyncio.run(_run_format(server.base_url, n))
        finally:
            server.stop()
        cells = []
        for shape in SHAPES:
            ended, valid, _ = results[shape]
            totals[shape][0] += ended
            totals[shape][1] += valid
            cells.append(f"{ended:>2}/{n} ok {valid:>2}/{n} v")
        print(
            f"{fmt:<18} {(file or 'embedded (envelope)'):<44} "
            + " ".join(f"{c:>15}" for c in cells)
        )
        for shape in SHAPES:
            for failure in results[shape][2][:2]:
                print(f"    {shape}: {failure}", file=sys.stderr)
        print(f"    ({time.monotonic() - started:.0f}s)", file=sys.stderr, flush=True)
    print(
        "ok: ended with 1 call (named) / >= 1 call (any, required), none repeated; "
        "v: every call valid against its schema (required included)"
    )


if __name__ == "__main__":
    main()
