"""The real OpenCode CLI (npm `opencode-ai`, pinned in the Makefile) through `compat-serve launch`.

`make setup` installs the package into `.test-cache/npm` (the registry is reachable
there); here it runs offline: server, launcher and client in a loopback-only network
namespace (`unshare -n`), with a fresh HOME and OpenCode's update check, model list fetch,
default plugins, LSP downloads and sharing turned off by its environment variables. Both
AI SDK provider packages OpenCode is configured with (`@ai-sdk/openai-compatible`,
`@ai-sdk/anthropic`) are bundled in its binary, so nothing is installed at run time.

- Scripted model (Qwen2.5 template, Hermes `<tool_call>` JSON) behind `launch --url`, on
  both providers with OpenCode's default prompt and tools: the model writes `hello.txt`
  with the `write` tool (the step ends with reason tool-calls), the tool's result goes
  back, the second turn answers reading >= 80% of its prompt from the prefix cache, and
  the title side request (OpenCode's `small_model`) names the session.
- The embedded SmolLM2-135M, started by the launcher: a plain question is answered, and
  the answer copies nothing from the tool prompt's example text.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from compat_serve.chat.tool_injection import tools_prompt
from tests.e2e.test_claude_code import scripted_server
from tests.platform_gates import needs_network_namespace
from tests.shared_data import templates_dir

pytestmark = needs_network_namespace

REPO = Path(__file__).resolve().parents[2]
OPENCODE = REPO / ".test-cache" / "npm" / "node_modules" / ".bin" / "opencode"
PORT = 8150
APIS = ("openai", "anthropic")
FINAL = "Created hello.txt."
TITLE = "Hello file"
OFFLINE_ENV = {
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "OPENCODE_DISABLE_CLAUDE_CODE": "1",
}


def _call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _need_opencode() -> None:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        pytest.fail("needs root, unshare and ip (iproute2; `make setup` installs it)")
    if not OPENCODE.exists():
        pytest.fail(f"{OPENCODE} missing: `make setup` installs opencode-ai (needs npm)")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "opencode").symlink_to(OPENCODE.resolve())
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("OPENCODE_", "XDG_"))}
    return {
        **inherited,
        **OFFLINE_ENV,
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),
        "REPO": str(REPO),
        "WORK": str(tmp_path),
        **extra,
    }


# Runs `compat-serve launch opencode ARGS` for run $1 in $WORK/$1/ws, with the HOME every
# run shares ($WORK/home). `list_sessions` lists their sessions (titles) from that HOME
# once: each OpenCode start costs seconds of CPU before it does anything.
LAUNCH_RUN = """launch_run() {{
  run=$1; shift
  mkdir -p "$WORK/home" "$WORK/$run/ws"
  cd "$WORK/$run/ws"
  HOME="$WORK/home" timeout {timeout} compat-serve launch opencode "$@" \
    < /dev/null > "$WORK/$run/events.jsonl" 2> "$WORK/$run/stderr.txt"
  echo "$?" > "$WORK/$run/exit"
}}
list_sessions() {{
  HOME="$WORK/home" timeout 60 opencode session list --format json \
    > "$WORK/sessions.json" 2> "$WORK/sessions-stderr.txt"
}}
"""
SCRIPTED = (
    scripted_server(' --capture "$WORK/capture" --context-length 32768')
    + LAUNCH_RUN
    + """for api in {apis}; do
  launch_run "$api" --url http://127.0.0.1:{port} --api "$api" -- \
    run --format json "Create hello.txt containing hi."
done
list_sessions
kill $server
wait $server || true
"""
)


def _events(root: Path) -> list[dict[str, Any]]:
    lines = (root / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def _check_run(root: Path, server_log: str) -> None:
    stderr = (root / "stderr.txt").read_text()
    events = _events(root)
    assert (root / "exit").read_text().strip() == "0", (events, stderr[-3000:], server_log[-3000:])
    assert (root / "ws" / "hello.txt").read_text() == "hi\n"
    (tool,) = [e["part"] for e in events if e["type"] == "tool_use"]
    assert tool["tool"] == "write" and tool["state"]["status"] == "completed", tool
    steps = [e["part"] for e in events if e["type"] == "step_finish"]
    assert [s["reason"] for s in steps] == ["tool-calls", "stop"], steps
    assert [e["part"]["text"] for e in events if e["type"] == "text"] == [FINAL]
    # Turn 2 (turn 1's prompt + the call + its result) reads its prompt from the cache.
    tokens = steps[1]["tokens"]
    prompt = tokens["input"] + tokens["cache"]["read"] + tokens["cache"]["write"]
    assert tokens["cache"]["read"] >= 0.8 * prompt, tokens


def test_opencode_scripted_write_round_trip_on_both_providers(tmp_path: Path) -> None:
    _need_opencode()
    write = _call("write", {"content": "hi\n", "filePath": "hello.txt"})
    # First match wins: the tool result, OpenCode's title prompt, then any prompt.
    replies = [
        ["Wrote file successfully", FINAL],
        ["You are a title generator", TITLE],
        ["", write],
    ]
    (tmp_path / "replies.json").write_text(json.dumps(replies))
    env = _env(tmp_path, TEMPLATE=str(templates_dir() / "Qwen-Qwen2.5-7B-Instruct.jinja"))
    script = SCRIPTED.format(port=PORT, timeout=240, apis=" ".join(APIS))
    subprocess.run(["unshare", "-n", "sh", "-c", script], env=env, timeout=600, check=True)
    server_log = (tmp_path / "server.log").read_text()
    assert " 500 " not in server_log
    for api in APIS:
        _check_run(tmp_path / api, server_log)
    # Each run's title side request was answered: it named its session (one a run, told
    # by its workspace).
    sessions = json.loads((tmp_path / "sessions.json").read_text())
    titles = {session["directory"]: session["title"] for session in sessions}
    assert len(sessions) == len(APIS), sessions
    assert titles == {str(tmp_path / api / "ws"): TITLE for api in APIS}, sessions
    # What OpenCode sent: chat completions, then Messages; every request streamed, the
    # write tool offered with OpenCode's default tool set.
    captured = [json.loads(p.read_text()) for p in sorted((tmp_path / "capture").glob("*.json"))]
    paths = [c["path"] for c in captured]
    assert paths == ["/v1/chat/completions"] * 3 + ["/v1/messages"] * 3, paths
    for record in captured:
        body = record["body"]
        assert body["stream"] is True and body["max_tokens"] == 8192
        names = [t.get("name") or t.get("function", {}).get("name") for t in body.get("tools", [])]
        assert not names or {"write", "bash", "read", "edit"} <= set(names)


# The embedded model through a launcher-started server. OpenCode's default prompt and ten
# tools are ~3.9k tokens of this tokenizer, minutes of CPU prefill under load; the
# project's opencode.json (merged over the launcher's config) keeps one tool and a short
# agent prompt, which still exercises the injected tool prompt (the chat template has no
# tool support, so the tools are told in the system prompt with an example reply).
EMBEDDED_PROJECT_CONFIG = {
    "$schema": "https://opencode.ai/config.json",
    "agent": {"build": {"prompt": "You are a helpful assistant. Answer in one sentence."}},
    "tools": {
        name: False
        for name in (
            "bash",
            "edit",
            "glob",
            "grep",
            "skill",
            "task",
            "todowrite",
            "webfetch",
            "write",
        )
    },
}
EMBEDDED = (
    """
set -u
ip link set lo up
"""
    + LAUNCH_RUN
    + """launch_run embedded --context-length 2048 --max-output-tokens 48 \
  --default-temperature 0 --server-log "$WORK/server.log" -- \
  run --format json "What is the capital of France?"
"""
)


def _placeholders() -> list[str]:
    """The example strings of the injected tool prompt (`"response": "your answer"`...)."""
    return re.findall(r'": "([^"]+)"', tools_prompt([]))


def test_opencode_embedded_model_answers_a_plain_question(tmp_path: Path) -> None:
    _need_opencode()
    ws = tmp_path / "embedded" / "ws"
    ws.mkdir(parents=True)
    (ws / "opencode.json").write_text(json.dumps(EMBEDDED_PROJECT_CONFIG))
    script = EMBEDDED.format(timeout=400)
    subprocess.run(
        ["unshare", "-n", "sh", "-c", script], env=_env(tmp_path), timeout=450, check=True
    )
    root = tmp_path / "embedded"
    server_log = (tmp_path / "server.log").read_text()
    assert (root / "exit").read_text().strip() == "0", (
        (root / "stderr.txt").read_text()[-3000:],
        server_log[-3000:],
    )
    assert " 500 " not in server_log
    assert "POST /v1/chat/completions" in server_log
    texts = [e["part"]["text"] for e in _events(root) if e["type"] == "text"]
    answer = " ".join(texts).strip()
    assert "Paris" in answer, _events(root)  # greedy decoding: the same answer every run
    placeholders = _placeholders()
    assert placeholders  # the prompt still shows an example to copy from
    for placeholder in placeholders:
        assert placeholder.lower() not in answer.lower(), (placeholder, answer)
    # The launcher stopped the server it started: nothing listens on its port any more.
    assert "Shutting down" in server_log or "Finished server process" in server_log
