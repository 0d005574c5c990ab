"""Where a prompt-cache breakpoint falls in the served prompt's tokens.

A breakpoint covers the first `count` chat messages. The template renders those messages
alone (no generation prompt); the text they share with the full rendering is the part
of the prompt the breakpoint covers, and the tokens that text shares with the served
prompt's ids are what may be pinned. Taking common prefixes twice keeps the offset
honest when a template renders a conversation's last message differently, or when
tokenization merges across the cut: a pin never covers a token the served prompt does
not have at that place. The served prompt itself is never changed by this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def breakpoint_offsets(
    breakpoints: Sequence[tuple[int, int]],
    render_first: Callable[[int], str],
    text: str,
    ids: Sequence[int],
    encode: Callable[[str], list[int]],
) -> tuple[tuple[int, int], ...]:
    """`(end_token, ttl_seconds)` per `(count, ttl_seconds)` breakpoint; a breakpoint whose
    messages do not render on their own (the template rejects them) pins nothing."""
    out: dict[int, tuple[int, int]] = {}
    for count, ttl in breakpoints:
        try:
            head = render_first(count)
        except ValueError:  # PromptError: the template rejects the shorter conversation
            continue
        shared = _common_prefix(head, text)
        end = _common_prefix(encode(text[:shared]), ids) if shared else 0
        if end > 0:
            previous = out.get(end)
            out[end] = (end, max(ttl, previous[1] if previous else 0))
    return tuple(sorted(out.values()))


def _common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
