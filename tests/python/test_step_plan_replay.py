"""The step plan is the whole interface between deciding and applying (issue #28): a
real engine workload is recorded plan by plan, the plans go through bytes, and a fresh
applier with the same weights (a separately built copy of the model) replays them. After
every plan its KV must equal the engine's bit for bit, and the tokens its logits give
must be the tokens the engine streamed."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import pytest

from compat_serve.engine.applier import StepApplier, kv_arrays
from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.prefix.shard import ShardPrefix
from compat_serve.engine.prefix.store import PrefixStore
from compat_serve.engine.runner import ModelRunner
from compat_serve.engine.speculation import SpeculationConfig
from compat_serve.engine.step_plan import (
    ClearBatch,
    Decode,
    DiskPut,
    Drop,
    DropBlocks,
    DropTails,
    Hold,
    Join,
    NewCache,
    PlanError,
    Prefill,
    PrefillTogether,
    PutBlock,
    Restore,
    Rollback,
    Stage,
    StepPlan,
    StoreBlock,
    StoreTail,
    Unhold,
    Verify,
)
from compat_serve.engine.types import EngineRequest, FinishReason, SamplingParams
from tests.tiny_models import quantize_tiny, tiny_model

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

CHUNK = 64  # prompts below are longer than one chunk
BLOCK = 16  # EngineConfig's default block size
MAX_TOKENS = 10

Snapshot = dict[str, Any]


@dataclass
class Recording:
    plans: list[bytes] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, FinishReason | None] = field(default_factory=dict)
    blocks: dict[int, list[bytes]] = field(default_factory=dict)  # prefix blocks at the end
    # Run one after another instead of all at once (turns of a conversation).
    sequential: bool = False


def snapshot(applier: StepApplier, blocks: list[int]) -> Snapshot:
    """Every KV array the applier holds, copied out (own caches by request, the batch
    with its row order), and the ids of the prefix-cache blocks with K/V."""
    own = {rid: [np.array(a) for a in kv_arrays(c)] for rid, c in applier.own_caches.items()}
    batch = applier.batch
    rows = [np.array(a) for a in kv_arrays(batch.cache)] if len(batch) else []
    return {"own": own, "batch_ids": batch.ids, "batch": rows, "blocks": sorted(blocks)}


def block_bytes(store: PrefixStore) -> dict[int, list[bytes]]:
    """Each prefix block's K/V bytes, layer by layer."""
    blocks = store._blocks
    return {
        block_id: [np.array(a).tobytes() for layer in kv if layer is not None for a in layer]
        for block_id, kv in blocks.items()
    }


def assert_same_kv(follower: Snapshot, leader: Snapshot, step: int) -> None:
    assert follower["batch_ids"] == leader["batch_ids"], step
    assert follower["blocks"] == leader["blocks"], f"prefix blocks differ after plan {step}"
    assert follower["own"].keys() == leader["own"].keys(), step
    pairs = list(zip(follower["batch"], leader["batch"], strict=True))
    for rid, arrays in leader["own"].items():
        pairs += list(zip(follower["own"][rid], arrays, strict=True))
    for mine, theirs in pairs:
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, step
        assert mine.tobytes() == theirs.tobytes(), f"KV differs after plan {step}"


def record(
    loaded: LoadedModel,
    prompts: dict[str, list[int]],
    config: EngineConfig,
    abort_after: dict[str, tuple[str, int]] | None = None,
    max_tokens: int = MAX_TOKENS,
    sequential: bool = False,
) -> Recording:
    """Run `prompts` concurrently (greedy) and record every plan (as bytes) with the
    engine's KV after it. `abort_after[rid] = (kind, n)`: abort `rid` after the n-th plan
    with a `kind` op for it (decided on the engine thread, so the abort lands between the
    same two steps every run)."""
    engine = Engine(loaded, config)
    out = Recording()
    seen: dict[str, int] = {}
    prefix = engine._executor.prefix
    assert prefix is not None

    def on_plan(plan: StepPlan) -> None:
        out.plans.append(plan.to_bytes())
        out.snapshots.append(snapshot(engine._executor.applier, list(prefix.store._blocks)))
        for rid, (kind, n) in (abort_after or {}).items():
            if any(op.kind == kind and rid in _rows(op) for op in plan.ops):
                seen[rid] = seen.get(rid, 0) + 1
                if seen[rid] == n:
                    engine.abort(rid)

    engine._executor.on_plan = on_plan
    engine.start()
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, stop_at_eos=False)

    async def run_all() -> None:
        streams = [
            engine.submit(EngineRequest(rid, tuple(ids), sampling)) for rid, ids in prompts.items()
        ]

        async def drain(rid: str, stream: Any) -> None:
            events = [event async for event in stream]
            out.tokens[rid] = [t for event in events for t in event.token_ids]
            out.finish[rid] = events[-1].finish_reason

        await asyncio.gather(*(drain(rid, s) for rid, s in zip(prompts, streams, strict=True)))

    async def one_by_one() -> None:
        for rid, ids in prompts.items():
            events = [
                event async for event in engine.submit(EngineRequest(rid, tuple(ids), sampling))
            ]
            out.tokens[rid] = [t for event in events for t in event.token_ids]
            out.finish[rid] = events[-1].finish_reason

    try:
        asyncio.run(one_by_one() if sequential else run_all())
    finally:
        engine.shutdown()
    out.blocks = block_bytes(prefix.store)
    return out


def replay(loaded: LoadedModel, recording: Recording) -> dict[str, list[int]]:
    """Apply the recorded plans on a fresh applier over a separately built copy of the
    model, checking its KV after each; returns the greedy tokens its logits give.

    Its tokens are compared exactly, not up to a near tie (tests/greedy_ties.py): the
    replay runs the very same ops, shapes and weights in the same process as the engine,
    so it must reproduce the engine's bits; `assert_same_kv` checks the KV bit for bit."""
    twin = tiny_model("llama", loaded)  # same seed, same weights, nothing shared
    if loaded.dtype.startswith("quantized"):  # the users'-path lane's quantized tiny llama
        twin = quantize_tiny(twin)
    follower = StepApplier(ModelRunner(twin))
    prefix = ShardPrefix(BLOCK)
    tokens: dict[str, list[int]] = {}
    for step, (data, leader) in enumerate(zip(recording.plans, recording.snapshots, strict=True)):
        plan = StepPlan.from_bytes(data)
        logits = iter(follower.apply(plan, prefix))
        for op in plan.ops:
            if isinstance(op, Prefill) and op.logits:
                tokens.setdefault(op.request_id, []).append(_argmax(next(logits))[0])
            elif isinstance(op, Decode | PrefillTogether):
                for rid, token in zip(op.request_ids, _argmax(next(logits)), strict=True):
                    tokens.setdefault(rid, []).append(token)
            elif isinstance(op, Verify):
                targets: list[list[int]] = mx.argmax(next(logits), axis=-1).tolist()  # type: ignore[assignment]
                for rid, row, target in zip(op.request_ids, op.rows, targets, strict=True):
                    tokens.setdefault(rid, []).extend(_greedy(row[1:], target))
        assert next(logits, None) is None
        assert_same_kv(snapshot(follower, list(prefix.store._blocks)), leader, step)
    assert block_bytes(prefix.store) == recording.blocks, "prefix blocks' K/V differ"
    assert prefix.faults == 0
    return tokens


def _argmax(logits: mx.array) -> list[int]:
    values: list[int] = mx.argmax(logits.reshape(-1, logits.shape[-1]), axis=-1).tolist()  # type: ignore[assignment]
    return values


def _greedy(draft: tuple[int, ...], targets: list[int]) -> list[int]:
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return [*draft[:accepted], targets[accepted]]


def _rows(op: Any) -> tuple[str, ...]:
    if hasattr(op, "request_ids"):
        return tuple(op.request_ids)
    return (op.request_id,) if hasattr(op, "request_id") else ()


def random_prompts(loaded: LoadedModel, lengths: dict[str, int], seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    vocab = loaded.tokenizer.vocab_size
    return {rid: [rng.randrange(100, vocab) for _ in range(n)] for rid, n in lengths.items()}


@pytest.fixture(scope="module")
def plain_recording(tiny_llama_model: LoadedModel) -> Recording:
    """Four concurrent requests longer than a chunk, two short ones, one aborted
    mid-prefill and one mid-decode; prefix cache on (distinct prompts: no hits)."""
    lengths = {"a": 150, "b": 170, "c": 130, "d": 200, "s1": 20, "s2": 24}
    prompts = random_prompts(tiny_llama_model, lengths, seed=7)
    config = EngineConfig(prefill_chunk=CHUNK, max_num_seqs=8)
    abort_after = {"d": ("prefill", 1), "c": ("decode", 3)}
    return record(tiny_llama_model, prompts, config, abort_after)


def test_replaying_the_plans_reproduces_the_kv_and_the_tokens(
    plain_recording: Recording, tiny_llama_model: LoadedModel
) -> None:
    recording = plain_recording
    assert recording.finish["d"] is FinishReason.ABORTED and recording.tokens["d"] == []
    assert recording.finish["c"] is FinishReason.ABORTED
    assert 0 < len(recording.tokens["c"]) < MAX_TOKENS
    for rid in ("a", "b", "s1", "s2"):
        assert recording.finish[rid] is FinishReason.LENGTH
        assert len(recording.tokens[rid]) == MAX_TOKENS
    kinds = {op.kind for data in recording.plans for op in StepPlan.from_bytes(data).ops}
    assert {"new", "prefill", "decode", "join", "drop"} <= kinds
    assert "restore" not in kinds  # no prompt shares a block with another
    # Chunks of one request stay several plans apart: its KV grows step by step.
    chunks = [
        op
        for data in recording.plans
        for op in StepPlan.from_bytes(data).ops
        if isinstance(op, Prefill) and op.request_id == "b"
    ]
    assert [op.start for op in chunks] == sorted(op.start for op in chunks) and len(chunks) > 2
    streamed = {rid: tokens for rid, tokens in recording.tokens.items() if tokens}
    assert replay(tiny_llama_model, recording) == streamed


def test_a_replay_with_speculation_reproduces_verify_and_rollback(
    tiny_llama_model: LoadedModel,
) -> None:
    # Repeating prompts: prompt lookup drafts, and the random model rejects most drafts,
    # so rows roll back different amounts.
    rng = random.Random(3)
    motif = [rng.randrange(100, 2000) for _ in range(12)]
    prompts = {f"r{i}": (motif * 12)[i : i + 90 + 10 * i] for i in range(3)}
    spec = SpeculationConfig("ngram", num_tokens=3, cost_aware=False)
    config = EngineConfig(prefill_chunk=CHUNK, max_num_seqs=4, speculation=spec)
    recording = record(tiny_llama_model, prompts, config, max_tokens=32)
    plans = [StepPlan.from_bytes(data) for data in recording.plans]
    # Rows rolled back by different amounts, with the batch decoding on after them.
    uneven = [
        i
        for i, plan in enumerate(plans)
        if any(isinstance(op, Rollback) and len(set(op.positions)) > 1 for op in plan.ops)
    ]
    assert any(recording.snapshots[i]["batch_ids"] for i in uneven if i + 1 < len(plans))
    assert replay(tiny_llama_model, recording) == recording.tokens


def test_a_prefix_cache_hit_replays_from_the_followers_own_blocks(
    tiny_llama_model: LoadedModel,
) -> None:
    """Two turns of one conversation, then a third that shares only part of a block: the
    follower restores from the blocks and tails it stored itself, bit for bit."""
    prompt = random_prompts(tiny_llama_model, {"first": 100}, seed=11)["first"]
    prompts = {
        "turn1": [*prompt, 5, 6, 7],
        "turn2": [*prompt, 5, 6, 7],
        "branch": [*prompt[:40], 9, 9, *prompt[:30]],  # a child block's first 8 tokens
    }
    config = EngineConfig(prefill_chunk=CHUNK, max_num_seqs=4)
    recording = record(tiny_llama_model, prompts, config, max_tokens=2, sequential=True)
    plans = [StepPlan.from_bytes(data) for data in recording.plans]
    restores = [op for plan in plans for op in plan.ops if isinstance(op, Restore)]
    assert [op.request_id for op in restores] == ["turn2", "branch"]
    # Whole blocks of 16 from RAM, the rest of the prompt but its last token from a tail.
    assert restores[0].tokens == len(prompt) + 2
    assert len(restores[0].block_ids) == restores[0].tokens // BLOCK
    assert restores[0].tail_tokens == restores[0].tokens % BLOCK
    # Two whole blocks, then 8 tokens of the third one (a child block, not a tail).
    assert (len(restores[1].block_ids), restores[1].tail_tokens) == (2, 8)
    holds = [op for plan in plans for op in plan.ops if isinstance(op, Hold)]
    assert [[piece[0] for piece in op.pieces] for op in holds] == [["tail"], ["block"]]
    kinds = {op.kind for plan in plans for op in plan.ops}
    assert {"block", "tail", "hold"} <= kinds
    assert replay(tiny_llama_model, recording) == recording.tokens
    bare = StepApplier(ModelRunner(tiny_llama_model))
    with pytest.raises(PlanError, match="has no prefix cache"):
        for plan in plans:
            bare.apply(plan)


def test_every_op_survives_bytes_and_bad_bytes_are_refused() -> None:
    plan = StepPlan(
        3,
        (
            NewCache("a"),
            Restore("a", 32, (4, 9), 5),
            Prefill("a", 37, (1, 2, 3), False),
            Prefill("img", 0, (7,), True, vision=True),
            PrefillTogether(("b", "c"), ((1, 2), (3,))),
            Decode(("x", "y"), (10, 11)),
            Decode(("v",), (12,), (3,)),
            Verify(("x", "y"), ((10, 1, 2), (11,)), ()),
            Rollback((2, 0)),
            Join(("a", "b")),
            Drop(("c",)),
            ClearBatch(),
            StoreBlock(7, "a", 0, 16),
            PutBlock(8, ("disk", "ab12")),
            DropBlocks((7, 8)),
            StoreTail(3, "a", 32, 37),
            DropTails((3,)),
            Stage((("block", "9"), ("disk", "cd34"))),
            Hold("a", (("tail", "3", 5), ("block", "9", 4))),
            Unhold("a"),
            DiskPut("ef56", "0a", ("range", "a", 0, 16)),
        ),
    )
    assert StepPlan.from_bytes(plan.to_bytes()) == plan
    assert StepPlan.from_bytes(StepPlan(0, ()).to_bytes()) == StepPlan(0, ())
    for bad in (b"", b"[1]", b'[1,[["teleport","a"]]]', b'["x",[]]', b'[1,[["drop"]]]'):
        with pytest.raises(PlanError):
            StepPlan.from_bytes(bad)


def test_a_follower_refuses_a_plan_out_of_order_or_out_of_step(
    tiny_llama_model: LoadedModel,
) -> None:
    follower = StepApplier(ModelRunner(tiny_llama_model))
    with pytest.raises(PlanError, match="expected plan 0"):
        follower.apply(StepPlan(1, (NewCache("a"),)))
    with pytest.raises(PlanError, match="has no cache here"):
        follower.apply(StepPlan(0, (Prefill("a", 0, (1, 2), False),)))
    follower = StepApplier(ModelRunner(tiny_llama_model))
    follower.apply(StepPlan(0, (NewCache("a"), Prefill("a", 0, (1, 2), True), Join(("a",)))))
    with pytest.raises(PlanError, match="do not match the batch"):
        follower.apply(StepPlan(1, (Decode(("b",), (3,)),)))


def test_a_follower_replays_the_re_feed_of_a_hybrid_s_rollback(embedded_model: LoadedModel) -> None:
    """On a hybrid (Qwen3-Next: recurrent and attention layers) a rollback re-feeds the
    rows that rejected drafts (engine/verify_rollback.py). The plan carries only the
    Verify and Rollback ops; a follower with a separately built copy of the model runs
    the same re-feed from them: its batch (K/V and recurrent state) equals the leader's
    bit for bit, and so do the logits of the decode after it."""
    from tests.python.rollback_rows import FED, KEPT, NEXT

    leader = StepApplier(ModelRunner(tiny_model("qwen3_next", embedded_model)))
    follower = StepApplier(ModelRunner(tiny_model("qwen3_next", embedded_model)))
    prompts = random_prompts(embedded_model, {"a": 30, "b": 20, "c": 26}, seed=5)
    for rid, ids in prompts.items():
        leader.new_cache(rid)
        leader.prefill(rid, 0, ids)
    rows = list(prompts)
    leader.join(rows)
    leader.verify(rows, FED)
    leader.rollback([max(map(len, FED)) - k for k in KEPT])
    logits = leader.decode(rows, NEXT)
    plan = leader.take_plan()
    assert plan is not None
    outputs = follower.apply(StepPlan.from_bytes(plan.to_bytes()))
    assert np.array(outputs[-1]).tobytes() == np.array(logits).tobytes()
    mine = [np.array(a) for a in kv_arrays(follower.batch.cache) if isinstance(a, mx.array)]
    theirs = [np.array(a) for a in kv_arrays(leader.batch.cache) if isinstance(a, mx.array)]
    assert len(mine) == len(theirs) > 0
    for a, b in zip(mine, theirs, strict=True):
        assert a.shape == b.shape and a.tobytes() == b.tobytes()
