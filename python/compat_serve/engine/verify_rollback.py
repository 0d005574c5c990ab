"""Rolling a decode batch back after a speculative verify pass, on every cache kind.

A verify pass feeds each row its last token and its draft (right-padded to the longest
row); the row then keeps only the positions it accepted. How a layer gives back the rest:

- plain attention (`BatchKVCache`, quantized or not): trimmed (`DecodeBatch.rollback`);
- sliding window (`BatchRotatingKVCache`, quantized or not): a pass of more than one
  position goes through the cache's concatenating update, which keeps the window's last
  `max_size - 1` positions before the pass and every position of it, in order. Rolling a
  row right by its rejected count turns them into left padding, exactly what mlx-lm's
  `finalize` does with a right-padded prompt (`roll_window_rows`); the window's older
  positions are all still there, so nothing needs restoring;
- recurrent state (`ArraysCache`: SSM, linear attention, short convolutions): the state
  after the last position cannot be un-applied. Before the pass its arrays are kept (by
  reference: the model assigns new arrays to the cache, it never writes into them) and,
  on models that can (`PADDING_MASKED`), the pass masks each row's right padding
  (`lengths`, as mlx-lm's batched prefill does), so a row that accepted its whole draft
  ends exact. A row that rejected drafts gets the kept state back and its accepted
  tokens fed again, in a forward over those rows only (`VerifyPass.refeed`): the
  attention K/V of their kept positions are already exact, the extra forward only
  rebuilds their recurrent state.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchRotatingKVCache, RotatingKVCache

from compat_serve.engine.kv_quant import is_attention_layer, is_batch_attention_layer

LayerCaches = list[Any]
# A forward over some rows of the batch: (their cache, their row indices, their tokens).
Refeed = Callable[[LayerCaches, list[int], list[list[int]]], None]


def verify_can_roll_back(cache: LayerCaches) -> bool:
    """Whether a verify pass over a request's cache can be rolled back exactly: every
    layer is plain attention, a sliding window or recurrent state (the kinds above)."""
    return all(
        is_attention_layer(layer)
        or (isinstance(layer, RotatingKVCache | ArraysCache) and not getattr(layer, "keep", 0))
        for layer in cache
    )


def is_recurrent(layer: Any) -> bool:
    return isinstance(layer, ArraysCache)


def is_window(layer: Any) -> bool:
    return isinstance(layer, BatchRotatingKVCache)


# Model types whose recurrent layers honour `ArraysCache.lengths` (right padding masked
# out of the state, as mlx-lm's batched prefill needs): checked by the rollback tests.
# Elsewhere (e.g. Nemotron-H, whose SSM update ignores it) padding is never fed into
# recurrent state: rows are re-fed in groups of one length.
PADDING_MASKED = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2"})


@dataclass
class VerifyPass:
    """What a verify pass's rollback needs: the rows fed, for recurrent layers (by layer
    index) their state before the pass, and whether the model masks right padding out of
    recurrent state (`PADDING_MASKED`)."""

    rows: list[list[int]]
    recurrent: dict[int, list[Any]]
    masks_padding: bool

    @classmethod
    def before(
        cls, cache: LayerCaches, rows: Sequence[Sequence[int]], masks_padding: bool
    ) -> VerifyPass:
        """Called just before the verify forward: keeps the recurrent state (and masks
        each row's right padding out of it where the model can); puts windows in order."""
        fed = [list(row) for row in rows]
        recurrent: dict[int, list[Any]] = {}
        lengths = [len(row) for row in fed]
        for i, layer in enumerate(cache):
            if is_window(layer):
                # In order before the pass, as its update would put it: mlx-lm's mask for
                # a pass of several positions reads the write index as the buffer's length
                # (so a rotated window masked a padded row's oldest position).
                layer._temporal_order()
            if is_recurrent(layer):
                recurrent[i] = list(layer.cache)
                if masks_padding and min(lengths) != max(lengths):
                    layer.lengths = mx.array(lengths)  # one array per layer: `advance` -= it
        return cls(fed, recurrent, masks_padding)

    def after_forward(self, cache: LayerCaches) -> None:
        """The forward is built: recurrent layers drop the padding mask again."""
        for i in self.recurrent:
            cache[i].lengths = None

    def refeed(self, cache: LayerCaches, rejected: Sequence[int], forward: Refeed) -> None:
        """Rows whose recurrent state saw positions they do not keep (rejected drafts;
        padding, where the model does not mask it) get that state back and their kept
        tokens fed again, in a forward over those rows only (one per kept length where
        padding is not masked), before the batch's own rollback. Nothing runs when every
        row kept all it fed."""
        if not self.recurrent:
            return
        width = max(len(row) for row in self.rows)
        kept = [width - n for n in rejected]
        fed = [len(row) if self.masks_padding else width for row in self.rows]
        redo = [i for i, (k, n) in enumerate(zip(kept, fed, strict=True)) if k < n]
        groups = (
            [redo]
            if self.masks_padding
            else [
                [i for i in redo if kept[i] == length] for length in sorted({kept[i] for i in redo})
            ]
        )
        for group in groups:
            if group:
                self._refeed_rows(cache, group, [kept[i] for i in group], width, forward)

    def _refeed_rows(
        self, cache: LayerCaches, rows: list[int], kept: list[int], width: int, forward: Refeed
    ) -> None:
        sub = [
            _rows_before_pass(layer, self.recurrent.get(i), rows, width)
            for i, layer in enumerate(cache)
        ]
        if min(kept) != max(kept):
            for i in self.recurrent:
                sub[i].lengths = mx.array(kept)
        longest = max(kept)
        forward(
            sub,
            rows,
            [self.rows[r][:k] + [0] * (longest - k) for r, k in zip(rows, kept, strict=True)],
        )
        mx.eval([a for i in self.recurrent for a in sub[i].cache if a is not None])
        index = mx.array([rows.index(r) if r in rows else 0 for r in range(len(self.rows))])
        chosen = mx.array([r in rows for r in range(len(self.rows))])
        for i in self.recurrent:
            layer = cache[i]
            layer.cache = [
                _pick_rows(chosen, index, new, old)
                for new, old in zip(sub[i].cache, layer.cache, strict=True)
            ]


def _rows_before_pass(layer: Any, state: list[Any] | None, rows: list[int], width: int) -> Any:
    """A batch layer for `rows` only, as it was before the verify pass of `width`
    positions (`state`: a recurrent layer's arrays then). A copy: the batch's own layer
    is not changed (`filter` and the rollbacks rebind its arrays, never write them)."""
    sub = copy.copy(layer)
    if state is not None:
        taken = mx.array(rows)
        sub.cache = [None if a is None else a[taken] for a in state]
        sub.left_padding = sub.lengths = None
        return sub
    sub.filter(rows)
    if is_window(sub):
        roll_window_rows(sub, [width] * len(rows))
    elif is_batch_attention_layer(sub):
        sub.trim(width)
    else:
        raise TypeError(f"{type(layer).__name__} cannot be rolled back")
    return sub


def _pick_rows(chosen: mx.array, index: mx.array, new: Any, old: Any) -> Any:
    """`old` with the rows marked in `chosen` replaced by `new[index[row]]`."""
    if new is None or old is None:
        return old if new is None else new
    shape = (chosen.shape[0],) + (1,) * (old.ndim - 1)
    return mx.where(chosen.reshape(shape), new[index].astype(old.dtype), old)


def roll_window_rows(layer: Any, rejected: Sequence[int]) -> None:
    """Drop the last `rejected[i]` positions of row `i` of a sliding-window batch just
    after a pass of more than one position (its concatenating update: the buffer is in
    order, the pass's positions at its end): each row is rolled right by its count and
    the rolled positions become left padding (mlx-lm's `finalize`)."""
    if not any(rejected):
        return
    layer._lengths = layer.offset - mx.array(list(rejected))
    layer.finalize()
