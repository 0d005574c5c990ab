"""`compat-serve launch` as a process: server start and stop, exit codes, signals, --url.

The client here is a fake: a small shell script on PATH named like the real client, which
records its environment and arguments (and what it reads from the server) and exits with
the code it is told. The real clients run in test_opencode.py and test_launch_clients.py.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from compat_serve.launch.command import main
from tests.tiny_models import write_model_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

FAKE_CLIENT = """#!/bin/sh
# A stand-in for the client program: records what the launcher gave it.
env > "$FAKE_RECORD/env"
printf '%s\\n' "$@" > "$FAKE_RECORD/args"
if [ -n "${ANTHROPIC_BASE_URL:-}" ]; then
  "$FAKE_PYTHON" -c "import urllib.request as u, os; \
print(u.urlopen(os.environ['ANTHROPIC_BASE_URL'] + '/v1/models').read().decode())" \
    > "$FAKE_RECORD/models.json"
fi
if [ -n "${OPENCODE_CONFIG:-}" ]; then cp "$OPENCODE_CONFIG" "$FAKE_RECORD/opencode.json"; fi
if [ -n "${FAKE_WAIT_TERM:-}" ]; then
  trap 'echo TERM > "$FAKE_RECORD/signal"; exit 42' TERM
  echo $$ > "$FAKE_RECORD/ready"
  while :; do sleep 0.1; done
fi
exit "${FAKE_RC:-0}"
"""
# A small, quick server: a tiny random llama directory (the fake clients only read
# /v1/models; its load is a fraction of the embedded model's) with a short window.
SERVE = ["--context-length", "2048", "--max-output-tokens", "77", "--kv-memory", "256MB"]


@pytest.fixture(scope="module")
def serve_args(tmp_path_factory: pytest.TempPathFactory, embedded_model: LoadedModel) -> list[str]:
    model = tmp_path_factory.mktemp("launch-model") / "llama"
    write_model_dir(model, "llama", embedded_model)
    return ["--model", str(model), *SERVE]


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A bin/ with fake claude, codex and opencode first on PATH; returns the record dir."""
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    for name in ("claude", "codex", "opencode"):
        (bin_dir / name).write_text(FAKE_CLIENT)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_RECORD", str(record))
    monkeypatch.setenv("FAKE_PYTHON", sys.executable)
    monkeypatch.delenv("COMPAT_SERVE_API_KEY", raising=False)
    return record


def recorded_env(record: Path) -> dict[str, str]:
    lines = (record / "env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def processes_with(marker: str) -> list[int]:
    """Live processes whose command line contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline and "compat_serve.launch.child" in cmdline:
            found.append(int(entry.name))
    return found


def port_closed(base_url: str) -> bool:
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as sock:
        return sock.connect_ex((host, int(port))) != 0


def launch_process(*args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "compat_serve.cli", "launch", *args],
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_launch_starts_the_server_runs_the_client_and_passes_its_exit_code(
    fake: Path, serve_args: list[str]
) -> None:
    name = f"launch-{uuid.uuid4().hex[:8]}"
    process = launch_process(
        "claude",
        *serve_args,
        "--served-model-name",
        name,
        "--",
        "-p",
        "two words",
        FAKE_RC="7",
        ANTHROPIC_API_KEY="sk-real-key",
    )
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 7, stderr
    env = recorded_env(fake)
    base_url = env["ANTHROPIC_BASE_URL"]
    assert base_url.startswith("http://127.0.0.1:")
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == name
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "2048"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "77"
    assert "ANTHROPIC_API_KEY" not in env
    assert (fake / "args").read_text().splitlines() == ["-p", "two words"]
    # The client reached the server the launcher started...
    assert f'"id":"{name}"' in (fake / "models.json").read_text()
    # ...and the server is gone once the launcher has returned.
    assert port_closed(base_url)
    assert processes_with(name) == []


def test_sigterm_reaches_the_client_first_then_the_server_stops(
    fake: Path, serve_args: list[str]
) -> None:
    name = f"launch-{uuid.uuid4().hex[:8]}"
    process = launch_process(
        "opencode", *serve_args, "--served-model-name", name, FAKE_WAIT_TERM="1"
    )
    deadline = time.monotonic() + 240
    while not (fake / "ready").exists():
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert processes_with(name)  # the server runs while the client does
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert (fake / "signal").read_text().strip() == "TERM"
    assert process.returncode == 42, stderr  # the client's code for it
    assert processes_with(name) == []
    # The generated config lived in a temp dir that is gone now.
    config_path = recorded_env(fake)["OPENCODE_CONFIG"]
    config = json.loads((fake / "opencode.json").read_text())
    assert config["model"] == config["small_model"] == f"compat-serve/{name}"
    assert not Path(config_path).exists()


def test_a_server_that_fails_to_start_is_reported_and_the_client_never_runs(
    fake: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-model"
    assert main(["claude", "--model", str(missing)]) == 2  # the server's exit code
    err = capsys.readouterr().err
    assert "the server exited with code 2 before it was ready" in err
    assert str(missing) in err  # its last log lines say why
    assert not (fake / "env").exists()


def test_url_uses_a_running_server_and_removes_what_it_generated(
    fake: Path, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_RC", "3")
    assert main(["codex", "--url", server.base_url + "/v1", "--", "exec", "say hi"]) == 3
    args = (fake / "args").read_text().splitlines()
    # Codex's subcommand first: its own -c options would drop top-level ones.
    assert args[0] == "exec" and args[-1] == "say hi"
    assert args[1:-1:2] == ["-c"] * ((len(args) - 2) // 2)
    overrides = dict(a.split("=", 1) for a in args[2:-1:2])
    assert overrides["model_providers.compat-serve.base_url"] == f'"{server.base_url}/v1"'
    assert overrides["model_providers.compat-serve.wire_api"] == '"responses"'
    assert overrides["model_context_window"] == str(server.state.context_length)  # type: ignore[attr-defined]
    assert not Path(overrides["model_catalog_json"].strip('"')).exists()


def test_print_shows_exactly_what_the_client_gets(
    fake: Path, server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["claude", "--url", server.base_url, "--print"]) == 0
    printed = capsys.readouterr().out
    assert not (fake / "env").exists()  # --print runs no client
    exports = {}
    for line in printed.splitlines():
        if line.startswith("export "):
            name, value = line.removeprefix("export ").split("=", 1)
            exports[name] = shlex.split(value)[0]
    assert main(["claude", "--url", server.base_url]) == 0
    env = recorded_env(fake)
    assert exports and {name: env[name] for name in exports} == exports
    assert "unset ANTHROPIC_API_KEY" in printed


def test_a_client_not_on_path_exits_127_with_its_install_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    for client, install in [
        ("claude", "npm install -g @anthropic-ai/claude-code"),
        ("codex", "npm install -g @openai/codex"),
        ("opencode", "npm install -g opencode-ai"),
    ]:
        assert main([client]) == 127
        err = capsys.readouterr().err
        assert f"'{client}' is not on PATH" in err and install in err
