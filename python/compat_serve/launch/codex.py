"""Codex's settings: `-c` overrides before the client's own arguments, and a model catalog.

The overrides are `compat-serve codex-config`'s profile (a provider speaking the
Responses API, the model, its context window) given on the command line, so Codex reads
the user's own `$CODEX_HOME` (login, history) and nothing there is written. The catalog
entry (`model_catalog_json`, written to the launcher's temp directory) is codex-config's
too: it gives Codex the window and the `apply_patch` tool for a model it does not know.
"""

from __future__ import annotations

import json
from pathlib import Path

from compat_serve.codex_config import BASE_INSTRUCTIONS, DEFAULT_PROFILE, catalog, override_args
from compat_serve.launch.plan import ClientInfo, LaunchPlan, Served

INFO = ClientInfo(name="codex", command="codex", install="npm install -g @openai/codex")
# Codex sends the provider's env_key variable as a bearer token.
API_KEY_ENV = "COMPAT_SERVE_API_KEY"
# Codex 0.163 drops the top-level `-c` overrides when a subcommand gets `-c` of its own
# (`codex -c A exec -c B` uses B only), so for these the overrides follow the subcommand.
SUBCOMMANDS = frozenset({"exec", "e", "review", "resume", "fork"})


def plan(served: Served, tmp: Path) -> LaunchPlan:
    catalog_path = tmp / "codex-models.json"
    catalog_json = catalog(served.model, served.context_length, BASE_INSTRUCTIONS)
    args = override_args(
        profile=DEFAULT_PROFILE,
        model=served.model,
        context_length=served.context_length,
        base_url=served.base_url,
        catalog_path=catalog_path,
        api_key_env=API_KEY_ENV if served.api_key else None,
    )
    env = {API_KEY_ENV: served.api_key} if served.api_key else {}
    return LaunchPlan(
        args=args,
        env=env,
        files={catalog_path: json.dumps(catalog_json, indent=2) + "\n"},
        subcommands=SUBCOMMANDS,
    )
