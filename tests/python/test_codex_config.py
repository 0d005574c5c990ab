"""`compat-serve codex-config`: the Codex profile files, merging rules and refusals.

That Codex 0.163 accepts these files (apply_patch offered, requests reach the server) is
checked by tests/e2e/test_codex.py, which configures Codex with this command.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from compat_serve.cli import main

if TYPE_CHECKING:
    from tests.conftest import RunningServer


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["codex-config", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def offline(home: Path, *extra: str) -> list[str]:
    return ["--codex-home", str(home), "--model", "m1", "--context-length", "4096", *extra]


def read_profile(home: Path, profile: str = "compat-serve") -> dict[str, object]:
    return tomllib.loads((home / f"{profile}.config.toml").read_text())


def test_writes_profile_and_catalog(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "codex"
    code, out, _ = run(capsys, *offline(home, "--base-url", "http://127.0.0.1:9001/"))
    assert code == 0
    assert "codex --profile compat-serve" in out
    profile = read_profile(home)
    catalog_path = home / "compat-serve.models.json"
    assert profile["model"] == "m1"
    assert profile["model_provider"] == "compat-serve"
    assert profile["model_context_window"] == 4096
    assert profile["model_catalog_json"] == str(catalog_path.resolve())
    provider = profile["model_providers"]["compat-serve"]  # type: ignore[index]
    assert provider["base_url"] == "http://127.0.0.1:9001/v1"
    assert provider["wire_api"] == "responses"
    assert "env_key" not in provider  # no key: Codex sends no Authorization header
    entry = json.loads(catalog_path.read_text())["models"][0]
    assert entry["slug"] == "m1"
    assert entry["context_window"] == entry["max_context_window"] == 4096
    assert entry["apply_patch_tool_type"] == "freeform"
    assert "apply_patch" in entry["base_instructions"]
    assert not (home / "config.toml").exists()  # the user's config is never created/edited


def test_rerun_is_idempotent_and_other_content_is_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "codex"
    assert run(capsys, *offline(home))[0] == 0
    code, out, _ = run(capsys, *offline(home))
    assert code == 0 and out.count("unchanged") == 2
    # A different model would change both files: refused, nothing written.
    before = (home / "compat-serve.config.toml").read_text()
    code, _, err = run(capsys, "--codex-home", str(home), "--model", "m2", "--context-length", "9")
    assert code == 2
    assert "exists with other content" in err and "--force" in err
    assert (home / "compat-serve.config.toml").read_text() == before
    assert json.loads((home / "compat-serve.models.json").read_text())["models"][0]["slug"] == "m1"
    code, _, _ = run(
        capsys, "--codex-home", str(home), "--model", "m2", "--context-length", "9", "--force"
    )
    assert code == 0 and read_profile(home)["model"] == "m2"


def test_user_config_is_untouched_and_legacy_profile_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "codex"
    home.mkdir()
    user = 'model = "o3"\n[model_providers.mine]\nbase_url = "http://x"\n'
    (home / "config.toml").write_text(user)
    assert run(capsys, *offline(home))[0] == 0
    assert (home / "config.toml").read_text() == user
    (home / "config.toml").write_text(user + '[profiles.local]\nmodel = "x"\n')
    code, _, err = run(capsys, *offline(home, "--profile", "local"))
    assert code == 2 and "legacy" in err and "[profiles.local]" in err
    assert not (home / "local.config.toml").exists()
    (home / "config.toml").write_text("model = [broken\n")
    code, _, err = run(capsys, *offline(home, "--profile", "other"))
    assert code == 2 and "cannot read" in err


def test_api_key_env_and_instructions_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "codex"
    instructions = tmp_path / "inst.md"
    instructions.write_text("Be brief.\n")
    code, _, _ = run(
        capsys,
        *offline(home, "--api-key-env", "MY_KEY", "--instructions-file", str(instructions)),
    )
    assert code == 0
    assert read_profile(home)["model_providers"]["compat-serve"]["env_key"] == "MY_KEY"  # type: ignore[index]
    entry = json.loads((home / "compat-serve.models.json").read_text())["models"][0]
    assert entry["base_instructions"] == "Be brief.\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--context-length", "0", "--model", "m"], "--context-length must be >= 1"),
        (["--profile", "a b", "--model", "m", "--context-length", "5"], "--profile must be"),
        (["--instructions-file", "/nonexistent/x", "--model", "m", "--context-length", "5"],
         "cannot read --instructions-file"),
        # Nothing listens on port 9 of loopback: the message says what to do.
        (["--base-url", "http://127.0.0.1:9"], "start the server first"),
    ],
)  # fmt: skip
def test_refusals_are_clear(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, _, err = run(capsys, "--codex-home", str(tmp_path / "h"), *args)
    assert code == 2
    assert message in err
    assert not (tmp_path / "h").exists()


def test_reads_name_and_window_from_the_server(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "codex"
    code, _, _ = run(capsys, "--codex-home", str(home), "--base-url", server.base_url)
    assert code == 0
    profile = read_profile(home)
    assert profile["model"] == "SmolLM2-135M-Instruct"
    assert profile["model_context_window"] == 8192  # the GGUF's window
    entry = json.loads((home / "compat-serve.models.json").read_text())["models"][0]
    assert entry["context_window"] == 8192


def test_codex_home_env(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CODEX_HOME", str(tmp_path / "envhome"))
    code, _, _ = run(capsys, "--model", "m", "--context-length", "7")
    assert code == 0
    assert read_profile(tmp_path / "envhome")["model_context_window"] == 7
