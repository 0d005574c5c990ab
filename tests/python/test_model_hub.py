"""The hub's sequencing (python/compat_serve/registry/hub.py): single-flight loads,
eviction order, in-flight protection, the never-fits and failed-load answers, and the
keep_alive / ttl fields. What is under test is the order of loads and unloads, so each
"model" here is a stand-in engine with a size and an in-flight count; the real loads are
tests/http/test_multi_model.py's."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from compat_serve.registry.entries import ModelEntry
from compat_serve.registry.hub import ModelHub, ModelRequestError, parse_lifetime
from compat_serve.registry.routing import ModelRegistry

MIB = 2**20


@dataclass
class _Memory:
    weights: int
    kv: int = 0
    cache: int = 0


@dataclass
class _Engine:
    memory: _Memory
    in_flight: int = 0
    running: bool = False
    stopped: bool = False

    def start(self) -> None:
        self.running = True

    def shutdown(self) -> None:
        self.stopped, self.running = True, False


@dataclass
class _State:
    engine: _Engine
    draining: bool = False


@dataclass
class _Loader:
    sizes: dict[str, int]
    delay_s: float = 0.0
    fail: set[str] = field(default_factory=set)
    loads: list[str] = field(default_factory=list)

    def load(self, entry: ModelEntry) -> Any:
        time.sleep(self.delay_s)
        self.loads.append(entry.id)
        if entry.id in self.fail:
            raise RuntimeError(f"cannot read {entry.id}.gguf")
        return _State(_Engine(_Memory(self.sizes[entry.id])))


def _hub(
    loader: _Loader, entries: list[ModelEntry], budget: int | None = None, wait_s: float = 1.0
) -> ModelHub:
    return ModelHub(
        ModelRegistry(entries),
        load=loader.load,
        release=lambda state: state.engine.shutdown(),
        collect=lambda: None,
        estimate=lambda entry: loader.sizes[entry.id],
        budget_bytes=budget,
        wait_timeout_s=wait_s,
    )


def _age(hub: ModelHub, model_id: str, seconds: float) -> None:
    hub.slots[model_id].last_used -= seconds


def test_concurrent_requests_for_a_cold_model_share_one_load() -> None:
    loader = _Loader({"a": MIB}, delay_s=0.2)
    hub = _hub(loader, [ModelEntry("a", None)])

    async def run() -> list[Any]:
        return await asyncio.gather(*(hub.acquire("a") for _ in range(6)))

    states = asyncio.run(run())
    assert loader.loads == ["a"]
    assert all(state is states[0] for state in states)
    assert hub.metrics.loads.value(model="a") == 1
    assert states[0].engine.running


def test_an_async_load_is_awaited_once_for_concurrent_requests_and_fails_as_a_load() -> None:
    """serve_models' loads are coroutines (their MLX slices run on the engine host thread):
    the hub awaits one per cold model instead of running `load` on a worker thread, and
    its failure is the loader's 500, then 400."""
    loader = _Loader({"a": MIB, "b": MIB}, fail={"b"})
    awaited: list[str] = []

    async def load_async(entry: ModelEntry) -> Any:
        awaited.append(threading.current_thread().name)
        await asyncio.sleep(0.1)
        return loader.load(entry)

    def no_thread_load(entry: ModelEntry) -> Any:
        raise AssertionError("the hub ran the blocking load")

    hub = ModelHub(
        ModelRegistry([ModelEntry("a", None), ModelEntry("b", None)]),
        load=no_thread_load,
        load_async=load_async,
        release=lambda state: state.engine.shutdown(),
        collect=lambda: None,
        estimate=lambda entry: loader.sizes[entry.id],
    )

    async def run() -> tuple[list[Any], list[int]]:
        states = await asyncio.gather(*(hub.acquire("a") for _ in range(6)))
        codes = []
        for _ in range(2):
            with pytest.raises(ModelRequestError) as failure:
                await hub.acquire("b")
            codes.append(failure.value.status)
        return states, codes

    states, codes = asyncio.run(run())
    assert awaited == [threading.main_thread().name, threading.main_thread().name]
    assert loader.loads == ["a", "b"] and all(s is states[0] for s in states)
    assert hub.metrics.loads.value(model="a") == 1 and codes == [500, 400]


def test_lru_idle_models_make_room_and_busy_or_pinned_ones_stay() -> None:
    loader = _Loader({"a": 4 * MIB, "b": 4 * MIB, "c": 4 * MIB, "p": 4 * MIB})
    entries = [ModelEntry(i, None) for i in "abc"] + [ModelEntry("p", None, pin=True)]
    hub = _hub(loader, entries, budget=12 * MIB)

    async def run() -> None:
        await hub.acquire("p")
        await hub.acquire("a")
        await hub.acquire("b")
        _age(hub, "p", 30)
        _age(hub, "a", 20)
        _age(hub, "b", 10)
        await hub.acquire("c")  # evicts a (least recently used, idle, unpinned)
        assert [s.entry.id for s in hub.resident()] == ["b", "c", "p"]
        # b busy, c leased by a request, p pinned: nothing can go; a waits, then is
        # overloaded.
        hub.slots["b"].state.engine.in_flight = 1  # type: ignore[union-attr]
        leases: list[Any] = []
        await hub.acquire("c", leases=leases)
        with pytest.raises(ModelRequestError) as caught:
            await hub.acquire("a")
        assert caught.value.overloaded and caught.value.status == 503

        hub.release(leases)
        _age(hub, "c", 40)  # c is idle now and the least recently used: it goes
        await hub.acquire("a")
        assert [s.entry.id for s in hub.resident()] == ["a", "b", "p"]

    asyncio.run(run())
    assert hub.metrics.evictions.value(model="a", reason="lru") == 1
    assert hub.metrics.evictions.value(model="c", reason="lru") == 1
    assert hub.metrics.evictions.value(model="b", reason="lru") == 0


def test_expired_ttl_goes_before_the_least_recently_used() -> None:
    loader = _Loader({"a": 4 * MIB, "b": 4 * MIB, "c": 4 * MIB})
    entries = [ModelEntry("a", None), ModelEntry("b", None, ttl_s=5), ModelEntry("c", None)]
    hub = _hub(loader, entries, budget=8 * MIB)

    async def run() -> None:
        await hub.acquire("a")
        await hub.acquire("b")
        _age(hub, "a", 60)  # older, but without a TTL
        _age(hub, "b", 10)  # past its 5 s TTL
        await hub.acquire("c")

    asyncio.run(run())
    assert sorted(s.entry.id for s in hub.resident()) == ["a", "c"]
    assert hub.metrics.evictions.value(model="b", reason="ttl") == 1


def test_a_model_over_the_budget_is_refused_at_once_and_remembered() -> None:
    loader = _Loader({"big": 64 * MIB})
    hub = _hub(loader, [ModelEntry("big", None)], budget=16 * MIB)

    async def run() -> None:
        for _ in range(2):
            with pytest.raises(ModelRequestError) as caught:
                await hub.acquire("big")
            assert caught.value.status == 400
            assert "64 MiB" in caught.value.message and "16 MiB" in caught.value.message

    asyncio.run(run())
    assert loader.loads == []


def test_a_failed_load_is_500_once_then_400_until_its_files_change(tmp_path: Any) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"x")
    loader = _Loader({"bad": MIB}, fail={"bad"})
    hub = _hub(loader, [ModelEntry("bad", str(path))])

    async def status() -> int:
        try:
            await hub.acquire("bad")
        except ModelRequestError as exc:
            assert "cannot read bad.gguf" in exc.message
            return exc.status
        return 200

    assert asyncio.run(status()) == 500
    assert asyncio.run(status()) == 400
    assert loader.loads == ["bad"]
    os.utime(path, (1, 1))  # the file changed: the next request tries again
    assert asyncio.run(status()) == 500
    assert loader.loads == ["bad", "bad"]


def test_an_unload_waits_for_requests_in_flight() -> None:
    loader = _Loader({"a": MIB})
    hub = _hub(loader, [ModelEntry("a", None)])

    async def run() -> float:
        state = await hub.acquire("a")
        state.engine.in_flight = 1

        async def finish() -> None:
            await asyncio.sleep(0.3)
            state.engine.in_flight = 0

        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.gather(hub.unload("a", "request"), finish())
        return loop.time() - started

    assert asyncio.run(run()) >= 0.3
    assert hub.slots["a"].status == "unloaded"


def test_keep_alive_and_ttl_set_the_idle_time() -> None:
    assert parse_lifetime({"keep_alive": "5m"}) == 300
    assert parse_lifetime({"keep_alive": 0}) == 0
    assert parse_lifetime({"keep_alive": -1}) == -1
    assert parse_lifetime({"keep_alive": "1h"}) == 3600
    assert parse_lifetime({"ttl": 90}) == 90
    assert parse_lifetime({"keep_alive": "soon"}) is None
    assert parse_lifetime({"keep_alive": True}) is None
    loader = _Loader({"a": MIB})
    hub = _hub(loader, [ModelEntry("a", None)])

    async def run() -> None:
        await hub.acquire("a", {"keep_alive": -1})
        assert hub.slots["a"].pinned and hub.slots["a"].ttl_s is None
        await hub.acquire("a", {"ttl": 30})
        assert not hub.slots["a"].pinned and hub.slots["a"].ttl_s == 30

    asyncio.run(run())


def test_a_load_larger_than_its_estimate_evicts_idle_models_after_it() -> None:
    loader = _Loader({"a": 4 * MIB, "b": 4 * MIB})
    hub = _hub(loader, [ModelEntry("a", None), ModelEntry("b", None)], budget=6 * MIB)
    hub._estimate_fn = lambda entry: MIB  # files smaller than the loaded weights

    async def run() -> None:
        await hub.acquire("a")
        _age(hub, "a", 10)
        await hub.acquire("b")

    asyncio.run(run())
    assert [s.entry.id for s in hub.resident()] == ["b"]
    assert hub.metrics.evictions.value(model="a", reason="lru") == 1


def test_a_load_measuring_more_than_the_whole_budget_is_unloaded_and_refused() -> None:
    loader = _Loader({"a": 8 * MIB})
    hub = _hub(loader, [ModelEntry("a", None)], budget=6 * MIB)
    hub._estimate_fn = lambda entry: 2 * MIB  # an estimate that was wrong

    async def run() -> list[int]:
        statuses = []
        for _ in range(2):
            leases: list[Any] = []  # the request's own lease does not keep it resident
            with pytest.raises(ModelRequestError) as caught:
                await hub.acquire("a", leases=leases)
            hub.release(leases)
            assert "8 MiB" in caught.value.message and "6 MiB" in caught.value.message
            statuses.append(caught.value.status)
        return statuses

    assert asyncio.run(run()) == [400, 400]
    assert loader.loads == ["a"]  # remembered: refused without a second load
    assert hub.resident() == [] and hub.resident_total() == 0
    assert hub.metrics.evictions.value(model="a", reason="too large") == 1


def test_the_estimate_is_checked_against_the_measured_size(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loader = _Loader({"near": 105 * MIB, "far": 150 * MIB})
    hub = _hub(loader, [ModelEntry("near", None), ModelEntry("far", None)], budget=512 * MIB)
    hub._estimate_fn = lambda entry: 100 * MIB
    assert hub.estimate(hub.slots["far"]) == 100 * MIB  # before a load: the estimate
    with caplog.at_level("WARNING", logger="compat_serve.registry"):
        asyncio.run(hub.acquire("near"))  # within the margin: no warning
        assert caplog.records == []
        asyncio.run(hub.acquire("far"))
    (record,) = caplog.records
    assert "model far: estimated 100 MiB before loading, measured 150 MiB" in record.message
    # From then on each model's measured size is used, and only its own.
    assert hub.estimate(hub.slots["near"]) == 105 * MIB
    assert hub.estimate(hub.slots["far"]) == 150 * MIB


def test_an_estimate_that_cannot_read_the_files_fails_as_a_load(tmp_path: Any) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"x")
    loader = _Loader({"bad": MIB})
    hub = _hub(loader, [ModelEntry("bad", str(path))], budget=16 * MIB)

    def unreadable(entry: ModelEntry) -> int:
        raise OSError(f"cannot read {entry.path}")

    hub._estimate_fn = unreadable

    async def status() -> int:
        try:
            await hub.acquire("bad")
        except ModelRequestError as exc:
            assert "failed to load: cannot read" in exc.message
            return exc.status
        return 200

    assert [asyncio.run(status()) for _ in range(2)] == [500, 400]
    assert loader.loads == []


def test_a_request_lease_keeps_its_model_until_released() -> None:
    loader = _Loader({"a": 4 * MIB, "b": 4 * MIB})
    hub = _hub(loader, [ModelEntry("a", None), ModelEntry("b", None)], budget=6 * MIB)

    async def run() -> None:
        leases: list[Any] = []
        await hub.acquire("a", leases=leases)
        _age(hub, "a", 60)
        waiting = asyncio.ensure_future(hub.acquire("b"))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # a's request is still being answered
        assert hub.slots["a"].status == "loaded"
        hub.release(leases)
        await asyncio.wait_for(waiting, 2)

    asyncio.run(run())
    assert [s.entry.id for s in hub.resident()] == ["b"]


def test_requests_for_a_model_in_the_way_wait_while_another_waits_for_memory() -> None:
    loader = _Loader({"a": 4 * MIB, "b": 4 * MIB})
    hub = _hub(loader, [ModelEntry("a", None), ModelEntry("b", None)], budget=6 * MIB, wait_s=5)
    hub.yield_after_s = 0.1

    async def run() -> None:
        leases_a: list[Any] = []
        leases_b: list[Any] = []
        leases_a2: list[Any] = []
        await hub.acquire("a", leases=leases_a)
        b = asyncio.ensure_future(hub.acquire("b", leases=leases_b))
        await asyncio.sleep(0.3)  # b has waited for a's memory past yield_after_s
        a2 = asyncio.ensure_future(hub.acquire("a", leases=leases_a2))
        await asyncio.sleep(0.2)
        assert not a2.done() and not leases_a2  # held back: a can drain
        hub.release(leases_a)
        await asyncio.wait_for(b, 2)
        assert not a2.done()  # b's request is being served
        hub.release(leases_b)
        await asyncio.wait_for(a2, 2)
        hub.release(leases_a2)

    asyncio.run(run())
    assert loader.loads == ["a", "b", "a"]
