"""State points (engine/prefix/points.py): hybrid and sliding-window models read a
repeated or continued prompt to its last snapshot between block boundaries, not to the
last block with a snapshot.

On tiny random models of real mlx-lm classes (LFM2: short convolutions + attention;
Gemma 3: a sliding window + a global layer), against the same model with no cache
(tie-aware greedy: the cached path splits the prompt differently):

- an exact repeat reads the prompt minus its last token;
- the next turn, which echoes prompt + reply, reads to the end of the reply (the state
  taken from a row of the decode batch, also when several rows decode together);
- the points are bounded by their budget, least recently used out first.

The disk tier after a restart and 8-bit KV are covered where those paths are tested
(test_prefix_disk.py, test_kv_quant_rotating_engine.py).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import pytest

from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.prefix.points import PointStore, StatePoint
from compat_serve.engine.types import EngineRequest, FinishReason, SamplingParams, Usage
from tests.greedy_ties import assert_same_or_near_tie
from tests.tiny_models import SLIDING_WINDOW, tiny_model

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

BLOCK, CHUNK = 16, 64
TEXT = " ".join(f"Fact {i}: the river number {i} flows north." for i in range(8))
NEXT = "<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"
_ids = itertools.count()


class Pair:
    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.cached = started(loaded)
        self.uncached = started(loaded, prefix_cache=False)

    def close(self) -> None:
        self.cached.shutdown()
        self.uncached.shutdown()


def started(loaded: LoadedModel, **config: Any) -> Engine:
    engine = Engine(loaded, EngineConfig(prefill_chunk=CHUNK, block_size=BLOCK, **config))
    engine.start()
    return engine


@pytest.fixture(scope="module", params=["lfm2", "gemma3_text"])
def pair(request: pytest.FixtureRequest, embedded_model: LoadedModel) -> Iterator[Pair]:
    made = Pair(tiny_model(request.param, embedded_model))
    yield made
    made.close()


def request_of(prompt: tuple[int, ...], max_tokens: int) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, stop_at_eos=False)
    return EngineRequest(f"sp{next(_ids)}", prompt, sampling)


async def collect(engine: Engine, request: EngineRequest) -> tuple[list[int], Usage]:
    events = [e async for e in engine.submit(request)]
    assert events[-1].finish_reason is not FinishReason.ERROR, events[-1].error
    assert events[-1].usage is not None
    return [t for e in events for t in e.token_ids], events[-1].usage


def run(engine: Engine, prompt: tuple[int, ...], max_tokens: int = 8) -> tuple[list[int], Usage]:
    return asyncio.run(collect(engine, request_of(prompt, max_tokens)))


def encode(loaded: LoadedModel, text: str) -> tuple[int, ...]:
    return tuple(loaded.tokenizer.encode(text))


def test_an_exact_repeat_reads_all_but_the_last_token(pair: Pair) -> None:
    prompt = encode(pair.loaded, "Repeat. " + TEXT)
    assert len(prompt) % BLOCK not in (0, 1) and len(prompt) > SLIDING_WINDOW
    first, usage = run(pair.cached, prompt)
    assert usage.cached_tokens == 0
    again, usage = run(pair.cached, prompt)
    assert usage.cached_tokens == len(prompt) - 1
    assert pair.cached.prefix is not None and pair.cached.prefix.faults == 0
    expected = run(pair.uncached, prompt)[0]
    assert_same_or_near_tie(pair.loaded, prompt, expected, first)
    assert_same_or_near_tie(pair.loaded, prompt, expected, again)


def test_the_next_turn_reads_to_the_end_of_the_reply(pair: Pair) -> None:
    turn1 = encode(pair.loaded, "Next turn. " + TEXT)
    reply, _ = run(pair.cached, turn1, max_tokens=12)
    turn2 = turn1 + tuple(reply) + encode(pair.loaded, NEXT)
    tokens, usage = run(pair.cached, turn2, max_tokens=12)
    # Every token that has a state: the reply's last token was never fed.
    assert usage.cached_tokens == len(turn1) + len(reply) - 1
    assert (len(turn1) + len(reply) - 1) % BLOCK != 0  # a point, not a block's snapshot
    assert pair.cached.prefix is not None and pair.cached.prefix.faults == 0
    assert_same_or_near_tie(pair.loaded, turn2, run(pair.uncached, turn2, 12)[0], tokens)


def test_rows_that_decoded_together_each_resume_at_their_reply(pair: Pair) -> None:
    engine = pair.cached
    turn1s = [encode(pair.loaded, f"Batch {i}. " + TEXT[: 120 + 40 * i]) for i in range(3)]

    async def together(prompts: list[tuple[int, ...]], n: list[int]) -> list[list[int]]:
        requests = [request_of(p, k) for p, k in zip(prompts, n, strict=True)]
        done = await asyncio.gather(*(collect(engine, r) for r in requests))
        return [tokens for tokens, _ in done]

    # Different reply lengths: rows leave the batch at different steps, the first two
    # from rows 1 and 2 (the first request joined first: row 0).
    replies = asyncio.run(together(turn1s, [14, 6, 10]))
    for turn1, reply in zip(turn1s, replies, strict=True):
        turn2 = turn1 + tuple(reply) + encode(pair.loaded, NEXT)
        tokens, usage = run(engine, turn2)
        assert usage.cached_tokens == len(turn1) + len(reply) - 1
        assert_same_or_near_tie(pair.loaded, turn2, run(pair.uncached, turn2)[0], tokens)
    assert engine.prefix is not None and engine.prefix.faults == 0


def _point(tokens: tuple[int, ...], floats: int) -> StatePoint:
    state = mx.zeros((floats,), dtype=mx.float32)
    return StatePoint(tokens, [None], [(object, [state], None)])


def test_points_stay_within_their_budget_least_recently_used_out_first() -> None:
    store = PointStore(budget_bytes=3 * 400)
    for i in range(3):
        store.put(b"p%d" % i, _point((i, 1), 100))  # 400 bytes each
    assert store.match(b"p0", [0, 1, 5], limit=5) is not None  # p0 is used: p1 goes first
    store.put(b"p3", _point((3, 1), 100))
    assert store.bytes_in_use == 3 * 400 and len(store) == 3
    assert store.match(b"p1", [1, 1], limit=5) is None
    assert store.match(b"p0", [0, 1], limit=5) is not None
    # Only a whole point is a valid state: never a part of one, never past `limit`.
    assert store.match(b"p0", [0, 2], limit=5) is None
    assert store.match(b"p0", [0, 1], limit=1) is None
