"""The `compat-serve` command line: help, convert-gguf, and clear startup errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from compat_serve.cli import build_convert_parser
from compat_serve.serve_flags import build_serve_parser

SERVE_FLAGS = [
    "--model",
    "--models-dir",
    "--models",
    "--memory-budget",
    "--model-wait-timeout",
    "--host",
    "--port",
    "--served-model-name",
    "--api-key",
    "--chat-template",
    "--inline-system",
    "--context-length",
    "--kv-bits",
    "--kv-group-size",
    "--prefill-chunk",
    "--decode-prefill-chunk",
    "--max-queue",
    "--strict-model-names",
    "--max-output-tokens",
    "--max-request-bytes",
    "--default-temperature",
    "--generation-config",
    "--reply-history",
    "--log-level",
]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "compat_serve.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_help_documents_every_flag() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for flag in SERVE_FLAGS:
        assert flag in result.stdout, flag
    assert "convert-gguf" in result.stdout
    # Every option has help text of its own.
    for action in build_serve_parser()._actions:
        assert action.help, action.option_strings
    for action in build_convert_parser()._actions:
        assert action.help, action.option_strings


def test_generation_config_is_auto_unless_none_is_asked() -> None:
    parser = build_serve_parser()
    assert parser.parse_args([]).generation_config == "auto"
    assert parser.parse_args(["--generation-config", "none"]).generation_config == "none"


def test_reply_history_is_loop_unless_asked() -> None:
    parser = build_serve_parser()
    assert parser.parse_args([]).reply_history == "loop"
    for mode in ("all", "template"):
        assert parser.parse_args(["--reply-history", mode]).reply_history == mode


def test_convert_gguf_command_writes_a_loadable_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command's own `main`, in this process (a process would add seconds of imports
    to the conversion), with its default `--dtype` (the GGUF's quantization kept: a fifth
    of float32's bytes to write; the dense conversions are test_gguf_families.py's)."""
    from compat_serve.cli import main
    from compat_serve.models.embedded import embedded_model_path

    out = tmp_path / "converted"
    assert main(["convert-gguf", str(embedded_model_path()), str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["quantization"]["bits"] == 4  # the embedded file is Q4_1
    assert (out / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
        (["--chat-template", "/nonexistent/template.jinja"], "template.jinja"),
        (["--prefill-chunk", "0"], "--prefill-chunk"),
        (["--decode-prefill-chunk", "0"], "--decode-prefill-chunk"),
        (["--decode-prefill-chunk", "40"], "--decode-prefill-chunk (40) must be a multiple"),
        (["--default-temperature", "3"], "--default-temperature"),
        (["--generation-config", "vllm"], "--generation-config"),
        (["--reply-history", "always"], "--reply-history"),
        (["--kv-bits", "3"], "--kv-bits must be 8 or 4, not 3"),
        (["--kv-group-size", "48"], "--kv-group-size must be 32, 64 or 128, not 48"),
        (["--context-length", "0"], "--context-length must be auto or an integer >= 2, not 0"),
        (["--models", "/nonexistent/models.yaml"], "/nonexistent/models.yaml:1: cannot read"),
        (["--models-dir", "/nonexistent/models"], "--models-dir /nonexistent/models: not a"),
    ],
)
def test_startup_errors_are_clear(
    args: list[str],
    needle: str,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    kept_log_handlers: None,
) -> None:
    """In this process (the command's own `main`, each case in milliseconds where a process
    took four seconds of imports); exit code 2 and a stderr without a traceback, as a
    process, are test_a_bad_models_file_stops_the_start_naming_file_line_and_key's."""
    from compat_serve.cli import main

    try:
        code = main([*args, "--port", "1"])
    except SystemExit as exit_:  # argparse's refusals
        code = exit_.code
    assert code == 2
    assert needle in capsys.readouterr().err + caplog.text


def test_a_bad_models_file_stops_the_start_naming_file_line_and_key(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    kept_log_handlers: None,
) -> None:
    """A real process: exit code 2 and no traceback after the server's imports."""
    from compat_serve.cli import main

    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    models = tmp_path / "models.yaml"
    models.write_text("models:\n  - id: a\n    path: a.gguf\n    tool_parser: 7\n")
    result = run_cli("--models", str(models), "--port", "1")
    assert result.returncode == 2
    assert f"{models}:4: tool_parser: must be a string, not 7" in result.stderr
    assert "Traceback" not in result.stderr
    # A per-model option with a bad value fails before any model loads (in this process:
    # the exit code and the clean stderr were the process's above).
    models.write_text("models:\n  - id: a\n    path: a.gguf\n    kv_bits: 3\n")
    assert main(["--models", str(models), "--port", "1"]) == 2
    needle = f"{models}:2: model 'a': --kv-bits must be 8 or 4, not 3"
    assert needle in capsys.readouterr().err + caplog.text
