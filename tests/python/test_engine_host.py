"""One thread stepping two engines (engine/host.py): the same tokens as an engine on its
own thread, a background request's first token while the other model decodes (#27: at
most 2x its solo TTFT + 250 ms), one engine stopping while the other serves, and a third
model loading with its MLX work on that thread in slices while a resident one decodes.

The fairness and loading tests run on the real embedded model (a decode step must take
long enough for an unfair host to show); the others compare an engine with itself or
check its life cycle, on the tiny llama (`tiny_llama_model`)."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import mlx.core as mx
import pytest

from compat_serve.bootstrap import ServeOptions
from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.host import EngineHost
from compat_serve.engine.types import EngineEvent, EngineRequest, FinishReason, SamplingParams
from compat_serve.models.load_steps import watch_evaluations
from compat_serve.models.loader import load_model_steps
from compat_serve.serve_models import load_state_steps
from tests.chat_prompts import chat_ids
from tests.greedy_ties import assert_same_or_near_tie
from tests.tiny_models import write_model_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
T = TypeVar("T")


@pytest.fixture(scope="module")
def hosted(embedded_model: LoadedModel) -> Iterator[tuple[EngineHost, Engine, Engine]]:
    host = EngineHost(name="compat-engine-host-test")
    main, background = (
        Engine(embedded_model, EngineConfig(prefill_chunk=64, prefix_cache=False)) for _ in range(2)
    )
    main.start(host)
    background.start(host)
    yield host, main, background
    main.shutdown()
    background.shutdown()


@pytest.fixture(scope="module")
def tiny_hosted(tiny_llama_model: LoadedModel) -> Iterator[tuple[Engine, Engine]]:
    """Two tiny-llama engines on one host."""
    host = EngineHost(name="compat-engine-host-tiny")
    main, background = (
        Engine(tiny_llama_model, EngineConfig(prefill_chunk=64, prefix_cache=False))
        for _ in range(2)
    )
    main.start(host)
    background.start(host)
    yield main, background
    main.shutdown()
    background.shutdown()


async def _tokens(
    engine: Engine, rid: str, ids: tuple[int, ...], sampling: SamplingParams
) -> list[int]:
    events: list[EngineEvent] = [e async for e in engine.submit(EngineRequest(rid, ids, sampling))]
    assert events[-1].finish_reason is not FinishReason.ERROR, events[-1]
    return [t for e in events for t in e.token_ids]


def test_a_hosted_engine_writes_the_tokens_of_an_engine_on_its_own_thread(
    tiny_llama_model: LoadedModel, tiny_hosted: tuple[Engine, Engine]
) -> None:
    main, background = tiny_hosted
    ids = chat_ids(tiny_llama_model, "Name three colours.")
    alone = Engine(tiny_llama_model, EngineConfig(prefill_chunk=64, prefix_cache=False))
    alone.start()
    try:
        reference = asyncio.run(_tokens(alone, "ref", ids, GREEDY))
    finally:
        alone.shutdown()

    async def both() -> list[list[int]]:
        return await asyncio.gather(
            _tokens(main, "m", ids, GREEDY), _tokens(background, "b", ids, GREEDY)
        )

    # The same path (one request, same chunks) on another thread: the same tokens, up to
    # a near tie (a hosted step is the same computation, but nothing promises the bits).
    assert len(reference) == GREEDY.max_tokens
    for tokens in asyncio.run(both()):
        assert_same_or_near_tie(tiny_llama_model, ids, reference, tokens)
    names = [t.name for t in threading.enumerate()]
    assert names.count("compat-engine-host-tiny") == 1
    assert main.running and background.running


def _first_token_s(engine: Engine, rid: str, ids: tuple[int, ...]) -> float:
    async def run() -> float:
        started = time.monotonic()
        async for event in engine.submit(EngineRequest(rid, ids, GREEDY)):
            if event.token_ids:
                elapsed = time.monotonic() - started
                engine.abort(rid)
                return elapsed
        raise AssertionError("no token")

    return asyncio.run(run())


def test_a_background_request_is_not_starved_by_a_decoding_model(
    embedded_model: LoadedModel, hosted: tuple[EngineHost, Engine, Engine]
) -> None:
    _, main, background = hosted
    short = chat_ids(embedded_model, "Write a title for: fixing the login bug.")
    solo = statistics.median(_first_token_s(background, f"solo{i}", short) for i in range(3))
    long_run = SamplingParams(max_tokens=400, temperature=0.0, stop_at_eos=False)
    loop = asyncio.new_event_loop()
    decoding = [
        main.submit(
            EngineRequest(f"main{i}", chat_ids(embedded_model, f"Story {i}"), long_run), loop
        )
        for i in range(4)
    ]
    try:
        time.sleep(1.0)  # the four streams are decoding
        # The best of three: a neighbour process on a shared CPU can slow one run; an
        # unfair host (the decoding model stepped while others wait) slows every run by
        # the whole decode (tens of seconds).
        busy = min(_first_token_s(background, f"busy{i}", short) for i in range(3))
        assert main.in_flight == 4  # still decoding throughout
    finally:
        for stream in decoding:
            main.abort(stream.request_id)
        deadline = time.monotonic() + 30
        while main.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        loop.close()
    # The bound (2x solo + 0.25 s) is measured by benches/multi_model.py; here a
    # second of slack for a loaded CI machine, still far below an unfair host's delay.
    assert busy <= 2 * solo + 1.0, (busy, solo)


def test_stopping_one_engine_leaves_the_other_serving(tiny_llama_model: LoadedModel) -> None:
    host = EngineHost(name="compat-engine-stop-test")
    first, second = (
        Engine(tiny_llama_model, EngineConfig(prefill_chunk=64, prefix_cache=False))
        for _ in range(2)
    )
    first.start(host)
    second.start(host)
    first.shutdown()
    assert not first.running and second.running
    ids = chat_ids(tiny_llama_model, "Say hi.")
    assert len(asyncio.run(_tokens(second, "after", ids, GREEDY))) > 0
    second.shutdown()
    assert host.engines == 0
    deadline = time.monotonic() + 5
    while "compat-engine-stop-test" in [t.name for t in threading.enumerate()]:
        assert time.monotonic() < deadline, "the host thread outlived its engines"
        time.sleep(0.01)


def test_an_engine_whose_loop_fails_ends_its_requests_and_the_other_goes_on(
    tiny_llama_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = EngineHost(name="compat-engine-fault-test")
    broken, healthy = (
        Engine(tiny_llama_model, EngineConfig(prefill_chunk=64, prefix_cache=False))
        for _ in range(2)
    )

    def scheduler_bug() -> bool:
        raise RuntimeError("a scheduler bug")

    monkeypatch.setattr(broken._executor, "step", scheduler_bug)
    broken.start(host)
    healthy.start(host)
    ids = chat_ids(tiny_llama_model, "Say hi.")

    async def both() -> tuple[list[EngineEvent], list[int]]:
        failed = [e async for e in broken.submit(EngineRequest("x", ids, GREEDY))]
        return failed, await _tokens(healthy, "ok", ids, GREEDY)

    failed, tokens = asyncio.run(both())
    assert failed[-1].finish_reason is FinishReason.SHUTDOWN
    assert tokens and healthy.running and not broken.running
    healthy.shutdown()
    broken.shutdown()


def _decode_while(
    engine: Engine, ids: tuple[int, ...], work: Callable[[], Coroutine[Any, Any, T]]
) -> tuple[list[float], float, float, T]:
    """Run `work` while `engine` decodes one long greedy stream on the host: the times of
    the stream's tokens, the window `work` took (start, end) and its result."""
    long_run = SamplingParams(max_tokens=2000, temperature=0.0, stop_at_eos=False)

    async def run() -> tuple[list[float], float, float, T]:
        arrivals: list[float] = []
        stream = engine.submit(EngineRequest("resident", ids, long_run))

        async def consume() -> None:
            async for event in stream:
                if event.token_ids:
                    arrivals.append(time.monotonic())

        reader = asyncio.create_task(consume())
        while len(arrivals) < 3:  # decoding before the load starts
            await asyncio.sleep(0.01)
        started = time.monotonic()
        result = await work()
        ended = time.monotonic()
        engine.abort("resident")
        await reader
        return arrivals, started, ended, result

    return asyncio.run(run())


@dataclass
class _LoadTurn:
    budget_s: float  # the host's last step time when the turn began
    slices_s: list[float]  # the load's slices this turn ran, in order


def _trace_host_turns(
    host: EngineHost, resident: Engine, monkeypatch: pytest.MonkeyPatch
) -> list[str | _LoadTurn]:
    """The host thread's own order of its turns, as it runs them: "step" for each step of
    `resident`, a `_LoadTurn` for each call that runs a load's host slices (engine/host.py)."""
    trace: list[str | _LoadTurn] = []
    step, advance = resident._hosted_step, host._advance_while_alone

    def traced_step() -> bool:
        trace.append("step")
        return step()

    def traced_advance(*args: Any) -> tuple[bool, Any]:
        turn = _LoadTurn(host._last_step_s, [])
        before = len(host.slice_times)
        result = advance(*args)
        turn.slices_s = [seconds for _, seconds in list(host.slice_times)[before:]]
        trace.append(turn)
        return result

    monkeypatch.setattr(resident, "_hosted_step", traced_step)
    monkeypatch.setattr(host, "_advance_while_alone", traced_advance)
    return trace


def test_a_load_evaluates_on_the_host_thread_while_a_resident_model_decodes(
    embedded_model: LoadedModel,
    hosted: tuple[EngineHost, Engine, Engine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """#27 item 3: a model loaded beside a decoding one (the embedded GGUF, then its
    engine) has every MLX evaluation on the host thread, a slice at a time, and the
    resident model steps between the load's slices. Checked on the host thread's own
    order of turns, not on clock gaps (which a loaded CI machine stretches)."""
    host, main, _ = hosted
    options = ServeOptions(kv_memory="32MB", cache_memory="16MB")
    ids = chat_ids(embedded_model, "Tell a long story.")
    trace = _trace_host_turns(host, main, monkeypatch)
    with watch_evaluations() as seen:
        arrivals, started, ended, state = _decode_while(
            main, ids, lambda: host.run_steps(load_state_steps(options))
        )
    monkeypatch.undo()
    try:
        assert {e.thread for e in seen} == {host.thread_name}
        labels = [e.label for e in seen]
        assert labels[-1] == "engine start-up"
        assert len(labels) >= 4, labels  # the weights in several slices
        # Each turn of the load's host work ran slices only while they had taken less
        # than the resident's last step (the host's rule: the thread shared half and half;
        # a load run in one piece breaks it), and the resident, which had work
        # throughout, stepped between each two turns.
        loads = [k for k, turn in enumerate(trace) if isinstance(turn, _LoadTurn)]
        assert len(loads) >= 2, trace
        for k in loads:
            turn = trace[k]
            assert isinstance(turn, _LoadTurn) and turn.slices_s, trace
            assert sum(turn.slices_s[:-1]) < turn.budget_s, turn
        for a, b in itertools.pairwise(loads):
            assert "step" in trace[a + 1 : b], trace
        assert any(started <= t <= ended for t in arrivals)  # its tokens reached the client
        # The model built a slice at a time is the embedded model: the same greedy tokens.
        state.engine.start(host)
        short = chat_ids(embedded_model, "Name three colours.")

        async def both() -> list[list[int]]:
            return await asyncio.gather(
                _tokens(main, "ref", short, GREEDY), _tokens(state.engine, "new", short, GREEDY)
            )

        reference, loaded = asyncio.run(both())
        assert_same_or_near_tie(embedded_model, short, reference, loaded)
    finally:
        state.engine.shutdown()
    assert [t.name for t in threading.enumerate()].count(host.thread_name) == 1


def test_a_model_directory_loads_on_the_host_thread(
    embedded_model: LoadedModel, hosted: tuple[EngineHost, Engine, Engine], tmp_path: Path
) -> None:
    """The mlx-lm directory path: the lazy safetensors are built and evaluated on the host
    thread, the tokenizer is read off it, and the model is the one written."""
    host, _, _ = hosted
    source = write_model_dir(tmp_path / "tiny", "llama", embedded_model)
    with watch_evaluations() as seen:
        loaded = asyncio.run(host.run_steps(load_model_steps(str(tmp_path / "tiny"))))
    assert seen and {e.thread for e in seen} == {host.thread_name}
    prompt = mx.array([[1, 2, 3]], dtype=mx.uint32)
    assert mx.allclose(loaded.model(prompt), source(prompt), atol=1e-4).item()
