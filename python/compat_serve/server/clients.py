"""Who sent a request: the client's name and its session, shown on the dashboard.

The name is `x-client-name` when sent (the dashboard's own chat box sends "dashboard"),
else the first product of `User-Agent` ("claude-cli", "codex_exec", "opencode"). The
session is the first of the headers agents send to tie a conversation's requests
together: Claude Code's `X-Claude-Code-Session-Id`, Codex's `session-id`, OpenCode's
`x-session-affinity` (older releases: `x-opencode-session`), and generic `session_id` /
`x-session-id`. Only its last 8 characters are kept: enough to tell sessions apart (the
front of a UUIDv7, as Codex sends, or of OpenCode's `ses_…` ids is a timestamp shared by
sessions started close together), and a label, not an identifier.
"""

from __future__ import annotations

from fastapi import Request

SESSION_HEADERS = (
    "x-claude-code-session-id",
    "session-id",
    "session_id",
    "x-session-affinity",
    "x-opencode-session",
    "x-session-id",
)
MAX_NAME_CHARS = 40
SESSION_CHARS = 8


def _printable(text: str) -> str:
    return "".join(c for c in text if c.isprintable()).strip()


def client_label(request: Request) -> str:
    """`"<name> <session suffix>"`, or just the name, or "unknown"."""
    headers = request.headers
    name = headers.get("x-client-name", "")
    if not name:
        agent = headers.get("user-agent", "").strip()
        name = agent.split(" ", 1)[0].split("/", 1)[0]
    name = _printable(name)[:MAX_NAME_CHARS].strip() or "unknown"
    for header in SESSION_HEADERS:
        session = _printable(headers.get(header, ""))
        if session:
            return f"{name} {session[-SESSION_CHARS:]}"
    return name
