"""The embedding engine's scheduling (embeddings/scheduler.py) on a real tiny model:
batches pool inputs of several requests around the oldest one, by length, under the
token budget; each request gets its own rows back, equal to the model's forward of each
input alone; and the host's weighted fairness (engine/host.py) gives a weighted engine
its share of the thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from compat_serve.embeddings.model import EmbeddingModel
from compat_serve.embeddings.scheduler import EmbeddingEngine, EmbeddingJob
from compat_serve.engine.errors import EngineStopped
from compat_serve.engine.host import EngineHost, _Hosted


@pytest.fixture(scope="module")
def model(tiny_embedding_model: Callable[[str], EmbeddingModel]) -> EmbeddingModel:
    return tiny_embedding_model("bert_embedding")


def _queue(engine: EmbeddingEngine, *lengths: list[int]) -> list[EmbeddingJob]:
    """Jobs queued without a host (each a request of inputs of these lengths)."""
    jobs = [EmbeddingJob("embed", [[5] * n for n in job]) for job in lengths]
    for job in jobs:
        engine._inbox.put(job)
    assert engine._drain_inbox(0.0)
    return jobs


def test_a_batch_is_the_oldest_input_and_its_length_neighbours(model: EmbeddingModel) -> None:
    engine = EmbeddingEngine(model, max_batch_tokens=64, max_batch_size=8)
    jobs = _queue(engine, [30, 5], [6, 31, 7], [4])
    first = engine.next_batch()
    # The oldest (30 tokens) with the one of closest length; a third would pad to 93 > 64.
    assert sorted(i.length for i in first) == [30, 31]
    engine._drop(first)
    second = engine.next_batch()
    assert sorted(i.length for i in second) == [4, 5, 6, 7]
    assert {i.job for i in second} == set(jobs)  # three requests in one forward
    engine._drop(second)
    assert not engine._hosted_has_work()


def test_the_batch_size_bounds_a_step(model: EmbeddingModel) -> None:
    engine = EmbeddingEngine(model, max_batch_tokens=10_000, max_batch_size=3)
    _queue(engine, [8] * 5)
    assert len(engine.next_batch()) == 3


def test_a_step_takes_what_the_forwards_do_in_the_target_time(model: EmbeddingModel) -> None:
    """On a slow device a 4,096-token step would stall the chat model's streams for
    seconds: the budget shrinks to what the measured forwards do in TARGET_STEP_S."""
    from compat_serve.embeddings.scheduler import TARGET_STEP_S

    engine = EmbeddingEngine(model, max_batch_tokens=4096)
    assert engine.step_tokens == 4096  # nothing measured yet
    engine._tokens_per_s = 40 / TARGET_STEP_S  # 40 padded tokens per step
    assert engine.step_tokens == 40
    _queue(engine, [10] * 6, [60])
    host = EngineHost(name="compat-bound-test")
    engine._host = host
    assert len(engine.next_batch()) == 7  # alone: the whole budget
    chat = _Busy("chat", 0.0)
    host._hosted.append(_Hosted(chat, was_busy=True))  # another model with work
    assert len(engine.next_batch()) == 4  # 4 x 10 tokens
    engine._pending = engine._pending[-1:]
    assert [i.length for i in engine.next_batch()] == [60]  # one input always goes through


def test_requests_batched_together_get_each_inputs_own_vector(model: EmbeddingModel) -> None:
    """Concurrent requests of mixed lengths, pooled into padded batches, each get the rows
    the model computes for each input alone (1e-5, f32)."""
    texts = ["the capital of france", "rust", "how to parse a token in python code", "sky"]
    rows = [model.tokenize(t) for t in texts]
    alone = [np.array(model.embed([row]))[0] for row in rows]
    engine = EmbeddingEngine(model, max_batch_tokens=48)
    engine.start()
    try:

        async def run() -> list[list[np.ndarray]]:
            futures = [engine.submit("embed", [rows[i], rows[3 - i]]) for i in range(4)]
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

        results = asyncio.run(run())
    finally:
        engine.shutdown()
    for i, (a, b) in enumerate(results):
        np.testing.assert_allclose(a, alone[i], atol=1e-5)
        np.testing.assert_allclose(b, alone[3 - i], atol=1e-5)
    assert any(inputs > 1 for inputs, _, _ in engine.step_log)  # batched, not one by one
    assert all(padded <= 48 for _, padded, _ in engine.step_log)
    assert engine.in_flight == 0


def test_a_stopped_engine_refuses_and_fails_what_was_queued(model: EmbeddingModel) -> None:
    engine = EmbeddingEngine(model)
    queued = _queue(engine, [4])[0]
    engine._hosted_finish(failed=False)
    with pytest.raises(EngineStopped):
        queued.future.result(timeout=1)
    with pytest.raises(EngineStopped):
        engine.submit("embed", [[5]])
    started = EmbeddingEngine(model)
    started.start()
    try:
        with pytest.raises(ValueError, match="cannot score"):
            started.submit("score", [[5]])
    finally:
        started.shutdown()


class _Busy:
    """A hosted stand-in that always has work: each step spins for `step_s` (the host's
    policy under test, not a model)."""

    def __init__(self, name: str, step_s: float) -> None:
        self.model = type("M", (), {"name": name})()
        self._inbox: Any = __import__("queue").SimpleQueue()
        self.step_s = step_s
        self.seconds = 0.0
        self.stop = threading.Event()
        self.done = threading.Event()
        self.has_work = True

    def _drain_inbox(self, wait: float | None) -> bool:
        return not self.stop.is_set()

    def _hosted_has_work(self) -> bool:
        return self.has_work

    def _hosted_step(self) -> bool:
        started = time.monotonic()
        while time.monotonic() - started < self.step_s:
            pass
        self.seconds += time.monotonic() - started
        return True

    def _hosted_finish(self, *, failed: bool) -> None:
        self.done.set()


def test_a_weighted_engine_gets_its_share_of_the_thread() -> None:
    """Weight 5 against 1: the weighted engine gets ~1/6 of the step time."""
    host = EngineHost(name="compat-weight-test")
    chat, embedding = _Busy("chat", 0.002), _Busy("embedding", 0.002)
    host.attach(chat)
    host.attach(embedding, weight=5.0)
    time.sleep(0.6)
    chat.stop.set()
    embedding.stop.set()
    host.wake.set()
    assert chat.done.wait(5) and embedding.done.wait(5)
    share = embedding.seconds / (chat.seconds + embedding.seconds)
    assert 0.10 < share < 0.25, share


def test_an_engine_idle_while_another_stepped_alone_banks_no_credit() -> None:
    """An engine idle while the other stepped alone re-enters at that one's clock: from
    then on they share the thread, rather than the late one holding it until its own
    older clock catches up (which starved a chat model for seconds after an idle spell)."""
    host = EngineHost(name="compat-floor-test")
    first, late = _Busy("first", 0.002), _Busy("late", 0.002)
    late.has_work = False
    host.attach(first)
    host.attach(late)
    time.sleep(0.4)  # `first` steps alone
    first.has_work = False  # between two of its requests...
    late.has_work = True  # ...the other's work arrives
    host.wake.set()
    time.sleep(0.02)
    first.has_work = True
    first.seconds = late.seconds = 0.0
    host.wake.set()
    time.sleep(0.3)
    share = late.seconds / (first.seconds + late.seconds)
    first.stop.set()
    late.stop.set()
    host.wake.set()
    assert first.done.wait(5) and late.done.wait(5)
    assert 0.3 < share < 0.7, share
