"""Requests shaped like OpenCode's: its tool list as the AI SDK sends it to an
OpenAI-compatible provider (each schema with `$schema` and `additionalProperties: false`),
and a system prompt that ends in the environment block OpenCode writes (working
directory, date), so prompts differ only there. Used by the example-copy test
(tests/http/test_envelope_example.py) and bench (benches/example_copy.py): does the
embedded model answer a plain question, or copy the envelope instructions' example?
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

_DRAFT_07 = "http://json-schema.org/draft-07/schema#"


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> Any:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
        "$schema": _DRAFT_07,
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def _string(description: str) -> dict[str, str]:
    return {"type": "string", "description": description}


def _number(description: str) -> dict[str, str]:
    return {"type": "number", "description": description}


_TODO = {
    "type": "object",
    "properties": {
        "content": _string("Brief description of the task"),
        "status": {"type": "string", "enum": ["pending", "in_progress", "completed", "cancelled"]},
        "priority": {"type": "string", "enum": ["high", "medium", "low"]},
        "id": _string("Unique identifier for the todo item"),
    },
    "required": ["content", "status", "priority", "id"],
    "additionalProperties": False,
}

OPENCODE_TOOLS: list[dict[str, Any]] = [
    _tool(
        "bash",
        "Executes a given bash command in a persistent shell session with optional timeout, "
        "ensuring proper handling and security measures.",
        {
            "command": _string("The command to execute"),
            "timeout": _number("Optional timeout in milliseconds"),
            "description": _string(
                "Clear, concise description of what this command does in 5-10 words."
            ),
        },
        ["command", "description"],
    ),
    _tool(
        "edit",
        "Performs exact string replacements in files.",
        {
            "filePath": _string("The absolute path to the file to modify"),
            "oldString": _string("The text to replace"),
            "newString": _string("The text to replace it with (must be different from oldString)"),
            "replaceAll": {
                "type": "boolean",
                "description": "Replace all occurrences of oldString",
            },
        },
        ["filePath", "oldString", "newString"],
    ),
    _tool(
        "write",
        "Writes a file to the local filesystem.",
        {
            "content": _string("The content to write to the file"),
            "filePath": _string("The absolute path to the file to write"),
        },
        ["content", "filePath"],
    ),
    _tool(
        "read",
        "Reads a file from the local filesystem. You can access any file directly by using "
        "this tool.",
        {
            "filePath": _string("The path to the file to read"),
            "offset": _number("The line number to start reading from (0-based)"),
            "limit": _number("The number of lines to read (defaults to 2000)"),
        },
        ["filePath"],
    ),
    _tool(
        "glob",
        "Fast file pattern matching tool that works with any codebase size. Supports glob "
        'patterns like "**/*.js" or "src/**/*.ts".',
        {
            "pattern": _string("The glob pattern to match files against"),
            "path": _string("The directory to search in."),
        },
        ["pattern"],
    ),
    _tool(
        "grep",
        "Fast content search tool that works with any codebase size. Searches file contents "
        "using regular expressions.",
        {
            "pattern": _string("The regex pattern to search for in file contents"),
            "path": _string("The directory to search in. Defaults to the current directory."),
            "include": _string('File pattern to include in the search (e.g. "*.js")'),
        },
        ["pattern"],
    ),
    _tool(
        "list",
        "Lists files and directories in a given path.",
        {
            "path": _string("The absolute path to the directory to list"),
            "ignore": {
                "type": "array",
                "items": {"type": "string"},
                "description": "List of glob patterns to ignore",
            },
        },
        [],
    ),
    _tool(
        "webfetch",
        "Fetches content from a specified URL and returns it in the requested format.",
        {
            "url": _string("The URL to fetch content from"),
            "format": {
                "type": "string",
                "enum": ["text", "markdown", "html"],
                "description": "The format to return the content in",
            },
            "timeout": _number("Optional timeout in seconds (max 120)"),
        },
        ["url", "format"],
    ),
    _tool(
        "todowrite",
        "Use this tool to create and manage a structured task list for your current coding "
        "session.",
        {"todos": {"type": "array", "items": _TODO, "description": "The updated todo list"}},
        ["todos"],
    ),
    _tool("todoread", "Use this tool to read your todo list.", {}, []),
]

_SYSTEM = (
    "You are opencode, an interactive CLI tool that helps users with software engineering "
    "tasks. Use the instructions below and the tools available to you to assist the user.\n\n"
    "Be concise, direct, and to the point. Answer the user's question directly, without "
    "elaboration, explanation, or details.\n\n"
    "Here is some useful information about the environment you are running in:\n"
    "<env>\n  Working directory: {cwd}\n  Is directory a git repo: yes\n"
    "  Platform: linux\n  Today's date: {date}\n</env>"
)
_PLACES = [
    ("/home/ana/projects/website", "Mon Nov 23 2026"),
    ("/home/ana/projects/api-server", "Tue Nov 24 2026"),
    ("/srv/build/compiler", "Wed Nov 25 2026"),
    ("/Users/kim/code/notes-app", "Thu Nov 26 2026"),
    ("/Users/kim/code/game", "Fri Nov 27 2026"),
    ("/home/dev/work/payments", "Sat Nov 28 2026"),
    ("/home/dev/work/scheduler", "Sun Nov 29 2026"),
    ("/opt/src/telemetry", "Mon Nov 30 2026"),
    ("/tmp/scratch/demo", "Tue Dec 1 2026"),
    ("/home/lee/repos/dotfiles", "Wed Dec 2 2026"),
]
QUESTION = "What is the capital of France?"
# A request that needs a tool: the instructions must not talk the model out of calls.
TASK = "List the files in the working directory."


def opencode_body(
    index: int, max_tokens: int, *, ask: str = QUESTION, tools: int = len(OPENCODE_TOOLS)
) -> dict[str, Any]:
    """The `index`-th OpenCode-shaped chat request (0..9): same tools and question, its
    own working directory and date. Streamed with usage, as OpenCode asks; no temperature
    (OpenCode sends none for models it does not know). `tools`: the first few only."""
    cwd, date = _PLACES[index]
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": _SYSTEM.format(cwd=cwd, date=date)},
            {"role": "user", "content": ask},
        ],
        "tools": OPENCODE_TOOLS[:tools],
        "tool_choice": "auto",
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# The example answer the instructions showed before #25 ("your answer"), and the words
# of today's instructions a model could take for an answer.
COPYABLE = ("your answer", "the answer", "answer the user", "tool_name", "tool result")


def copies_example(content: str) -> bool:
    """Whether `content` is (or starts as) text of the instructions' examples."""
    answer = content.strip().lower()
    return any(answer.startswith(text) for text in COPYABLE)


def answers_without_copying(content: str) -> bool:
    """Whether `content` is an answer: not empty (no tool call instead), not a copy."""
    return bool(content.strip()) and not copies_example(content)


@dataclass
class Answer:
    text: str = ""
    calls: list[str] = field(default_factory=list)  # the names of the tools it called
    prompt_tokens: int = 0
    finish_reason: str | None = None


def ask(client: httpx.Client, body: dict[str, Any]) -> Answer:
    """The streamed answer."""
    answer = Answer()
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                answer.prompt_tokens = chunk["usage"]["prompt_tokens"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                answer.text += delta.get("content") or ""
                answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
                for call in delta.get("tool_calls") or []:
                    name = (call.get("function") or {}).get("name")
                    if name:
                        answer.calls.append(name)
    return answer
