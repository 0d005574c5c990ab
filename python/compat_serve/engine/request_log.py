"""What a request's life logs: a long prompt's prefill progress, and one line when it
ends (with its decode rate, which /v1/status shows too)."""

from __future__ import annotations

import logging
import time

from compat_serve.engine.sequence import Sequence
from compat_serve.engine.types import FinishReason

log = logging.getLogger("compat_serve.engine")


def log_progress(seq: Sequence, interval_s: float, decoding: int) -> None:
    """A prefilling request's progress, at most every `interval_s` (long prompts);
    `decoding`: how many requests decode meanwhile."""
    last = seq.timings.extra.get("progress_logged", seq.timings.submitted)
    now = time.monotonic()
    if now - last >= interval_s:
        seq.timings.extra["progress_logged"] = now
        started = seq.timings.extra.get("prefill_started", seq.timings.submitted)
        rate = seq.computed / max(now - started, 1e-9)
        log.info(
            "%s: prefill %d/%d tokens (%.0f tok/s, %d requests decoding)",
            seq.request_id,
            seq.computed,
            seq.prompt_len + len(seq.generated),
            rate,
            decoding,
        )


def decode_rate(seq: Sequence) -> float | None:
    """Tokens per second after the first one (None before a second token)."""
    t = seq.timings
    end = t.finished or time.monotonic()
    decode_s = (end - t.first_token) if t.first_token else 0.0
    if len(seq.generated) < 2 or decode_s <= 0:
        return None
    return round((len(seq.generated) - 1) / decode_s, 2)


def log_finished(seq: Sequence, reason: FinishReason) -> None:
    """The one line a request logs when it ends."""
    t = seq.timings
    end = t.finished or time.monotonic()
    ttft = (t.first_token - t.submitted) if t.first_token else None
    rate = decode_rate(seq) or 0.0
    log.info(
        "%s: %s — prompt %d tok, generated %d tok, ttft %s, decode %.1f tok/s, total %.2fs",
        seq.request_id,
        reason.value,
        seq.prompt_len,
        len(seq.generated),
        f"{ttft:.2f}s" if ttft is not None else "-",
        rate,
        end - t.submitted,
    )
