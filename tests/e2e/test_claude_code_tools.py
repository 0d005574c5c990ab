"""The real Claude Code CLI completes a tool round trip through compat-serve.

The scripted model (Qwen2.5 template, Hermes calls) answers the first request with a Bash
call `echo hi`; Claude Code runs it and sends the result back; the model's final answer
is scripted to need the command's output (`hi`) in the prompt. Loopback-only network
namespace and the 8k recipe as in test_claude_code.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_claude_code import RECIPE_ENV, WAIT_FOR_SERVER, claude_binary, scripted_server
from tests.platform_gates import needs_network_namespace
from tests.shared_data import templates_dir

pytestmark = needs_network_namespace

PORT = 8124
REPO = Path(__file__).resolve().parents[2]
CALL = (
    "Running it.\n<tool_call>\n"
    '{"name": "Bash", "arguments": {"command": "echo hi", "description": "Print a greeting"}}'
    "\n</tool_call>"
)
FINAL = "The command printed: hi"
# The final answer only once the tool's output ("hi") is in the prompt.
REPLIES = [["<tool_response>\nhi\n</tool_response>", FINAL], ["", CALL]]
SCRIPT = (
    scripted_server()
    + """home=$(mktemp -d -p "$WORK")
cd "$home"
HOME="$home" ANTHROPIC_BASE_URL=http://127.0.0.1:{port} timeout 300 "$CLAUDE" \
  -p "Run echo hi with Bash." --output-format json --bare --model local-model \
  --system-prompt "You are terse." --tools Bash --allowedTools Bash --max-turns 5 \
  > "$WORK/result.json" 2> "$WORK/stderr.txt"
echo "$?" > "$WORK/exit"
kill $server
wait $server || true
"""
)


def test_claude_code_runs_a_scripted_bash_call(tmp_path: Path) -> None:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        pytest.fail("needs root, unshare and ip (iproute2; `make setup` installs it)")
    (tmp_path / "replies.json").write_text(json.dumps(REPLIES))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))},
        **RECIPE_ENV,
        "PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),
        "REPO": str(REPO),
        "TEMPLATE": str(templates_dir() / "Qwen-Qwen2.5-7B-Instruct.jinja"),
        "CLAUDE": str(claude_binary()),
        "WORK": str(tmp_path),
    }
    subprocess.run(
        ["unshare", "-n", "sh", "-c", SCRIPT.format(port=PORT)],
        env=env,
        timeout=900,
        check=True,
    )
    server_log = (tmp_path / "server.log").read_text()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert (tmp_path / "exit").read_text().strip() == "0", stderr + server_log
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["is_error"] is False, result
    assert result["subtype"] == "success"
    assert result["result"] == FINAL
    assert result["num_turns"] >= 2
    assert server_log.count('"POST /v1/messages?beta=true HTTP/1.1" 200') >= 2
    assert " 500 " not in server_log


MODEL_SCRIPT = (
    """
set -u
ip link set lo up
cd "$REPO"
"$SERVE" --port {port} --max-output-tokens 256 --default-temperature 0 > "$WORK/server.log" 2>&1 &
server=$!
"""
    + WAIT_FOR_SERVER
    + """home=$(mktemp -d -p "$WORK")
cd "$home"
HOME="$home" ANTHROPIC_BASE_URL=http://127.0.0.1:{port} timeout 400 "$CLAUDE" \
  -p "Use the Bash tool to run: echo hi" --output-format json --bare --model local-model \
  --system-prompt "You are terse." --tools Bash --allowedTools Bash --max-turns 2 \
  --debug-to-stderr > "$WORK/result.json" 2> "$WORK/stderr.txt"
echo "$?" > "$WORK/exit"
kill $server
wait $server || true
"""
)


def test_the_embedded_model_calls_bash_through_the_envelope(tmp_path: Path) -> None:
    """Not scripted: the embedded model on its own (tool-less) template, temperature 0,
    answers in the JSON envelope; its Bash call reaches Claude Code, which runs it and
    sends the result back for a second turn."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        pytest.fail("needs root, unshare and ip (iproute2; `make setup` installs it)")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))},
        **RECIPE_ENV,
        "PYTHON": sys.executable,
        "REPO": str(REPO),
        "SERVE": str(Path(sys.executable).with_name("compat-serve")),
        "CLAUDE": str(claude_binary()),
        "WORK": str(tmp_path),
    }
    subprocess.run(
        ["unshare", "-n", "sh", "-c", MODEL_SCRIPT.format(port=PORT + 2)],
        env=env,
        timeout=900,
        check=True,
    )
    server_log = (tmp_path / "server.log").read_text()
    stderr = (tmp_path / "stderr.txt").read_text()
    result = json.loads((tmp_path / "result.json").read_text())
    assert "JSON envelope" in server_log
    # Two model turns: the first called Bash, Claude Code ran it and asked again.
    assert server_log.count('"POST /v1/messages?beta=true HTTP/1.1" 200') >= 2, server_log
    assert result["num_turns"] >= 2, (result, stderr[-3000:])
    # Claude Code ran the model's Bash call (its debug log records each tool dispatch).
    assert "tool_dispatch_end tool=Bash" in stderr and "outcome=ok" in stderr, stderr[-3000:]
    assert " 500 " not in server_log
