"""The real Codex CLI (`openai-codex-cli-bin==0.163.0`) against compat-serve's Responses API.

As the Claude Code tests, server and client run in a loopback-only network namespace
(`unshare -n`), with a temp `CODEX_HOME` whose provider speaks `wire_api = "responses"`
with no `env_key` (Codex then sends no Authorization header).

- Scripted model (Qwen2.5 template, Hermes `<tool_call>` JSON), two Codex runs:
  model `gpt-5.5`, in Codex's own model list with `apply_patch_tool_type: freeform`, so
  Codex offers the custom `apply_patch` tool (a Lark grammar): the model adds `hello.txt`
  with a patch, then runs `cat hello.txt` with `exec_command`, then answers; and an
  unknown model name, for which Codex sends no `apply_patch` at all: the model writes the
  file with a shell command instead.
- The embedded SmolLM2-135M itself, configured by `compat-serve codex-config`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_claude_code import WAIT_FOR_SERVER, scripted_server
from tests.platform_gates import needs_network_namespace
from tests.shared_data import templates_dir

pytestmark = needs_network_namespace

PORT = 8130
REPO = Path(__file__).resolve().parents[2]
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch\n"


def _call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


FINAL = "Created hello.txt; it says hi."
# First match wins. Codex's tool outputs: apply_patch reports "Success. Updated the
# following files", exec_command "Process exited with code 0".
REPLIES = [
    ["Process exited with code 0", FINAL],
    ["Success. Updated the following files", _call("exec_command", {"cmd": "cat hello.txt"})],
    ["Use the shell", _call("exec_command", {"cmd": "printf hi > hello.txt"})],
    ["", _call("apply_patch", {"input": PATCH})],
]
RUNS = {
    "known": ("gpt-5.5", "Create hello.txt containing hi with apply_patch, then show it."),
    "unknown": ("local-model", "Use the shell to create hello.txt containing hi."),
}


def codex_binary() -> Path:
    import codex_cli_bin

    binary = Path(codex_cli_bin.bundled_codex_path())
    assert binary.is_file(), f"codex binary missing at {binary}"
    return binary


# Codex's own base instructions for gpt-5.5 plus its tools are ~8k tokens of the embedded
# tokenizer: a smaller window makes Codex compact the history every turn.
SCRIPTED_CONTEXT = 32768


def provider_config(model: str, port: int, context: int = SCRIPTED_CONTEXT) -> str:
    return f"""model = "{model}"
model_provider = "compat"
approval_policy = "never"
sandbox_mode = "danger-full-access"
model_context_window = {context}

[model_providers.compat]
name = "compat-serve"
base_url = "http://127.0.0.1:{port}/v1"
wire_api = "responses"
"""


def _need_namespace() -> None:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        pytest.fail("needs root, unshare and ip (iproute2; `make setup` installs it)")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))},
        "PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),
        "REPO": str(REPO),
        "CODEX": str(codex_binary()),
        "WORK": str(tmp_path),
        "RUST_LOG": "warn",
        **extra,
    }


# Runs one Codex session in $WORK/$run: its workspace ws/, its CODEX_HOME codex/.
CODEX_RUN = """run_codex() {{
  run=$1; shift
  cd "$WORK/$run/ws"
  HOME="$WORK/$run" CODEX_HOME="$WORK/$run/codex" timeout {timeout} "$CODEX" exec --json \
    --skip-git-repo-check "$@" < /dev/null > "$WORK/$run/events.jsonl" 2> "$WORK/$run/stderr.txt"
  echo "$?" > "$WORK/$run/exit"
}}
"""
SCRIPTED = (
    scripted_server(' --capture "$WORK/capture" --context-length {context}')
    + CODEX_RUN
    + """run_codex known "$(cat "$WORK/known/prompt")"
run_codex unknown "$(cat "$WORK/unknown/prompt")"
kill $server
wait $server || true
"""
)


def _prepare(tmp_path: Path, run: str, config: str | None, prompt: str) -> Path:
    root = tmp_path / run
    (root / "ws").mkdir(parents=True)
    (root / "codex").mkdir()
    if config is not None:
        (root / "codex" / "config.toml").write_text(config)
    (root / "prompt").write_text(prompt)
    return root


def _events(root: Path) -> list[dict[str, Any]]:
    lines = (root / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def _items(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The completed items of one kind, in order."""
    return [
        e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == kind
    ]


def _assert_success(root: Path, server_log: str) -> list[dict[str, Any]]:
    stderr = (root / "stderr.txt").read_text()
    events = _events(root)
    assert (root / "exit").read_text().strip() == "0", (events, stderr[-3000:], server_log[-3000:])
    assert events[-1]["type"] == "turn.completed", events
    assert not [e for e in events if e["type"] in ("turn.failed", "error")], events
    assert (root / "ws" / "hello.txt").read_text().strip() == "hi"
    return events


def test_codex_scripted_apply_patch_and_shell_known_and_unknown_model(tmp_path: Path) -> None:
    _need_namespace()
    (tmp_path / "replies.json").write_text(json.dumps(REPLIES))
    for run, (model, prompt) in RUNS.items():
        _prepare(tmp_path, run, provider_config(model, PORT), prompt)
    env = _env(tmp_path, TEMPLATE=str(templates_dir() / "Qwen-Qwen2.5-7B-Instruct.jinja"))
    subprocess.run(
        [
            "unshare",
            "-n",
            "sh",
            "-c",
            SCRIPTED.format(port=PORT, timeout=120, context=SCRIPTED_CONTEXT),
        ],
        env=env,
        timeout=400,
        check=True,
    )
    check_scripted_runs(tmp_path)


def check_scripted_runs(tmp_path: Path) -> None:
    server_log = (tmp_path / "server.log").read_text()
    assert " 500 " not in server_log

    known = _assert_success(tmp_path / "known", server_log)
    changes = _items(known, "file_change")
    assert any(c["status"] == "completed" for c in changes), known  # the patch applied
    commands = _items(known, "command_execution")
    assert [(c["command"], c["aggregated_output"]) for c in commands] == [
        ("/bin/bash -lc 'cat hello.txt'", "hi\n")
    ]
    assert [m["text"] for m in _items(known, "agent_message")] == [FINAL]

    unknown = _assert_success(tmp_path / "unknown", server_log)
    assert not _items(unknown, "file_change")  # no apply_patch: the shell wrote it
    assert [c["command"] for c in _items(unknown, "command_execution")] == [
        "/bin/bash -lc 'printf hi > hello.txt'"
    ]

    # What Codex sent: only POST /v1/responses, streamed; apply_patch (a custom tool with
    # a Lark grammar) offered to the listed model only.
    captured = [json.loads(p.read_text()) for p in sorted((tmp_path / "capture").glob("*.json"))]
    assert {c["path"] for c in captured} == {"/v1/responses"}
    by_model: dict[str, list[dict[str, Any]]] = {}
    for c in captured:
        assert c["body"]["stream"] is True
        by_model.setdefault(c["body"]["model"], []).append(c["body"])
    assert len(by_model["gpt-5.5"]) == 3 and len(by_model["local-model"]) == 2
    for body in by_model["gpt-5.5"]:
        (patch_tool,) = [t for t in body["tools"] if t.get("name") == "apply_patch"]
        assert patch_tool["type"] == "custom"
        assert patch_tool["format"]["syntax"] == "lark"
    for body in by_model["local-model"]:
        assert not [t for t in body["tools"] if t.get("name") == "apply_patch"]
    # Turn 2 resent turn 1's custom_tool_call verbatim with Codex's output for it.
    kinds = [item.get("type") for item in by_model["gpt-5.5"][1]["input"]]
    assert kinds[-2:] == ["custom_tool_call", "custom_tool_call_output"]


# The embedded SmolLM2-135M through Codex, set up as the README's recipe for tiny local
# models: greedy, one tool round per user message, a small window, codex-config's profile
# (short base instructions) and Codex's lean settings; the user spells out the call.
EMBEDDED_PORT = 8131
EMBEDDED_PROMPT = (
    'Create hello.txt: call exec_command with the arguments {"cmd": "printf hi > hello.txt"}. '
    "When it has run, answer only: Created hello.txt."
)
LEAN_CODEX = (
    '-c web_search=\\"disabled\\" -c features.goals=false -c features.multi_agent=false '
    "-c features.view_image=false -c include_permissions_instructions=false "
    "-c include_environment_context=false -c include_apps_instructions=false "
    "-c include_collaboration_mode_instructions=false -c skills.include_instructions=false"
)
EMBEDDED = (
    """
set -u
ip link set lo up
cd "$REPO"
"$PYTHON" -m compat_serve.cli --port {port} --default-temperature 0 --max-tool-rounds 1 \
  --context-length 4096 --max-output-tokens 256 > "$WORK/server.log" 2>&1 &
server=$!
"""
    + WAIT_FOR_SERVER
    + """"$PYTHON" -m compat_serve.cli codex-config --base-url http://127.0.0.1:{port} \
  --codex-home "$WORK/embedded/codex" > "$WORK/codex-config.txt" 2>&1
"""
    + CODEX_RUN
    + """run_codex embedded --profile compat-serve -c approval_policy='"never"' \
  -s danger-full-access {lean} "$(cat "$WORK/embedded/prompt")"
kill $server
wait $server || true
"""
)


def test_codex_embedded_model_creates_the_file(tmp_path: Path) -> None:
    _need_namespace()
    root = _prepare(tmp_path, "embedded", None, EMBEDDED_PROMPT)
    script = EMBEDDED.format(port=EMBEDDED_PORT, timeout=150, lean=LEAN_CODEX)
    subprocess.run(
        ["unshare", "-n", "sh", "-c", script], env=_env(tmp_path), timeout=340, check=True
    )
    server_log = (tmp_path / "server.log").read_text()
    assert " 500 " not in server_log
    assert "wrote" in (tmp_path / "codex-config.txt").read_text()
    events = _assert_success(root, server_log)
    # The model's own call wrote the file (nothing else in the run can).
    assert [c["command"] for c in _items(events, "command_execution")] == [
        "/bin/bash -lc 'printf hi > hello.txt'"
    ]
    # The turn ended with the model's text, once --max-tool-rounds withheld the tools.
    assert _items(events, "agent_message")
    assert "1 tool rounds since the user's last message: answering without tools" in server_log
