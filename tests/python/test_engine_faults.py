"""Faults the engine must survive: a failing batched decode step, a client that stops
reading its stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.stream import RequestStream
from compat_serve.engine.types import EngineEvent, EngineRequest, FinishReason, SamplingParams
from tests.chat_prompts import chat_ids

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel


@pytest.fixture
def engine(embedded_model: LoadedModel) -> Iterator[Engine]:
    eng = Engine(embedded_model, EngineConfig(prefill_chunk=128))
    eng.start()
    yield eng
    eng.shutdown()


def test_a_failing_decode_step_fails_only_its_requests_and_frees_them(
    engine: Engine, embedded_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = engine._runner
    real = runner.decode_logits
    state = {"failed_rows": 0}

    def fail_once_with_two_rows(cache, tokens):  # type: ignore[no-untyped-def]
        if not state["failed_rows"] and len(tokens) == 2:
            state["failed_rows"] = len(tokens)
            raise RuntimeError("injected decode fault")
        return real(cache, tokens)

    monkeypatch.setattr(runner, "decode_logits", fail_once_with_two_rows)
    sampling = SamplingParams(max_tokens=24, temperature=0, stop_at_eos=False)

    async def run() -> list[list[EngineEvent]]:
        first = [
            engine.submit(EngineRequest(f"batch{i}", chat_ids(embedded_model, "Hi"), sampling))
            for i in range(2)
        ]

        async def drain(stream: RequestStream) -> list[EngineEvent]:
            return [event async for event in stream]

        failed = await asyncio.gather(*(drain(s) for s in first))
        later = engine.submit(EngineRequest("later", chat_ids(embedded_model, "Hi"), sampling))
        return [*failed, await drain(later)]

    a, b, later = asyncio.run(run())
    assert state["failed_rows"] == 2
    for events in (a, b):
        assert events[-1].finish_reason is FinishReason.ERROR
        assert "injected decode fault" in (events[-1].error or "")
        assert events[-1].usage is not None
    assert later[-1].finish_reason is FinishReason.LENGTH
    assert later[-1].usage is not None and later[-1].usage.completion_tokens == 24
    # Nothing is held for the failed requests: KV reservations and cache pins are gone.
    deadline = time.monotonic() + 5
    while engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.in_flight == 0
    assert engine._scheduler.kv_tokens_used == 0
    assert engine.prefix is not None and engine.prefix.cache.stats().in_use_blocks == 0


def test_a_client_that_stops_reading_is_aborted_with_a_bounded_backlog() -> None:
    aborted: list[str] = []

    async def run() -> RequestStream:
        loop = asyncio.get_running_loop()
        stream = RequestStream("slow", loop, aborted.append, max_backlog=64)
        for i in range(1000):  # the engine keeps producing; nobody reads
            stream.push(EngineEvent("slow", text=str(i), token_ids=(i,)))
        stream.push(EngineEvent("slow", finish_reason=FinishReason.ABORTED))
        await asyncio.sleep(0.05)
        return stream

    stream = asyncio.run(run())
    assert aborted == ["slow"]
    assert stream.backlog <= 64 + 2  # capped, plus the terminal event


def test_a_stalled_reader_is_aborted_after_the_timeout() -> None:
    aborted: list[str] = []

    async def run() -> list[EngineEvent]:
        loop = asyncio.get_running_loop()
        stream = RequestStream("stall", loop, aborted.append, slow_consumer_timeout_s=0.1)
        stream.push(EngineEvent("stall", text="a", token_ids=(1,)))
        got = [await stream.next()]
        stream.push(EngineEvent("stall", text="b", token_ids=(2,)))
        await asyncio.sleep(0.3)  # events wait, nobody reads
        assert not aborted
        stream.push(EngineEvent("stall", text="c", token_ids=(3,)))
        await asyncio.sleep(0.01)
        stream.push(EngineEvent("stall", finish_reason=FinishReason.ABORTED))
        await asyncio.sleep(0.01)
        while not stream.finished:
            event = await stream.next()
            assert event is not None
            got.append(event)
        return got

    got = asyncio.run(run())
    assert aborted == ["stall"]
    assert got[-1].finish_reason is FinishReason.ABORTED


def test_a_reader_that_keeps_up_is_never_aborted() -> None:
    aborted: list[str] = []

    async def run() -> int:
        loop = asyncio.get_running_loop()
        stream = RequestStream("fast", loop, aborted.append, max_backlog=8)
        count = 0
        for i in range(200):
            stream.push(EngineEvent("fast", text="x", token_ids=(i,)))
            await asyncio.sleep(0)
            while stream.backlog:
                await stream.next()
                count += 1
        return count

    assert asyncio.run(run()) == 200
    assert aborted == []
