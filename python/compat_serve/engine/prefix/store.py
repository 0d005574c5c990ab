"""The MLX side of the prefix cache: K/V tensors per cached block, state snapshots.

The Rust `PrefixCache` decides which blocks exist (chained hashes, refcounts, LRU
eviction); this store holds their tensors under the same block ids:

- **Attention layers** (`KVCache`): per block, a contiguous copy of its K and V slice,
  `[1, kv_heads, block_size, head_dim]`, or with quantized KV (`--kv-bits`,
  engine/kv_quant.py) the three arrays of each, in the stored format (never dequantized).
  A hit concatenates them back into a fresh cache.
- **State layers** (anything else: convolution / SSM / gated delta-net state, rotating
  windows) cannot be rebuilt from per-token pieces: their whole state is snapshotted at
  block boundaries the prefill reaches (chunk ends, and the last full block of each
  prompt), keyed by the block's chained hash. A hit on such a model is valid only up to
  a block with a snapshot.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map

from compat_serve.engine.kv_quant import (
    components,
    concat_positions,
    is_attention_layer,
    is_batch_attention_layer,
    nbytes,
    positions,
    slice_positions,
)

LayerCaches = list[Any]
# Per layer: (keys, values), each an array shaped [batch, kv_heads, positions, head_dim]
# or, quantized, a tuple of three such arrays (packed, scales, biases); None for state
# layers.
BlockKV = list[tuple[Any, Any] | None]
AttentionKV = list[tuple[Any, Any] | None]


def is_attention_cache(layer: Any) -> bool:
    return is_attention_layer(layer)


def request_kv(cache: LayerCaches) -> AttentionKV:
    """A request's own cache: position 0 is token 0."""
    return [(c.keys, c.values) if is_attention_cache(c) else None for c in cache]


def batch_row_kv(cache: LayerCaches, row: int) -> AttentionKV:
    """The decode batch's cache, shifted so that row `row`'s token 0 is position 0."""
    out: AttentionKV = []
    for layer in cache:
        if not is_batch_attention_layer(layer):
            out.append(None)
            continue
        batched: Any = layer
        padding: Any = batched.left_padding
        pad = padding[row].item()
        assert isinstance(pad, int)
        out.append(
            (
                tree_map(lambda a: a[..., pad:, :], batched.keys),  # noqa: B023
                tree_map(lambda a: a[..., pad:, :], batched.values),  # noqa: B023
            )
        )
    return out


def copy_positions(kv: AttentionKV, row: int, start: int, end: int) -> BlockKV:
    """Contiguous, evaluated copies of positions `[start, end)` of batch row `row`."""
    pieces: BlockKV = []
    arrays = []
    for layer in kv:
        if layer is None:
            pieces.append(None)
            continue
        keys = slice_positions(layer[0], row, start, end)
        values = slice_positions(layer[1], row, start, end)
        if positions(keys) != end - start:
            raise CacheFault(f"{positions(keys)} positions to copy, not {end - start}")
        pieces.append((keys, values))
        arrays += [*components(keys), *components(values)]
    mx.eval(arrays)
    return pieces


def kv_nbytes(pieces: BlockKV) -> int:
    return sum(nbytes(p[0]) + nbytes(p[1]) for p in pieces if p is not None)


def joined_pieces(pieces: list[tuple[BlockKV, int]]) -> tuple[BlockKV, int] | None:
    """K/V pieces (the first n positions of each) as one run, for `PrefixStore.assemble`."""
    if len(pieces) <= 1:
        return pieces[0] if pieces else None
    joined: BlockKV = []
    for layer in range(len(pieces[0][0])):
        parts = [(kv[layer], n) for kv, n in pieces]
        if any(part is None for part, _ in parts):
            joined.append(None)
            continue
        kept = [(p, n) for p, n in parts if p is not None]
        keys = concat_positions([tree_map(lambda a, n=n: a[:, :, :n], p[0]) for p, n in kept])
        values = concat_positions([tree_map(lambda a, n=n: a[:, :, :n], p[1]) for p, n in kept])
        joined.append((keys, values))
    return joined, sum(n for _, n in pieces)


class CacheFault(RuntimeError):
    """Cached tensors could not be assembled into a request's cache."""


class PrefixStore:
    """Tensors of cached blocks and state snapshots, with byte accounting."""

    def __init__(self, block_size: int, snapshot_budget_bytes: int) -> None:
        self.block_size = block_size
        self._blocks: dict[int, BlockKV] = {}
        self._block_bytes: dict[int, int] = {}
        self._snapshots: collections.OrderedDict[bytes, list[Any]] = collections.OrderedDict()
        self._snapshot_bytes: dict[bytes, int] = {}
        self._snapshot_total = 0
        self._snapshot_budget = snapshot_budget_bytes
        self.bytes_in_use = 0

    # ---- blocks ---------------------------------------------------------------------

    def has_block(self, block_id: int) -> bool:
        return block_id in self._blocks

    def drop_blocks(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            if self._blocks.pop(block_id, None) is not None:
                self.bytes_in_use -= self._block_bytes.pop(block_id)

    def store_block(self, block_id: int, kv: AttentionKV, start: int, row: int = 0) -> None:
        """Copy positions `[start, start + block_size)` of batch row `row` of `kv`."""
        self.put_block(block_id, copy_positions(kv, row, start, start + self.block_size))

    def block_kv(self, block_id: int) -> BlockKV:
        return self._blocks[block_id]

    def put_block(self, block_id: int, pieces: BlockKV) -> None:
        """Keep already-copied pieces (promoted from disk) under `block_id`."""
        self.drop_blocks([block_id])
        self._blocks[block_id] = pieces
        size = kv_nbytes(pieces)
        self._block_bytes[block_id] = size
        self.bytes_in_use += size

    def assemble(
        self, block_ids: Sequence[int], cache: LayerCaches, tail: tuple[BlockKV, int] | None = None
    ) -> None:
        """Fill a fresh cache with the K/V of `block_ids` (in order), then the first
        `tail[1]` positions of the tail pieces `tail[0]`, if given."""
        missing = [b for b in block_ids if b not in self._blocks]
        if missing:
            raise CacheFault(f"blocks {missing[:4]} have no tensors")
        tokens = len(block_ids) * self.block_size + (tail[1] if tail else 0)
        for i, layer in enumerate(cache):
            if not is_attention_cache(layer):
                continue
            parts = [self._blocks[b][i] for b in block_ids]
            if tail is not None:
                pieces, length = tail
                piece = pieces[i]
                parts.append(
                    None
                    if piece is None
                    else (
                        tree_map(lambda a: a[:, :, :length], piece[0]),  # noqa: B023
                        tree_map(lambda a: a[:, :, :length], piece[1]),  # noqa: B023
                    )
                )
            kept = [p for p in parts if p is not None]
            if len(kept) != len(parts):
                raise CacheFault(f"layer {i} is not attention in every block")
            if any(_quantized(p[0]) != _quantized_layer(layer) for p in kept):
                raise CacheFault(f"layer {i}: cached K/V of another format")
            layer.keys = concat_positions([p[0] for p in kept])
            layer.values = concat_positions([p[1] for p in kept])
            if positions(layer.keys) != tokens:
                raise CacheFault(f"layer {i} assembled {positions(layer.keys)} of {tokens}")
            layer.offset = tokens

    # ---- snapshots of state layers ----------------------------------------------------

    def has_snapshot(self, block_hash: bytes) -> bool:
        return block_hash in self._snapshots

    def store_snapshot(self, block_hash: bytes, cache: LayerCaches) -> None:
        self.put_snapshot(block_hash, cache_states(cache))

    def snapshot_states(self, block_hash: bytes) -> list[Any]:
        """Per layer: None (attention) or (cache class, state tree, meta state)."""
        return self._snapshots[block_hash]

    def put_snapshot(self, block_hash: bytes, states: list[Any]) -> None:
        """Keep already-copied states (read back from disk) under `block_hash`."""
        arrays = [a for saved in states if saved is not None for a in state_arrays(saved[1])]
        self.drop_snapshot(block_hash)
        self._snapshots[block_hash] = states
        size = sum(a.nbytes for a in arrays)
        self._snapshot_bytes[block_hash] = size
        self._snapshot_total += size
        self.bytes_in_use += size
        while self._snapshot_total > self._snapshot_budget and self._snapshots:
            oldest = next(iter(self._snapshots))
            self.drop_snapshot(oldest)

    def drop_snapshot(self, block_hash: bytes) -> None:
        if self._snapshots.pop(block_hash, None) is not None:
            size = self._snapshot_bytes.pop(block_hash)
            self._snapshot_total -= size
            self.bytes_in_use -= size

    def restore_snapshot(self, block_hash: bytes, cache: LayerCaches) -> None:
        states = self._snapshots.get(block_hash)
        if states is None:
            raise CacheFault("the state snapshot was evicted")
        self._snapshots.move_to_end(block_hash)
        restore_states(states, cache)

    def clear(self) -> None:
        self._blocks.clear()
        self._block_bytes.clear()
        self._snapshots.clear()
        self._snapshot_bytes.clear()
        self._snapshot_total = 0
        self.bytes_in_use = 0

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    @property
    def snapshot_bytes(self) -> int:
        return self._snapshot_total


def restore_states(states: list[Any], cache: LayerCaches) -> None:
    """Set each state layer of a fresh cache to a copy of its snapshot (may raise)."""
    if len(states) != len(cache):
        raise CacheFault(f"a snapshot of {len(states)} layers for {len(cache)}")
    for i, (layer, saved) in enumerate(zip(cache, states, strict=True)):
        if saved is None:
            continue
        kind, state, meta = saved
        if type(layer) is not kind:
            raise CacheFault(f"layer {i}: snapshot of {kind.__name__}")
        layer.state = copy_tree(state)
        if meta is not None:
            layer.meta_state = meta


def _quantized(stored: Any) -> bool:
    return isinstance(stored, tuple)


def _quantized_layer(layer: Any) -> bool:
    return hasattr(layer, "bits")


def copy_tree(value: Any) -> Any:
    """Fresh lists, tuples and array handles (MLX slice assignment rebinds a handle in
    place, so a snapshot must never share one with a live cache)."""
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, list):
        return [copy_tree(v) for v in value]
    if isinstance(value, tuple):
        return tuple(copy_tree(v) for v in value)
    return value


def state_arrays(value: Any) -> list[mx.array]:
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in state_arrays(v)]
    return []


def cache_states(cache: LayerCaches) -> list[Any]:
    """Evaluated copies of the state layers of a request's own (batch-1) cache; per layer
    None (attention) or (cache class, state tree, meta state)."""
    states: list[Any] = []
    arrays: list[mx.array] = []
    for layer in cache:
        if is_attention_cache(layer):
            states.append(None)
            continue
        state = copy_tree(layer.state)
        states.append((type(layer), state, getattr(layer, "meta_state", None)))
        arrays += state_arrays(state)
    mx.eval(arrays)
    return states
