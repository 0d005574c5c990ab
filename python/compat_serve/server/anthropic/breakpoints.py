"""`cache_control` breakpoints of a Messages request → where the prompt cache pins.

Anthropic caches the prefix `tools → system → messages` up to each block marked
`cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` (at most 4). Here each
breakpoint becomes a count of leading chat messages (the neutral messages the adapter
builds): a tools or system breakpoint covers the system messages (templates render the
tools inside the system turn), a breakpoint in `messages[i]` covers everything up to and
including that message. The prompt builder turns counts into token offsets
(chat/breakpoints.py); the blocks themselves never reach the template.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from compat_serve.chat.types import Message
from compat_serve.engine.prefix.pins import DEFAULT_TTL, TTL_SECONDS
from compat_serve.server.anthropic.protocol import (
    ContentBlock,
    CountTokensRequest,
    MessagesRequest,
)
from compat_serve.server.errors import ApiError

# Anthropic's limit on breakpoints per request.
MAX_BREAKPOINTS = 4


def breakpoints(
    body: MessagesRequest | CountTokensRequest,
    system_messages: list[Message],
    messages_upto: Callable[[int], list[Message]],
) -> list[tuple[int, int]]:
    """`(leading chat messages, ttl_seconds)` per breakpoint, in prompt order.
    `messages_upto(i)`: the chat messages of `body.messages[: i + 1]`. Raises a 400 for a
    malformed `cache_control` or more than 4 breakpoints."""
    found: list[tuple[int, int]] = []
    for i, tool in enumerate(body.tools or []):
        ttl = _ttl(tool.cache_control, f"tools[{i}].cache_control")
        if ttl is not None:
            found.append((len(system_messages), ttl))
    if isinstance(body.system, list):
        for j, block in enumerate(body.system):
            ttl = _ttl(_block_field(block), f"system[{j}].cache_control")
            if ttl is not None:
                found.append((len(system_messages), ttl))
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            continue
        ttls = [
            _ttl(_block_field(block), f"messages[{i}].content[{j}].cache_control")
            for j, block in enumerate(message.content)
        ]
        for ttl in ttls:
            if ttl is not None:
                found.append((len(system_messages) + len(messages_upto(i)), ttl))
    if len(found) > MAX_BREAKPOINTS:
        raise ApiError(
            400,
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {len(found)}.",
        )
    return [(count, ttl) for count, ttl in found if count > 0]


def _block_field(block: ContentBlock) -> Any:
    return (block.model_extra or {}).get("cache_control")


def _ttl(control: Any, where: str) -> int | None:
    """A breakpoint's TTL in seconds; None where there is none."""
    if control is None:
        return None
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        raise ApiError(400, f'{where}: must be {{"type": "ephemeral"}}', param=where)
    ttl = control.get("ttl", DEFAULT_TTL)
    if ttl not in TTL_SECONDS:
        raise ApiError(400, f"{where}.ttl: must be '5m' or '1h', not {ttl!r}", param=where)
    return TTL_SECONDS[ttl]
