# ruff: noqa: RUF001  (DeepSeek markers are written with fullwidth bars)
"""Real-format model outputs and what parsing them must give.

Each case: (format, output text, expected parts). Parts are ("text", s),
("reasoning", s) or ("call", name, arguments object). Formats follow the chat templates
in shared/templates (what the models are trained to write).
"""

from __future__ import annotations

from typing import Any

Part = tuple[Any, ...]

TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    },
    "Bash": {"type": "object", "properties": {"command": {"type": "string"}}},
    "Write": {
        "type": "object",
        "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
    },
    "search": {"type": "object", "properties": {"filters": {"type": "object"}}},
    "mcp__srv__lookup": {},
    "any_tool": {},  # no schema: XML values are JSON when they parse as JSON
}

NESTED = {"filters": {"tags": ["a", "b"], "range": {"from": 1, "to": [2, 3]}, "ok": True}}
UNICODE_CITY = "São Paulo 東京 🌧️"
CODE = 'def f(x):\n    return "<b>" + x  # </param\n'

CASES: list[tuple[str, str, list[Part]]] = [
    # ---- Hermes / Qwen2.5 / Qwen3 JSON in <tool_call>
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "search", "arguments": '
        '{"filters": {"tags": ["a", "b"], "range": {"from": 1, "to": [2, 3]}, "ok": true}}}\n'
        "</tool_call>",
        [
            ("text", "Let me check."),
            ("call", "get_weather", {"city": "Paris"}),
            ("call", "search", NESTED),
        ],
    ),
    (
        "hermes",
        f'Météo: <tool_call>{{"name": "get_weather", "arguments": {{"city": "{UNICODE_CITY}", '
        '"days": 3}}</tool_call> then more text ✓',
        [
            ("text", "Météo:"),
            ("call", "get_weather", {"city": UNICODE_CITY, "days": 3}),
            ("text", "then more text ✓"),
        ],
    ),
    (  # arguments double-encoded as a JSON string, and before the name
        "hermes",
        '<tool_call>{"arguments": "{\\"command\\": \\"ls -la\\"}", "name": "Bash"}</tool_call>',
        [("call", "Bash", {"command": "ls -la"})],
    ),
    (  # escapes and braces inside strings
        "hermes",
        '<tool_call>{"name": "Bash", "arguments": {"command": "echo \\"}{\\" \\\\ \\u00e9"}}'
        "</tool_call>",
        [("call", "Bash", {"command": 'echo "}{" \\ é'})],
    ),
    (  # unknown tool: the raw text stays text
        "hermes",
        'Try <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> no.',
        [("text", 'Try <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> no.')],
    ),
    (  # the tag in prose, not followed by JSON
        "hermes",
        "Wrap calls in <tool_call> tags like <tool_call>this</tool_call>.",
        [("text", "Wrap calls in <tool_call> tags like <tool_call>this</tool_call>.")],
    ),
    (  # no closing tag at the end, empty arguments omitted
        "hermes",
        'ok\n<tool_call>\n{"name": "mcp__srv__lookup"}',
        [("text", "ok"), ("call", "mcp__srv__lookup", {})],
    ),
    # ---- Qwen3-Coder / Nemotron XML
    (
        "qwen3_coder",
        "I'll write the file.\n<tool_call>\n<function=Write>\n<parameter=file_path>\n/tmp/a.py\n"
        f"</parameter>\n<parameter=content>\n{CODE}\n</parameter>\n</function>\n</tool_call>",
        [
            ("text", "I'll write the file."),
            ("call", "Write", {"file_path": "/tmp/a.py", "content": CODE}),
        ],
    ),
    (  # JSON values where the schema does not say string; strings stay strings
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n2024\n</parameter>\n"
        "<parameter=days>\n7\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        '<function=search>\n<parameter=filters>\n{"tags": ["a", "b"], "range": {"from": 1, '
        '"to": [2, 3]}, "ok": true}\n</parameter>\n</function>\n</tool_call>',
        [("call", "get_weather", {"city": "2024", "days": 7}), ("call", "search", NESTED)],
    ),
    (  # no wrapper, unicode, a text reply after the call
        "qwen3_coder",
        f"<function=get_weather>\n<parameter=city>\n{UNICODE_CITY}\n</parameter>\n</function>"
        "\nDone.",
        [("call", "get_weather", {"city": UNICODE_CITY}), ("text", "Done.")],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=unknown_tool>\n<parameter=x>\n1\n</parameter>\n</function>\n"
        "</tool_call>",
        [
            (
                "text",
                "<tool_call>\n<function=unknown_tool>\n<parameter=x>\n1\n</parameter>\n"
                "</function>\n</tool_call>",
            )
        ],
    ),
    (  # Hermes JSON inside a Qwen3-Coder model's output still parses
        "qwen3_coder",
        '<tool_call>{"name": "Bash", "arguments": {"command": "pwd"}}</tool_call>',
        [("call", "Bash", {"command": "pwd"})],
    ),
    # ---- GLM-4.5 / 4.6
    (
        "glm45",
        "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>"
        f"{UNICODE_CITY}</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n"
        "</tool_call><tool_call>search\n<arg_key>filters</arg_key>\n<arg_value>"
        '{"tags": ["a", "b"], "range": {"from": 1, "to": [2, 3]}, "ok": true}</arg_value>\n'
        "</tool_call>",
        [
            ("text", "Checking."),
            ("call", "get_weather", {"city": UNICODE_CITY, "days": 2}),
            ("call", "search", NESTED),
        ],
    ),
    (
        "glm45",
        "<tool_call>Bash\n<arg_key>command</arg_key>\n<arg_value>cat <<EOF\nx\nEOF"
        "</arg_value>\n</tool_call>",
        [("call", "Bash", {"command": "cat <<EOF\nx\nEOF"})],
    ),
    # ---- Llama 3.x
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 1}}',
        [("call", "get_weather", {"city": "Paris", "days": 1})],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "Bash", "parameters": {"command": "ls"}}; '
        '{"name": "search", "parameters": {"filters": {"tags": ["a", "b"], "range": '
        '{"from": 1, "to": [2, 3]}, "ok": true}}}',
        [("call", "Bash", {"command": "ls"}), ("call", "search", NESTED)],
    ),
    (
        "llama3",
        'JSON like {"name": "x", "parameters": {}} is not a call.',
        [("text", 'JSON like {"name": "x", "parameters": {}} is not a call.')],
    ),
    # ---- Mistral
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "search", "arguments": {"filters": {"tags": ["a", "b"], "range": '
        '{"from": 1, "to": [2, 3]}, "ok": true}}}]',
        [("call", "get_weather", {"city": "Paris"}), ("call", "search", NESTED)],
    ),
    (
        "mistral",
        'Sure.[TOOL_CALLS]Bash[ARGS]{"command": "echo hi"}[TOOL_CALLS]get_weather'
        f'[CALL_ID]a1b2c3d4e[ARGS]{{"city": "{UNICODE_CITY}"}}',
        [
            ("text", "Sure."),
            ("call", "Bash", {"command": "echo hi"}),
            ("call", "get_weather", {"city": UNICODE_CITY}),
        ],
    ),
    # ---- DeepSeek V3 / R1, V3.1
    (
        "deepseek_v3",
        "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
        '{"filters": {"tags": ["a", "b"], "range": {"from": 1, "to": [2, 3]}, "ok": true}}\n'
        "```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        [
            ("text", "Let me look."),
            ("call", "get_weather", {"city": "Paris"}),
            ("call", "search", NESTED),
        ],
    ),
    (
        "deepseek_v3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>Bash<｜tool▁sep｜>"
        '{"command": "ls"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        [("call", "Bash", {"command": "ls"})],
    ),
    # ---- Kimi-K2
    (
        "kimi_k2",
        "On it.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        f'<|tool_call_argument_begin|>{{"city": "{UNICODE_CITY}"}}<|tool_call_end|>'
        "<|tool_call_begin|>functions.Bash:1<|tool_call_argument_begin|>"
        '{"command": "ls"}<|tool_call_end|><|tool_calls_section_end|>',
        [
            ("text", "On it."),
            ("call", "get_weather", {"city": UNICODE_CITY}),
            ("call", "Bash", {"command": "ls"}),
        ],
    ),
    # ---- generic fallback
    (
        "generic",
        'a\n<tool_call>{"name": "Bash", "arguments": {"command": "ls"}}</tool_call>\nb\n'
        "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\nc\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        [
            ("text", "a"),
            ("call", "Bash", {"command": "ls"}),
            ("text", "b"),
            ("call", "get_weather", {"city": "Rome"}),
            ("text", "c"),
            ("call", "get_weather", {"city": "Oslo"}),
        ],
    ),
]

# (reasoning opened by the prompt, output, expected parts): parsed with hermes tools.
REASONING_CASES: list[tuple[bool, str, list[Part]]] = [
    (
        False,
        "<think>\nThe user wants weather. Use the tool.\n</think>\n\nChecking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        [
            ("reasoning", "The user wants weather. Use the tool."),
            ("text", "Checking."),
            ("call", "get_weather", {"city": "Paris"}),
        ],
    ),
    (
        True,  # the template opened <think> in the prompt (Qwen3 thinking, DeepSeek-R1)
        "Plan: answer directly 🙂\n</think>\n\nIt is sunny.",
        [("reasoning", "Plan: answer directly 🙂"), ("text", "It is sunny.")],
    ),
    (False, "<think>\n\n</think>\n\nNo thoughts.", [("text", "No thoughts.")]),
    (
        False,
        "  Plain answer, <think> later is text.",
        [("text", "  Plain answer, <think> later is text.")],
    ),
    (True, "cut off while thinking", [("reasoning", "cut off while thinking")]),
]
