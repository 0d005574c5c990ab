"""A speculative rollback on a batch: rows verify drafts of different lengths, then drop
the rejected ones; beside it, a batch that only ever saw the accepted tokens (shared by
test_speculative and test_families). The verify and the rollback go through the
applier, as in the engine: sliding-window and recurrent layers roll back there."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from compat_serve.engine.applier import StepApplier
from compat_serve.engine.batch import DecodeBatch

if TYPE_CHECKING:
    from compat_serve.engine.runner import ModelRunner

FED = [[11, 12, 13, 14], [21, 22], [31, 32, 33]]  # per row: its last token + drafts
# Positions each row keeps: row 0 rejects two drafts, row 1 one, row 2 none (its one
# padding position is dropped).
KEPT = [2, 1, 3]
NEXT = [5, 6, 7]  # the token each row decodes after the rollback


def _prefilled(runner: ModelRunner, prefixes: list[list[int]]) -> StepApplier:
    applier = StepApplier(runner)
    ids = [f"r{i}" for i in range(len(prefixes))]
    for request_id, prefix in zip(ids, prefixes, strict=True):
        applier.new_cache(request_id)
        applier.prefill(request_id, 0, prefix)
    applier.join(ids)
    return applier


def rolled_back_and_exact(
    runner: ModelRunner, prompts: list[list[int]]
) -> tuple[DecodeBatch, mx.array, mx.array]:
    """Three `prompts` prefilled, FED verified (rows padded to the longest) and rolled
    back to KEPT: that batch, its logits for NEXT, and the logits for NEXT of a batch
    prefilled with each prompt plus only its kept tokens."""
    rolled = _prefilled(runner, prompts)
    ids = rolled.batch.ids
    rolled.verify(ids, FED)
    longest = max(len(f) for f in FED)
    rolled.rollback([longest - k for k in KEPT])
    exact = _prefilled(runner, [p + f[:k] for p, f, k in zip(prompts, FED, KEPT, strict=True)])
    return rolled.batch, rolled.decode(ids, NEXT), exact.decode(ids, NEXT)
