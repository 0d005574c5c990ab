"""A speculative rollback on a batch: rows verify drafts of different lengths, then drop
the rejected ones; beside it, a batch that only ever saw the accepted tokens (shared by
test_speculative and test_families)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from compat_serve.engine.batch import DecodeBatch

if TYPE_CHECKING:
    from compat_serve.engine.runner import ModelRunner

FED = [[11, 12, 13, 14], [21, 22], [31, 32, 33]]  # per row: its last token + drafts
KEPT = [2, 1, 3]  # positions each row keeps
NEXT = [5, 6, 7]  # the token each row decodes after the rollback


def _prefilled(runner: ModelRunner, prefixes: list[list[int]]) -> DecodeBatch:
    batch = DecodeBatch()
    caches = []
    for p in prefixes:
        cache = runner.new_cache()
        runner.prefill(cache, p)
        caches.append(cache)
    batch.add([(f"r{i}", c) for i, c in enumerate(caches)])
    return batch


def rolled_back_and_exact(
    runner: ModelRunner, prompts: list[list[int]]
) -> tuple[DecodeBatch, mx.array, mx.array]:
    """Three `prompts` prefilled, FED verified (rows padded to the longest) and rolled
    back to KEPT: that batch, its logits for NEXT, and the logits for NEXT of a batch
    prefilled with each prompt plus only its kept tokens."""
    rolled = _prefilled(runner, prompts)
    runner.verify_logits(rolled.cache, FED)
    longest = max(len(f) for f in FED)
    rolled.rollback([longest - k for k in KEPT])
    exact = _prefilled(runner, [p + f[:k] for p, f, k in zip(prompts, FED, KEPT, strict=True)])
    return rolled, runner.decode_logits(rolled.cache, NEXT), runner.decode_logits(exact.cache, NEXT)
