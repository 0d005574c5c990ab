"""What `compat-serve launch` gives each client: environment, arguments, generated config.

That the real clients accept these settings is checked in tests/e2e (test_launch.py for
Claude Code and Codex, test_opencode.py for OpenCode), the process handling (server start
and stop, exit codes, signals) in tests/e2e/test_launch.py with a fake client on PATH.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from compat_serve.launch import claude, codex, opencode
from compat_serve.launch.command import main, render_plan
from compat_serve.launch.plan import Served

BASE = "http://127.0.0.1:9123"


def served(**overrides: Any) -> Served:
    fields: dict[str, Any] = {"base_url": BASE, "model": "qwen-local", "context_length": 32768}
    return Served(**{**fields, **overrides})


def test_claude_env_points_every_model_and_the_window_at_the_server() -> None:
    plan = claude.plan(served(max_output_tokens=2048))
    env = plan.environment({"ANTHROPIC_API_KEY": "sk-real", "HOME": "/home/u", "PATH": "/bin"})
    assert env["ANTHROPIC_BASE_URL"] == BASE
    assert env["ANTHROPIC_AUTH_TOKEN"] == "compat-serve"
    assert "ANTHROPIC_API_KEY" not in env  # the user's real key would win over ours
    for name in (
        "ANTHROPIC_MODEL",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL",
        "ANTHROPIC_DEFAULT_SONNET_MODEL",
        "ANTHROPIC_DEFAULT_OPUS_MODEL",
    ):
        assert env[name] == "qwen-local", name
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "32768"
    assert env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "32768"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "2048"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert env["DISABLE_TELEMETRY"] == "1"
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert env["HOME"] == "/home/u" and env["PATH"] == "/bin"  # the rest is inherited
    assert plan.args == [] and plan.files == {}


def test_claude_sends_the_servers_api_key_and_no_output_cap_without_one() -> None:
    env = claude.plan(served(api_key="s3cret")).env
    assert env["ANTHROPIC_AUTH_TOKEN"] == "s3cret"
    assert "CLAUDE_CODE_MAX_OUTPUT_TOKENS" not in env


def _overrides(args: list[str]) -> dict[str, Any]:
    """Codex's `-c key=value` arguments, parsed the way Codex parses them (TOML values)."""
    assert args[::2] == ["-c"] * (len(args) // 2)
    parsed: dict[str, Any] = {}
    for item in args[1::2]:
        key, value = item.split("=", 1)
        parsed[key] = tomllib.loads(f"v = {value}")["v"]
    return parsed


def test_codex_overrides_match_codex_configs_profile(tmp_path: Path) -> None:
    plan = codex.plan(served(), tmp_path)
    settings = _overrides(plan.args)
    catalog_path = tmp_path / "codex-models.json"
    assert settings == {
        "model": "qwen-local",
        "model_provider": "compat-serve",
        "model_context_window": 32768,
        "model_catalog_json": str(catalog_path),
        "model_providers.compat-serve.name": "compat-serve",
        "model_providers.compat-serve.base_url": BASE + "/v1",
        "model_providers.compat-serve.wire_api": "responses",
        "model_providers.compat-serve.stream_idle_timeout_ms": 900_000,
    }
    assert plan.env == {}
    plan.write_files()
    (entry,) = json.loads(catalog_path.read_text())["models"]
    assert entry["slug"] == "qwen-local"
    assert entry["context_window"] == 32768
    assert entry["apply_patch_tool_type"] == "freeform"


def test_codex_with_an_api_key_reads_it_from_the_environment(tmp_path: Path) -> None:
    plan = codex.plan(served(api_key="s3cret"), tmp_path)
    assert _overrides(plan.args)["model_providers.compat-serve.env_key"] == "COMPAT_SERVE_API_KEY"
    assert plan.env == {"COMPAT_SERVE_API_KEY": "s3cret"}


@pytest.mark.parametrize(
    ("api", "package"),
    [("openai", "@ai-sdk/openai-compatible"), ("anthropic", "@ai-sdk/anthropic")],
)
def test_opencode_config_names_the_provider_model_window_and_small_model(
    tmp_path: Path, api: str, package: str
) -> None:
    plan = opencode.plan(served(), tmp_path, api)
    path = tmp_path / "opencode.json"
    assert plan.env == {"OPENCODE_CONFIG": str(path)}
    plan.write_files()
    config = json.loads(path.read_text())
    provider = config["provider"]["compat-serve"]
    assert provider["npm"] == package
    assert provider["options"]["baseURL"] == BASE + "/v1"
    assert provider["models"]["qwen-local"]["limit"] == {"context": 32768, "output": 8192}
    assert config["model"] == config["small_model"] == "compat-serve/qwen-local"


def test_opencode_output_limit_follows_the_servers_cap() -> None:
    assert opencode.output_limit(served(max_output_tokens=512)) == 512
    assert opencode.output_limit(served(context_length=400_000)) == 32_000
    assert (
        opencode.config(served(api_key="k"))["provider"]["compat-serve"]["options"]["apiKey"] == "k"
    )


def test_print_shows_what_the_client_gets(tmp_path: Path) -> None:
    plan = opencode.plan(served(), tmp_path)
    text = render_plan(["opencode", "run", "hi there"], plan, served())
    assert f"export OPENCODE_CONFIG={tmp_path / 'opencode.json'}" in text
    assert "opencode run 'hi there'" in text
    assert '"baseURL": "http://127.0.0.1:9123/v1"' in text
    assert "context window 32768 tokens" in text


def test_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["cursor"])
    assert exc.value.code == 2
    assert "unknown client 'cursor'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["claude", "--api", "anthropic"])
    assert "--api applies to opencode only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["codex", "--url", BASE, "--model", "x"])
    assert "serve options other than --api-key" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["codex", "--no-such-flag"])
    assert "--no-such-flag" in capsys.readouterr().err


def test_codex_overrides_follow_a_subcommand(tmp_path: Path) -> None:
    """`codex -c A exec -c B` reads only B (Codex 0.163), so ours go after `exec`."""
    plan = codex.plan(served(), tmp_path)
    command = plan.command("codex", ["exec", "-c", 'approval_policy="never"', "hi"])
    assert command[:2] == ["codex", "exec"]
    assert command[2:-3] == plan.args
    assert command[-3:] == ["-c", 'approval_policy="never"', "hi"]
    assert plan.command("codex", ["fix it"]) == ["codex", *plan.args, "fix it"]
