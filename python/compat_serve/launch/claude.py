"""Claude Code's settings: environment variables only (no file, no argument).

The main model and the haiku/sonnet/opus defaults (used for background calls, subagents
and `/model` picks) all name the served model, so no call goes to a model the server
lacks. Claude Code assumes an unknown model has a 1M window; `CLAUDE_CODE_MAX_CONTEXT_TOKENS`
gives it the served one and `CLAUDE_CODE_AUTO_COMPACT_WINDOW` the window auto-compaction
sizes itself to. The attribution header is off because it puts a per-request hash in the
system prompt, which would defeat the prefix cache.
"""

from __future__ import annotations

from compat_serve.launch.plan import ClientInfo, LaunchPlan, Served

INFO = ClientInfo(
    name="claude",
    command="claude",
    install="npm install -g @anthropic-ai/claude-code",
)
# Claude Code sends the token as `Authorization: Bearer`; a server without --api-key
# accepts any.
NO_KEY_TOKEN = "compat-serve"
MODEL_VARIABLES = (
    "ANTHROPIC_MODEL",
    "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL",
    "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "ANTHROPIC_SMALL_FAST_MODEL",
    "CLAUDE_CODE_SUBAGENT_MODEL",
)
QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
}
# Credentials and routes that would send the client elsewhere than our server.
UNSET = [
    "ANTHROPIC_API_KEY",
    "CLAUDE_CODE_USE_BEDROCK",
    "CLAUDE_CODE_USE_VERTEX",
    "CLAUDE_CODE_USE_FOUNDRY",
    "CLAUDE_CODE_OAUTH_TOKEN",
]


def plan(served: Served) -> LaunchPlan:
    env = {
        "ANTHROPIC_BASE_URL": served.base_url,
        "ANTHROPIC_AUTH_TOKEN": served.api_key or NO_KEY_TOKEN,
        **{name: served.model for name in MODEL_VARIABLES},
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(served.context_length),
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(served.context_length),
        **QUIET,
    }
    if served.max_output_tokens is not None:
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(served.max_output_tokens)
    return LaunchPlan(env=env, unset=list(UNSET))
