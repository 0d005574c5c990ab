"""Per-request token sampling on MLX arrays.

Each request owns its sampler (and, when seeded, its own PRNG key), so requests with
different settings can share a batch later without sharing randomness.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from compat_serve.engine.logprobs import LogprobRecorder
from compat_serve.engine.types import SamplingParams


def _mask_top_k(logprobs: mx.array, top_k: int) -> mx.array:
    vocab = logprobs.shape[-1]
    if top_k <= 0 or top_k >= vocab:
        return logprobs
    drop = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logprobs, drop, mx.array(-float("inf"), logprobs.dtype), axis=-1)


def _mask_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    if not 0.0 < top_p < 1.0:
        return logprobs
    ordered = mx.sort(logprobs, axis=-1)
    probs = mx.exp(ordered.astype(mx.float32))
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + probs[..., :1]
    n_dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    # The most likely token always stays: a top_p that rounds to 0 in float32 (5e-324)
    # would drop every token and gather past the end (a grammar-masked token came out).
    n_dropped = mx.minimum(n_dropped, logprobs.shape[-1] - 1)
    threshold = mx.take_along_axis(ordered, n_dropped, axis=-1)
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


class RequestSampler:
    """Samples the next token id from `[1, vocab]` logits for one request."""

    def __init__(self, params: SamplingParams) -> None:
        self._params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self._key = mx.random.key(seed)
        # Host-side draws for speculative acceptance (`accept_draft`).
        self.rng = np.random.default_rng(seed)
        # Only for requests that asked: the logits each accepted token was drawn from.
        self.logprobs = None if params.logprobs is None else LogprobRecorder(params.logprobs)

    @property
    def greedy(self) -> bool:
        return self._params.greedy

    def __call__(self, logits: mx.array) -> mx.array:
        p = self._params
        if self.logprobs is not None:
            self.logprobs.record(logits)
        if p.greedy:
            return mx.argmax(logits, axis=-1)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        logprobs = _mask_top_k(logprobs, p.effective_top_k)
        logprobs = _mask_top_p(logprobs, p.effective_top_p)
        self._key, step_key = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / p.effective_temperature), key=step_key)

    def probs(self, logits: mx.array) -> mx.array:
        """The distribution `__call__` samples from, for each row of `[n, vocab]` logits
        (temperature, top-k and top-p applied). Not for greedy requests."""
        p = self._params
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        logprobs = _mask_top_k(logprobs, p.effective_top_k)
        logprobs = _mask_top_p(logprobs, p.effective_top_p)
        return mx.softmax(logprobs * (1.0 / p.effective_temperature), axis=-1)


def accept_draft(
    target: np.ndarray,
    draft: Sequence[int],
    rng: np.random.Generator,
    draft_probs: np.ndarray | None = None,
) -> list[int]:
    """The speculative sampling rule (Leviathan et al. 2023; Chen et al. 2023): the tokens
    to emit for one row, given the target model's distributions `target` `[k + 1, vocab]`
    at each drafted position plus one, the `k` drafted tokens and the drafter's
    distributions `draft_probs` `[k, vocab]` (None: a deterministic drafter, a point mass
    on each drafted token). Draft token `j` is kept with probability
    `min(1, p(d) / q(d))`; the first one rejected is replaced by a sample from the
    normalised `max(0, p - q)`; if all are kept, one more is sampled from `p`. The
    emitted tokens are distributed exactly as sampling `p` token by token."""
    out: list[int] = []
    for j, token in enumerate(draft):
        p = target[j]
        q_token = 1.0 if draft_probs is None else float(draft_probs[j, token])
        if q_token > 0 and rng.random() * q_token < float(p[token]):
            out.append(token)
            continue
        if draft_probs is None:
            residual = p.astype(np.float64)
            residual[token] = 0.0
        else:
            residual = np.maximum(p.astype(np.float64) - draft_probs[j], 0.0)
        total = residual.sum()
        if total <= 0:  # p is the point mass q was: cannot happen once it was rejected
            residual, total = p.astype(np.float64), float(p.sum())
        out.append(_draw(residual / total, rng))
        return out
    out.append(_draw(target[len(draft)].astype(np.float64), rng))
    return out


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return min(index, len(probs) - 1)


def sample_rows(logits: mx.array, samplers: list[RequestSampler]) -> mx.array:
    """Sample one token per row of `[rows, vocab]` logits, each row with its own sampler."""
    if all(s.greedy for s in samplers):
        for i, s in enumerate(samplers):
            if s.logprobs is not None:
                s.logprobs.record(logits[i])
        return mx.argmax(logits, axis=-1)
    return mx.concatenate([s(logits[i : i + 1]) for i, s in enumerate(samplers)])
