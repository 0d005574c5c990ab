"""Chat-template rendering speed: our Rust ChatTemplate vs transformers' jinja2.

Renders the Qwen3 template over the 50-turn tool-using conversation of
`benches/benches/template_render.rs`. The jinja2 side is compiled once, the way
transformers caches it, so both columns time rendering only (plus, for Rust, the
Python -> JSON conversion of the context).

Usage: python benches/template_render.py [--seconds 2] [--template NAME.jinja]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compat_serve.templating import ChatTemplate

# The reference renderer and data locator are shared with the test suite.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.python.jinja_reference import compile_template
from tests.shared_data import shared_dir

TURNS = 50


def conversation() -> dict[str, Any]:
    """Same shape as the Rust bench: user, tool call, tool result, answer per turn."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file from the workspace.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "Path relative to the root"},
                        "max_lines": {"type": "integer", "minimum": 1, "default": 200},
                    },
                    "required": ["path"],
                },
            },
        }
    ]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    for turn in range(TURNS):
        messages += [
            {"role": "user", "content": f"Step {turn}: open src/mod_{turn}.rs and summarise it."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": f"call_{turn}",
                        "type": "function",
                        "function": {
                            "name": "read_file",
                            "arguments": {"path": f"src/mod_{turn}.rs", "max_lines": 80},
                        },
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": f"call_{turn}",
                "content": f"pub fn f{turn}() -> u32 {{\n    {turn}\n}}\n",
            },
            {"role": "assistant", "content": f"mod_{turn}.rs defines f{turn}, returning {turn}."},
        ]
    return {"messages": messages, "tools": tools}


def time_per_call(fn: Callable[[], str], seconds: float) -> float:
    fn()  # warm up
    calls = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fn()
        calls += 1
    return elapsed / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--template", default="Qwen-Qwen3-0.6B.jinja")
    args = parser.parse_args()

    path = shared_dir() / "templates" / args.template
    if not path.is_file():
        print(f"template_render: {path} not found; set COMPAT_SHARED_DIR", file=sys.stderr)
        return 1
    source = path.read_text(encoding="utf-8")
    conv = conversation()
    extra: dict[str, Any] = {"eos_token": "<|im_end|>", "enable_thinking": False}

    ours = ChatTemplate(source)
    reference = compile_template(source)

    def render_rust() -> str:
        return ours.render(conv["messages"], tools=conv["tools"], **extra)

    def render_jinja2() -> str:
        return reference.render(
            messages=conv["messages"],
            tools=conv["tools"],
            documents=None,
            add_generation_prompt=True,
            **extra,
        )

    prompt = render_rust()
    if prompt != render_jinja2():
        print("template_render: outputs differ!", file=sys.stderr)
        return 1

    rust_s = time_per_call(render_rust, args.seconds)
    jinja_s = time_per_call(render_jinja2, args.seconds)
    print(f"template_render: {args.template}, {TURNS} turns, {len(prompt)} chars")
    print(f"  compat_serve (Rust): {rust_s * 1e6:9.1f} us/render  ({1 / rust_s:7.0f} renders/s)")
    print(
        f"  jinja2 (reference):    {jinja_s * 1e6:7.1f} us/render  ({1 / jinja_s:7.0f} renders/s)"
    )
    print(f"  speedup: {jinja_s / rust_s:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
