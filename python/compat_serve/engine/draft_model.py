"""Draft-model speculation (`--speculative draft --draft-model DIR`): a small model with
the target's tokenizer drafts the next tokens of every decoding row.

The draft model keeps its own batched cache (a `DecodeBatch` keyed by request id, rows
in its own order). Each row's draft cache holds a prefix of the row's prompt plus output
(`fed` tokens). A proposal first feeds every row what its draft cache lacks (the token
the target feeds next, plus the drafts the target accepted last step that the draft
cache never saw), right-padded to the longest, then one position per drafted token for
all rows together. `settle` keeps the positions of the drafts the target accepted and
rolls back the rest (`DecodeBatch.rollback`, the same as the target's cache), so the two
caches never disagree about a token.

Greedy rows draft the draft model's argmax; sampled rows draw from its distribution
(the request's temperature, top-k and top-p applied) and return it, for the speculative
sampling rule (`sampling.accept_draft`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from compat_serve.engine.batch import DecodeBatch, can_rollback
from compat_serve.engine.runner import ModelRunner
from compat_serve.engine.sampling import RequestSampler
from compat_serve.engine.speculation import SpeculationConfig

if TYPE_CHECKING:
    from compat_serve.models.tokenizer import Tokenizer
    from compat_serve.models.types import LoadedModel

log = logging.getLogger("compat_serve.engine")


class DraftModelError(ValueError):
    """The draft model cannot draft for this target (vocabulary, cache type)."""


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer) -> None:
    """Raise `DraftModelError` unless both tokenizers map the same strings to the same ids
    (a draft token id must mean the same token to the target)."""
    mine, theirs = target.get_vocab(), draft.get_vocab()
    if mine == theirs:
        return
    differing = sorted(
        {t for t in mine.keys() | theirs.keys() if mine.get(t) != theirs.get(t)},
        key=lambda t: min(mine.get(t, 1 << 62), theirs.get(t, 1 << 62)),
    )
    example = differing[0]
    raise DraftModelError(
        f"the draft model's tokenizer differs from the target's: {len(differing)} of "
        f"{len(mine)} tokens differ (e.g. {example!r}: id {mine.get(example)} in the target, "
        f"{theirs.get(example)} in the draft); --draft-model needs the same vocabulary"
    )


def with_draft_model(config: SpeculationConfig, target: LoadedModel) -> SpeculationConfig:
    """`config` with its draft model loaded (from `--draft-model`) and checked against the
    target's vocabulary; unchanged unless the mode is `draft`."""
    if config.mode != "draft":
        return config
    draft = config.draft
    if draft is None:
        from compat_serve.models.loader import load_model

        draft = load_model(config.draft_model)
    check_same_vocabulary(target.tokenizer, draft.tokenizer)
    return dataclasses.replace(config, draft=draft)


@dataclass
class Proposal:
    """Per row (in the order asked): the drafted tokens, and for sampled rows the draft
    distribution at each drafted position (`[len(draft), vocab]`; None for greedy rows)."""

    drafts: list[list[int]]
    probs: list[np.ndarray | None]


class DraftModel:
    """Drafts for every decoding row with a small model, on its own batched cache."""

    def __init__(self, loaded: LoadedModel, prefill_chunk: int = 512) -> None:
        self._runner = ModelRunner(loaded)
        if not can_rollback(self._runner.new_cache()):
            raise DraftModelError(
                "the draft model's cache (rotating or recurrent layers) cannot roll back "
                "rejected tokens"
            )
        self._prefill_chunk = prefill_chunk
        self._batch = DecodeBatch()
        self._fed: dict[str, int] = {}
        self._tail = 0  # positions fed past `fed` by the last proposal, not yet settled

    def propose(
        self,
        keys: Sequence[str],
        tokens: Sequence[Sequence[int]],
        lengths: Sequence[int],
        samplers: Sequence[RequestSampler | None],
        vocab: int,
    ) -> Proposal:
        """Up to `lengths[i]` tokens to follow `tokens[i]` (row `keys[i]`'s prompt plus
        output); `samplers[i]` None drafts greedily. `vocab`: the target's logits width."""
        self.settle({})
        self._sync(keys, tokens)
        rows = len(keys)
        longest = max(lengths, default=0)
        if longest == 0:
            return Proposal([[] for _ in keys], [None] * rows)
        where = {key: i for i, key in enumerate(keys)}
        order = [where[key] for key in self._batch.ids]
        pending = [list(tokens[i][self._fed[keys[i]] :]) for i in order]
        width = max(len(p) for p in pending)
        if width == 1:
            last = self._runner.decode_logits(self._batch.cache, [p[0] for p in pending])
        else:
            logits = self._runner.verify_logits(self._batch.cache, pending)
            ends = mx.array([len(p) - 1 for p in pending])
            last = mx.take_along_axis(logits, ends[:, None, None], axis=1)[:, 0, :]
            mx.eval(last)
            self._batch.rollback([width - len(p) for p in pending])
        for i in order:
            self._fed[keys[i]] = len(tokens[i])
        drafts: list[list[int]] = [[] for _ in keys]
        probs: list[list[np.ndarray]] = [[] for _ in keys]
        ordered_samplers = [samplers[i] for i in order]
        for step in range(longest):
            chosen = self.pick(last, ordered_samplers, vocab)
            for (token, q), i in zip(chosen, order, strict=True):
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
            if step == longest - 1:
                break
            last = self._runner.decode_logits(self._batch.cache, [t for t, _ in chosen])
            self._tail += 1
        return Proposal(
            [d[:n] for d, n in zip(drafts, lengths, strict=True)],
            [np.stack(p[:n]) if p and n else None for p, n in zip(probs, lengths, strict=True)],
        )

    def settle(self, accepted: dict[str, int]) -> None:
        """The target accepted `accepted[key]` drafts of row `key` (others: none): keep
        their positions in the draft cache, roll back the other drafted ones."""
        if not self._tail:
            return
        keep = [min(accepted.get(key, 0), self._tail) for key in self._batch.ids]
        self._batch.rollback([self._tail - n for n in keep])
        for key, n in zip(self._batch.ids, keep, strict=True):
            self._fed[key] += n
        self._tail = 0

    def _sync(self, keys: Sequence[str], tokens: Sequence[Sequence[int]]) -> None:
        """Rows of the draft batch = the rows asked about: ended rows leave, new ones are
        prefilled with all but their last token (the target's cache holds as much)."""
        gone = self._batch.retain(keys)
        for key in gone:
            self._fed.pop(key, None)
        joining = []
        for key, row in zip(keys, tokens, strict=True):
            if key in self._batch:
                continue
            cache = self._runner.new_cache()
            known = list(row[:-1])
            for start in range(0, len(known), self._prefill_chunk):
                self._runner.prefill(cache, known[start : start + self._prefill_chunk])
            joining.append((key, cache))
            self._fed[key] = len(known)
        self._batch.add(joining)

    @staticmethod
    def pick(
        logits: mx.array, samplers: Sequence[RequestSampler | None], vocab: int
    ) -> list[tuple[int, np.ndarray | None]]:
        """Each row's drafted token from the draft model's `[rows, width]` logits: its
        argmax, or for a sampled row a draw from its distribution (cut to the target's
        `vocab` ids and renormalised: what is drawn from is what is returned)."""
        greedy: list[int] = mx.argmax(logits, axis=-1).tolist()  # type: ignore[assignment]
        out: list[tuple[int, np.ndarray | None]] = []
        for i, sampler in enumerate(samplers):
            if sampler is None:
                out.append((greedy[i], None))
                continue
            q = np.array(sampler.probs(logits[i : i + 1])[0], dtype=np.float64)
            q = np.pad(q[:vocab], (0, max(0, vocab - q.shape[0])))
            q /= q.sum()
            cumulative = np.cumsum(q)
            token = int(np.searchsorted(cumulative, sampler.rng.random(), side="right"))
            out.append((min(token, vocab - 1), q.astype(np.float32)))
        return out
