"""Per-token log probabilities for the requests that ask for them.

A row's sampler hands the logits it sampled from (after the grammar mask, before
temperature/top-k/top-p: the model's own distribution, as OpenAI and vLLM report it) to
its `LogprobRecorder`; when the executor accepts the token, `take` turns the logits at
that position into the token's log probability and the `top` most likely alternatives.
With speculative decoding the verifier records every verified position, so accepted draft
tokens get the target model's log probabilities too.

Rows that did not ask have no recorder: they pay nothing. Plain `mx` ops, any backend.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from compat_serve.engine.constraints import FORBIDDEN
from compat_serve.engine.types import MAX_TOP_LOGPROBS, TokenLogprob


class LogprobRecorder:
    def __init__(self, top: int) -> None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top logprobs must be within 0..{MAX_TOP_LOGPROBS}, not {top}")
        self.top = top
        self._pending: mx.array | None = None  # [positions, vocab] log-softmax
        self._next = 0

    def record(self, logits: mx.array) -> None:
        """The logits of the positions whose tokens are accepted next, in order.

        `[vocab]` or `[positions, vocab]`; replaces whatever an earlier step left unread."""
        rows = logits.reshape(-1, logits.shape[-1]).astype(mx.float32)
        self._pending = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        self._next = 0

    def take(self, token: int) -> TokenLogprob | None:
        """The accepted `token`'s log probability at the next recorded position."""
        pending = self._pending
        if pending is None or self._next >= pending.shape[0]:
            return None
        row = pending[self._next]
        self._next += 1
        chosen = row[token]
        if self.top == 0:
            return TokenLogprob(token, float(np.array(chosen)))
        ids = mx.argpartition(-row, kth=self.top - 1)[: self.top]
        values = row[ids]
        mx.eval(chosen, ids, values)
        ids_np = np.array(ids)
        values_np = np.array(values)
        order = np.argsort(-values_np, kind="stable")
        top = tuple(
            (int(ids_np[i]), float(values_np[i]))
            for i in order
            # Never offer a token the grammar forbids (masked to -FORBIDDEN).
            if np.isfinite(values_np[i]) and values_np[i] > -FORBIDDEN / 2
        )
        return TokenLogprob(token, float(np.array(chosen)), top)
