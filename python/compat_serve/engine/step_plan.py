"""The step plan: everything a step does to the model's KV, as plain data.

The deciding side (`StepExecutor`: scheduler, admission, preemption, prefix cache,
sampling) turns each engine step into an ordered list of ops; the applying side
(`StepApplier`) runs them on the model and the KV caches. A `StepPlan` is the ops of one
step (or of an abort between steps), in the order they were applied; it holds only ints,
strings, bools and tuples of them, and travels as compact JSON (`to_bytes`). Applying
the same plans in the same order to a fresh applier with the same weights gives the same
KV, bit for bit: that is what lets ranks that only apply (issue #28) follow the one that
decides.

Op order matters and is the order of application: ops decided after sampling (a
speculative step's rollback, the rows that leave or join the batch) come after the
forward whose logits decided them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, ClassVar


class PlanError(ValueError):
    """A plan that cannot be decoded or applied here (a follower out of step, or an op
    this applier cannot run on its own)."""


@dataclass(frozen=True)
class NewCache:
    """A fresh batch-1 cache for a request starting its prefill (replaces any old one).
    `adapter`: the LoRA adapter every forward of the request runs with (None: none)."""

    kind: ClassVar[str] = "new"
    request_id: str
    adapter: str | None = None


@dataclass(frozen=True)
class Restore:
    """The prefix cache filled the request's fresh cache with its first `tokens` prompt
    tokens: RAM blocks `block_ids` then the `tail_tokens` positions its `Hold` took (a
    tail, a child block, or whole blocks read from disk). A follower applies it from its
    own shard of those blocks (engine/prefix/shard.py)."""

    kind: ClassVar[str] = "restore"
    request_id: str
    tokens: int
    block_ids: tuple[int, ...]
    tail_tokens: int


@dataclass(frozen=True)
class Prefill:
    """Tokens `[start, start + len(tokens))` of a request through the model on its own
    cache; `logits`: the last position's logits are wanted (the chunk ends the prompt).
    `vision`: the request has images (their embeddings are not in the plan)."""

    kind: ClassVar[str] = "prefill"
    request_id: str
    start: int
    tokens: tuple[int, ...]
    logits: bool
    vision: bool = False


@dataclass(frozen=True)
class PrefillTogether:
    """Whole remaining prompts of several requests in batched forwards; each request's
    cache is replaced by its row of the result. Yields logits `[rows, vocab]`."""

    kind: ClassVar[str] = "together"
    request_ids: tuple[str, ...]
    token_lists: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Decode:
    """One token per row of the decode batch (`request_ids`: the batch's rows in order).
    Yields logits `[rows, vocab]`."""

    kind: ClassVar[str] = "decode"
    request_ids: tuple[str, ...]
    tokens: tuple[int, ...]
    rope_deltas: tuple[int, ...] = ()


@dataclass(frozen=True)
class Verify:
    """Speculative verification: each row's last token and its draft in one forward.
    Yields logits `[rows, longest, vocab]`."""

    kind: ClassVar[str] = "verify"
    request_ids: tuple[str, ...]
    rows: tuple[tuple[int, ...], ...]
    rope_deltas: tuple[int, ...] = ()


@dataclass(frozen=True)
class Rollback:
    """Drop the last `positions[i]` positions of batch row `i` (rejected drafts)."""

    kind: ClassVar[str] = "rollback"
    positions: tuple[int, ...]


@dataclass(frozen=True)
class Join:
    """These requests' own caches join the decode batch as new rows, in this order."""

    kind: ClassVar[str] = "join"
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Drop:
    """Free the KV of these requests (own caches and batch rows): finished, aborted,
    failed or preempted."""

    kind: ClassVar[str] = "drop"
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class ClearBatch:
    """Drop the whole decode batch (a batched forward failed)."""

    kind: ClassVar[str] = "clear"


# ---- the prefix cache's K/V (rank 0 keeps the index; these keep every rank's shard) ----
# A source of K/V pieces: ("block", id) a RAM block, ("tail", id) a stored tail, or one
# an earlier `Stage` of the same admission looked up (("disk", key): a disk entry).
Source = tuple[str, str]


@dataclass(frozen=True)
class StoreBlock:
    """Copy positions `[start, end)` of the request's K/V (its own cache, else its row
    of the decode batch) into prefix block `block_id`."""

    kind: ClassVar[str] = "block"
    block_id: int
    request_id: str
    start: int
    end: int


@dataclass(frozen=True)
class PutBlock:
    """Keep `source`'s K/V as prefix block `block_id` (a whole block promoted from disk,
    or a RAM block found again under another id)."""

    kind: ClassVar[str] = "put"
    block_id: int
    source: Source


@dataclass(frozen=True)
class DropBlocks:
    """Prefix blocks evicted (their ids may be reused by later ops)."""

    kind: ClassVar[str] = "dropblocks"
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class StoreTail:
    """Copy positions `[start, end)` of the request's K/V as tail `tail_id`."""

    kind: ClassVar[str] = "tail"
    tail_id: int
    request_id: str
    start: int
    end: int


@dataclass(frozen=True)
class DropTails:
    """Tails superseded or evicted."""

    kind: ClassVar[str] = "droptails"
    tail_ids: tuple[int, ...]


@dataclass(frozen=True)
class Hold:
    """At admission, the request takes K/V pieces past its RAM blocks: the first `n`
    positions of each `(kind, key, n)` source, joined in order; a later `Restore` puts
    them after the blocks. Resolved now: a source may be dropped before the restore."""

    kind: ClassVar[str] = "hold"
    request_id: str
    pieces: tuple[tuple[str, str, int], ...]


@dataclass(frozen=True)
class Unhold:
    """The request's held pieces are no longer needed (it ended or was preempted before
    its restore)."""

    kind: ClassVar[str] = "unhold"
    request_id: str


@dataclass(frozen=True)
class Stage:
    """Look these sources up now and keep them until the admission's `Hold` (a later op
    of the admission may drop them first). A ("disk", key) source is read from this
    rank's own files; with one in the list every rank then votes whether it found them
    all, and rank 0 uses them only if every rank did."""

    kind: ClassVar[str] = "stage"
    sources: tuple[Source, ...]


@dataclass(frozen=True)
class DiskPut:
    """Queue `source`'s K/V for this rank's disk tier under `key` (parent id `parent`).
    `source` as above, or ("range", request_id, start, end): positions of a request."""

    kind: ClassVar[str] = "diskput"
    key: str
    parent: str
    source: tuple[str | int, ...]


PrefixOp = (
    StoreBlock | PutBlock | DropBlocks | StoreTail | DropTails | Hold | Unhold | Stage | DiskPut
)
PREFIX_OPS: tuple[type[PrefixOp], ...] = (
    StoreBlock,
    PutBlock,
    DropBlocks,
    StoreTail,
    DropTails,
    Hold,
    Unhold,
    Stage,
    DiskPut,
)
PlanOp = (
    NewCache | Restore | Prefill | PrefillTogether | Decode | Verify | Rollback | Join | Drop
) | (ClearBatch | PrefixOp)
_OP_TYPES: tuple[type[PlanOp], ...] = (
    NewCache,
    Restore,
    Prefill,
    PrefillTogether,
    Decode,
    Verify,
    Rollback,
    Join,
    Drop,
    ClearBatch,
    *PREFIX_OPS,
)
_OPS: dict[str, type[PlanOp]] = {op.kind: op for op in _OP_TYPES}


@dataclass(frozen=True)
class StepPlan:
    """The ops of one step, in order; `step` counts plans from 0 (a follower checks it
    sees every one)."""

    step: int
    ops: tuple[PlanOp, ...]

    def to_bytes(self) -> bytes:
        """Compact JSON: `[step, [[kind, field, ...], ...]]`."""
        ops = [[op.kind, *(getattr(op, f.name) for f in fields(op))] for op in self.ops]
        return json.dumps([self.step, ops], separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> StepPlan:
        try:
            step, raw_ops = json.loads(data)
            ops = tuple(_OPS[kind](*map(_tuples, fields)) for kind, *fields in raw_ops)
        except (ValueError, TypeError, KeyError) as exc:
            raise PlanError(f"not a step plan: {exc}") from exc
        if not isinstance(step, int):
            raise PlanError("not a step plan: the step number is not an integer")
        return cls(step, ops)


def _tuples(value: Any) -> Any:
    """JSON arrays back to the tuples the ops hold."""
    if isinstance(value, list):
        return tuple(_tuples(item) for item in value)
    return value
