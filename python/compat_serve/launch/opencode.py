"""OpenCode's settings: a generated config file named by `OPENCODE_CONFIG`.

OpenCode merges that file over the user's own config, so the user's settings stay and
nothing of theirs is written. The provider is `@ai-sdk/openai-compatible` (chat
completions) or, with `--api anthropic`, `@ai-sdk/anthropic` (Messages); both are bundled
in the OpenCode binary. The model carries the served window and an output limit
(OpenCode sends the output limit as `max_tokens` and compacts before `context - output`);
`model` and `small_model` (titles, summaries) both name it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compat_serve.launch.plan import ClientInfo, LaunchPlan, Served

INFO = ClientInfo(name="opencode", command="opencode", install="npm install -g opencode-ai")
PROVIDER_ID = "compat-serve"
PACKAGES = {"openai": "@ai-sdk/openai-compatible", "anthropic": "@ai-sdk/anthropic"}
# OpenCode's own cap on the output it asks for.
OPENCODE_OUTPUT_MAX = 32_000
NO_KEY = "compat-serve"


def output_limit(served: Served) -> int:
    """The server's --max-output-tokens, else a quarter of the window (at most 32k)."""
    if served.max_output_tokens is not None:
        return min(served.max_output_tokens, served.context_length)
    return max(1, min(OPENCODE_OUTPUT_MAX, served.context_length // 4))


def config(served: Served, api: str = "openai") -> dict[str, Any]:
    model_ref = f"{PROVIDER_ID}/{served.model}"
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            PROVIDER_ID: {
                "npm": PACKAGES[api],
                "name": "compat-serve",
                "options": {
                    "baseURL": served.base_url.rstrip("/") + "/v1",
                    "apiKey": served.api_key or NO_KEY,
                },
                "models": {
                    served.model: {
                        "name": served.model,
                        "tool_call": True,
                        "limit": {
                            "context": served.context_length,
                            "output": output_limit(served),
                        },
                    }
                },
            }
        },
        "model": model_ref,
        "small_model": model_ref,
    }


def plan(served: Served, tmp: Path, api: str = "openai") -> LaunchPlan:
    path = tmp / "opencode.json"
    text = json.dumps(config(served, api), indent=2) + "\n"
    return LaunchPlan(env={"OPENCODE_CONFIG": str(path)}, files={path: text})
