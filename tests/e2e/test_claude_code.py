"""The real Claude Code CLI (bundled in claude-agent-sdk) against compat-serve.

Server and client run inside a loopback-only network namespace (`unshare -n`), so the
client can reach nothing but our server. Print mode only, per shared/claude_code/README.md.
Claude Code sends no temperature, so the server runs with `--default-temperature 0`:
sampled replies sometimes ramble to the output cap and the CLI then gives up, which
would make this test depend on luck.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.platform_gates import needs_network_namespace

pytestmark = needs_network_namespace

RECIPE_ENV = {
    "ANTHROPIC_API_KEY": "x",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_UPDATES": "1",
    "CLAUDE_CODE_DISABLE_OFFICIAL_MARKETPLACE_AUTOINSTALL": "1",
    "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256",
    "CLAUDE_CODE_MAX_CONTEXT_TOKENS": "18000",
    "CLAUDE_CODE_DISABLE_THINKING": "1",
    "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
    "BASH_MAX_OUTPUT_LENGTH": "2000",
}
PORT = 8123
# Shell lines that wait (up to 60 s) until the server on {port} answers /health: one
# interpreter (-S: the standard library is all it needs) that polls every 0.1 s, not an
# interpreter per poll.
WAIT_FOR_SERVER = """"$PYTHON" -S -c "
import time, urllib.request as u
for _ in range(600):
    try:
        u.urlopen('http://127.0.0.1:{port}/health', timeout=2)
        break
    except OSError:
        time.sleep(0.1)
"
"""


def scripted_server(flags: str = "") -> str:
    """Shell lines that start `tests.e2e.scripted_serve` inside the namespace (replies from
    `$WORK/replies.json`, then `flags`) and wait until it answers /health."""
    start = (
        '\nset -u\nip link set lo up\ncd "$REPO"\n'
        '"$PYTHON" -m tests.e2e.scripted_serve --port {port} --template "$TEMPLATE" \\\n'
        f'  --replies "$WORK/replies.json"{flags} \\\n'
        '  > "$WORK/server.log" 2>&1 &\nserver=$!\n'
    )
    return start + WAIT_FOR_SERVER


SCRIPT = (
    """
set -u
ip link set lo up
"$SERVE" --port {port} --max-output-tokens 256 --default-temperature 0 > "$WORK/server.log" 2>&1 &
server=$!
"""
    + WAIT_FOR_SERVER
    + """for caps in unset set; do
  home=$(mktemp -d -p "$WORK")
  cd "$home"
  if [ "$caps" = set ]; then export CLAUDE_CODE_MODEL_CAPABILITIES=-mid_conv_system; fi
  HOME="$home" ANTHROPIC_BASE_URL=http://127.0.0.1:{port} timeout 300 "$CLAUDE" \
    -p "Say hello in five words." --output-format json --bare --model local-model \
    --system-prompt "You are terse." --tools Bash --allowedTools Bash --max-turns 3 \
    > "$WORK/result-$caps.json" 2> "$WORK/stderr-$caps.txt"
  echo "$?" > "$WORK/exit-$caps"
  unset CLAUDE_CODE_MODEL_CAPABILITIES
done
kill $server
wait $server || true
# The same through `compat-serve launch claude`: the launcher starts its own server (a free
# port, the served window) and sets every variable itself (the recipe's are unset).
home=$(mktemp -d -p "$WORK")
cd "$home"
env -u ANTHROPIC_API_KEY -u CLAUDE_CODE_MAX_CONTEXT_TOKENS HOME="$home" \
  PATH="$WORK/bin:$PATH" timeout 300 "$SERVE" launch claude \
  --max-output-tokens 256 --default-temperature 0 -- \
  -p "Say hello in five words." --output-format json --bare \
  --system-prompt "You are terse." --tools Bash --allowedTools Bash --max-turns 3 \
  > "$WORK/result-launch.json" 2> "$WORK/stderr-launch.txt"
echo "$?" > "$WORK/exit-launch"
pgrep -f "[c]ompat_serve[.]launch[.]child" > "$WORK/left-launch" || true
"""
)


def claude_binary() -> Path:
    import claude_agent_sdk

    binary = Path(claude_agent_sdk.__file__).parent / "_bundled" / "claude"
    assert binary.is_file(), f"claude binary missing at {binary}"
    return binary


def test_claude_code_print_mode_round_trip(tmp_path: Path) -> None:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        pytest.fail("needs root, unshare and ip (iproute2; `make setup` installs it)")
    serve = Path(sys.executable).with_name("compat-serve")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))},
        **RECIPE_ENV,
        "SERVE": str(serve),
        "PYTHON": sys.executable,
        "CLAUDE": str(claude_binary()),
        "WORK": str(tmp_path),
    }
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "claude").symlink_to(claude_binary())
    subprocess.run(
        ["unshare", "-n", "sh", "-c", SCRIPT.format(port=PORT)],
        env=env,
        timeout=900,
        check=True,
    )
    # Through the launcher: its own server answered, and is gone once the client exits.
    assert (tmp_path / "left-launch").read_text().strip() == ""
    server_log = (tmp_path / "server.log").read_text()
    for caps in ("unset", "set", "launch"):
        stderr = (tmp_path / f"stderr-{caps}.txt").read_text()
        assert (tmp_path / f"exit-{caps}").read_text().strip() == "0", stderr + server_log
        result = json.loads((tmp_path / f"result-{caps}.json").read_text())
        assert result["is_error"] is False, result
        assert result["type"] == "result" and result["subtype"] == "success"
        assert result["usage"]["input_tokens"] > 0
    assert server_log.count('"POST /v1/messages?beta=true HTTP/1.1" 200') >= 2
    assert " 500 " not in server_log
