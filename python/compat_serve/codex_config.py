"""`compat-serve codex-config`: point the Codex CLI at a running compat-serve.

Codex 0.163 reads profiles from their own files, `$CODEX_HOME/<profile>.config.toml`
(selected with `codex --profile <profile>`); a `[profiles.<profile>]` table in
`config.toml` is refused by Codex as legacy. So this command never edits the user's
`config.toml`: it writes

- `<profile>.config.toml`: the model, a `model_providers.<profile>` entry speaking the
  Responses API (`wire_api = "responses"`, no `env_key` unless `--api-key-env`), the real
  context window, and `model_catalog_json` pointing at
- `<profile>.models.json`: a model catalog entry for the served model. Without one Codex
  treats the name as unknown ("fallback metadata"): no `apply_patch` tool and its full
  ~5k-token base instructions. The entry declares the freeform `apply_patch` tool (a Lark
  grammar the server constrains decoding to), the real context window, and short base
  instructions sized for local models (`--instructions-file` replaces them).

An existing file with other content is left alone unless `--force`.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PROFILE = "compat-serve"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
# Long prompts prefill for minutes on a CPU; the server sends keep-alives meanwhile.
STREAM_IDLE_TIMEOUT_MS = 900_000
BASE_INSTRUCTIONS = """\
You are Codex, a coding agent running in the user's terminal, in the user's workspace.
Do what the user asks with the tools you have:
- create or edit files with the `apply_patch` tool (a patch between `*** Begin Patch` and \
`*** End Patch`, with `*** Add File: PATH` and lines starting with `+` for a new file);
- run shell commands with `exec_command`.
Keep answers short. When the task is done, say what you did in one sentence.
"""


class CodexConfigError(Exception):
    """A refusal or a failure, with the message to show the user."""


@dataclass(frozen=True)
class Served:
    model: str
    context_length: int


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="compat-serve codex-config",
        description="Write a Codex CLI profile for a compat-serve server: "
        "$CODEX_HOME/<profile>.config.toml (provider, model, context window) and "
        "<profile>.models.json (the model's catalog entry, so Codex offers apply_patch). "
        "config.toml is never edited. Then run `codex --profile <profile>`.",
    )
    p.add_argument(
        "--base-url",
        default=DEFAULT_BASE_URL,
        help=f"the server (default {DEFAULT_BASE_URL}); its /v1/models gives the model name "
        "and context window unless --model and --context-length are both given",
    )
    p.add_argument("--model", help="model name to request (default: the server's)")
    p.add_argument(
        "--context-length", type=int, help="context window in tokens (default: the server's)"
    )
    p.add_argument(
        "--codex-home",
        help="Codex's home directory (default: $CODEX_HOME, else ~/.codex)",
    )
    p.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"profile and provider id (default {DEFAULT_PROFILE})",
    )
    p.add_argument(
        "--api-key-env",
        help="environment variable holding the server's --api-key, sent by Codex as a "
        "bearer token (default: none, for a server without --api-key)",
    )
    p.add_argument(
        "--instructions-file",
        help="base instructions for the model (default: a short prompt for local models)",
    )
    p.add_argument(
        "--force", action="store_true", help="overwrite existing profile files that differ"
    )
    return p


def query_server(base_url: str, api_key: str | None) -> Served:
    """The served model's name and context window, from its `/v1/models`."""
    url = base_url.rstrip("/") + "/v1/models"
    request = urllib.request.Request(url)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            listing = json.load(reply)
    except urllib.error.HTTPError as exc:
        raise CodexConfigError(f"{url} answered {exc.code}: {exc.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise CodexConfigError(
            f"cannot read {url} ({exc}); start the server first, or pass both --model and "
            "--context-length"
        ) from None
    try:
        card = listing["data"][0]
        return Served(str(card["id"]), int(card["context_length"]))
    except (KeyError, IndexError, TypeError, ValueError):
        raise CodexConfigError(f"{url} did not list a model with a context_length") from None


def catalog(model: str, context_length: int, instructions: str) -> dict[str, Any]:
    """A Codex model catalog (`model_catalog_json`) with one entry for the served model."""
    entry = {
        "slug": model,
        "display_name": model,
        "description": "A local model served by compat-serve",
        "context_window": context_length,
        "max_context_window": context_length,
        "apply_patch_tool_type": "freeform",
        "shell_type": "shell_command",
        "visibility": "list",
        "supported_in_api": True,
        "priority": 0,
        "base_instructions": instructions,
        "input_modalities": ["text"],
        "default_reasoning_level": None,
        "supported_reasoning_levels": [],
        "supports_reasoning_summaries": False,
        "support_verbosity": False,
        "supports_parallel_tool_calls": False,
        "experimental_supported_tools": [],
        "truncation_policy": {"mode": "tokens", "limit": 10_000},
    }
    return {"models": [entry]}


def _toml_string(value: str) -> str:
    # A JSON string literal is a valid TOML basic string (same escapes, \\uXXXX included).
    return json.dumps(value)


def profile_settings(
    *,
    profile: str,
    model: str,
    context_length: int,
    base_url: str,
    catalog_path: Path,
    api_key_env: str | None,
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The profile's top-level settings and its provider's, as (key, TOML value) pairs."""
    top = [
        ("model", _toml_string(model)),
        ("model_provider", _toml_string(profile)),
        ("model_context_window", str(context_length)),
        ("model_catalog_json", _toml_string(str(catalog_path))),
    ]
    provider = [
        ("name", '"compat-serve"'),
        ("base_url", _toml_string(base_url.rstrip("/") + "/v1")),
        ("wire_api", '"responses"'),
        ("stream_idle_timeout_ms", str(STREAM_IDLE_TIMEOUT_MS)),
    ]
    if api_key_env:
        provider.append(("env_key", _toml_string(api_key_env)))
    return top, provider


def profile_toml(*, profile: str, **settings: Any) -> str:
    top, provider = profile_settings(profile=profile, **settings)
    lines = [
        f"# Written by `compat-serve codex-config`; use it with `codex --profile {profile}`.",
        *(f"{key} = {value}" for key, value in top),
        "",
        f"[model_providers.{_toml_string(profile)}]",
        *(f"{key} = {value}" for key, value in provider),
    ]
    return "\n".join(lines) + "\n"


def override_args(*, profile: str, **settings: Any) -> list[str]:
    """The same settings as `-c key=value` arguments, for a Codex run that reads no profile."""
    top, provider = profile_settings(profile=profile, **settings)
    pairs = top + [(f"model_providers.{profile}.{key}", value) for key, value in provider]
    return [arg for key, value in pairs for arg in ("-c", f"{key}={value}")]


def codex_home(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit).expanduser()
    env = os.environ.get("CODEX_HOME")
    return Path(env).expanduser() if env else Path.home() / ".codex"


def _check_no_legacy_profile(home: Path, profile: str) -> None:
    """Codex refuses to start when config.toml still defines the profile the old way."""
    config = home / "config.toml"
    if not config.is_file():
        return
    try:
        data = tomllib.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise CodexConfigError(f"cannot read {config}: {exc}") from None
    profiles = data.get("profiles")
    if (isinstance(profiles, dict) and profile in profiles) or data.get("profile") == profile:
        raise CodexConfigError(
            f"{config} defines profile {profile!r} the legacy way ([profiles.{profile}] or "
            f'profile = "{profile}"), which Codex 0.163 refuses next to {profile}.config.toml: '
            "remove it there, or pick another --profile"
        )


def _plan_write(path: Path, content: str, force: bool) -> bool:
    """True when `path` must be (re)written; refuses to replace other content."""
    if not path.exists():
        return True
    try:
        current = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CodexConfigError(f"cannot read {path}: {exc}") from None
    if current == content:
        return False
    if not force:
        raise CodexConfigError(
            f"{path} exists with other content; not overwriting it (pass --force to replace it)"
        )
    return True


def write_codex_config(ns: argparse.Namespace) -> list[str]:
    """Write the profile; returns the messages to print. Raises CodexConfigError."""
    if ns.context_length is not None and ns.context_length < 1:
        raise CodexConfigError("--context-length must be >= 1")
    if not ns.profile or not all(c.isalnum() or c in "-_" for c in ns.profile):
        raise CodexConfigError("--profile must be letters, digits, '-' or '_'")
    if ns.model is not None and ns.context_length is not None:
        served = Served(ns.model, ns.context_length)
    else:
        key = os.environ.get(ns.api_key_env) if ns.api_key_env else None
        found = query_server(ns.base_url, key)
        served = Served(ns.model or found.model, ns.context_length or found.context_length)
    instructions = BASE_INSTRUCTIONS
    if ns.instructions_file:
        try:
            instructions = Path(ns.instructions_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CodexConfigError(f"cannot read --instructions-file: {exc}") from None
    home = codex_home(ns.codex_home)
    _check_no_legacy_profile(home, ns.profile)
    catalog_path = (home / f"{ns.profile}.models.json").resolve()
    profile_path = home / f"{ns.profile}.config.toml"
    files = {
        catalog_path: json.dumps(
            catalog(served.model, served.context_length, instructions), indent=2
        )
        + "\n",
        profile_path: profile_toml(
            profile=ns.profile,
            model=served.model,
            context_length=served.context_length,
            base_url=ns.base_url,
            catalog_path=catalog_path,
            api_key_env=ns.api_key_env,
        ),
    }
    # Decide every file before writing any, so a refusal leaves nothing half-written.
    todo = {path: text for path, text in files.items() if _plan_write(path, text, ns.force)}
    home.mkdir(parents=True, exist_ok=True)
    messages = []
    for path, text in files.items():
        if path in todo:
            path.write_text(text, encoding="utf-8")
            messages.append(f"wrote {path}")
        else:
            messages.append(f"unchanged {path}")
    messages.append(
        f"model {served.model!r}, context window {served.context_length} tokens; run: "
        f"codex --profile {ns.profile}   (or: codex exec --profile {ns.profile} ...)"
    )
    return messages
