"""The real Claude Code and Codex CLIs configured by `compat-serve launch` alone.

Both run offline in a loopback-only network namespace against the scripted model
(`launch --url`; starting the server is covered by test_launch.py and test_opencode.py),
with a fresh HOME and nothing but the launcher's settings pointing them at the server:
no base URL, model or window from the test. The scripted model answers every request
with one sentence; each client must print it and exit 0, having sent the served model's
name (Claude Code's main and background model variables) and, for Codex, the Responses
API with the `apply_patch` tool that only the launcher's model catalog entry offers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.test_claude_code import RECIPE_ENV, claude_binary, scripted_server
from tests.e2e.test_codex import _need_namespace, codex_binary
from tests.platform_gates import needs_network_namespace
from tests.shared_data import templates_dir

pytestmark = needs_network_namespace

REPO = Path(__file__).resolve().parents[2]
PORT = 8152
ANSWER = "Hello from the scripted model."
SCRIPT = (
    scripted_server(' --capture "$WORK/capture" --context-length 32768')
    + """mkdir -p "$WORK/claude" "$WORK/codex"
cd "$WORK/claude"
HOME="$WORK/claude" timeout 300 compat-serve launch claude --url http://127.0.0.1:{port} -- \
  -p "Say hello." --output-format json --bare --system-prompt "You are terse." \
  --tools Bash --max-turns 2 < /dev/null > "$WORK/claude/out.json" 2> "$WORK/claude/err.txt"
echo "$?" > "$WORK/claude/exit"
cd "$WORK/codex"
HOME="$WORK/codex" CODEX_HOME="$WORK/codex/home" timeout 300 compat-serve launch codex \
  --url http://127.0.0.1:{port} -- exec --json --skip-git-repo-check \
  -c approval_policy='"never"' "Say hello." \
  < /dev/null > "$WORK/codex/events.jsonl" 2> "$WORK/codex/err.txt"
echo "$?" > "$WORK/codex/exit"
kill $server
wait $server || true
"""
)


def test_claude_code_and_codex_run_on_the_launchers_settings_alone(tmp_path: Path) -> None:
    _need_namespace()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "claude").symlink_to(claude_binary())
    (bin_dir / "codex").symlink_to(codex_binary())
    (tmp_path / "codex" / "home").mkdir(parents=True)
    (tmp_path / "replies.json").write_text(json.dumps([["", ANSWER]]))
    # Only the recipe's quiet settings; the launcher sets the server, model and window.
    quiet = {
        k: v for k, v in RECIPE_ENV.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_CODE_MAX"))
    }
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("ANTHROPIC_", "CLAUDE", "OPENAI_", "CODEX_"))
        },
        **quiet,
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),
        "REPO": str(REPO),
        "WORK": str(tmp_path),
        "RUST_LOG": "warn",
        "TEMPLATE": str(templates_dir() / "Qwen-Qwen2.5-7B-Instruct.jinja"),
    }
    subprocess.run(
        ["unshare", "-n", "sh", "-c", SCRIPT.format(port=PORT)], env=env, timeout=700, check=True
    )
    server_log = (tmp_path / "server.log").read_text()
    assert " 500 " not in server_log

    claude_err = (tmp_path / "claude" / "err.txt").read_text()
    assert (tmp_path / "claude" / "exit").read_text().strip() == "0", claude_err + server_log
    result = json.loads((tmp_path / "claude" / "out.json").read_text())
    assert result["is_error"] is False and result["result"] == ANSWER, result

    codex_err = (tmp_path / "codex" / "err.txt").read_text()
    assert (tmp_path / "codex" / "exit").read_text().strip() == "0", codex_err + server_log
    lines = (tmp_path / "codex" / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    messages = [
        e["item"]["text"]
        for e in events
        if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"
    ]
    assert messages == [ANSWER], events

    captured = [json.loads(p.read_text()) for p in sorted((tmp_path / "capture").glob("*.json"))]
    claude_bodies = [c["body"] for c in captured if c["path"] == "/v1/messages"]
    codex_bodies = [c["body"] for c in captured if c["path"] == "/v1/responses"]
    assert claude_bodies and codex_bodies, [c["path"] for c in captured]
    assert {b["model"] for b in claude_bodies + codex_bodies} == {"scripted"}
    for body in codex_bodies:
        assert [t["type"] for t in body["tools"] if t.get("name") == "apply_patch"] == ["custom"]
    # Codex never wrote a profile: its home holds no config of ours.
    assert not list((tmp_path / "codex" / "home").glob("*.toml"))
