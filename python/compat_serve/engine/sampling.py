"""Per-request token sampling on MLX arrays.

Each request owns its sampler (and, when seeded, its own PRNG key), so requests with
different settings can share a batch later without sharing randomness.
"""

from __future__ import annotations

import os

import mlx.core as mx

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
    threshold = mx.take_along_axis(ordered, n_dropped, axis=-1)
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


class RequestSampler:
    """Samples the next token id from `[1, vocab]` logits for one request."""

    def __init__(self, params: SamplingParams) -> None:
        self._params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self._key = mx.random.key(seed)

    @property
    def greedy(self) -> bool:
        return self._params.greedy

    def __call__(self, logits: mx.array) -> mx.array:
        p = self._params
        if p.greedy:
            return mx.argmax(logits, axis=-1)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        logprobs = _mask_top_k(logprobs, p.top_k)
        logprobs = _mask_top_p(logprobs, p.top_p)
        self._key, step_key = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / p.effective_temperature), key=step_key)


def sample_rows(logits: mx.array, samplers: list[RequestSampler]) -> mx.array:
    """Sample one token per row of `[rows, vocab]` logits, each row with its own sampler."""
    if all(s.greedy for s in samplers):
        return mx.argmax(logits, axis=-1)
    return mx.concatenate([s(logits[i : i + 1]) for i, s in enumerate(samplers)])
