"""The Rust scheduler through its Python binding (`compat_serve._native.Scheduler`)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compat_serve._native import Scheduler, SchedulerError, StepPlan

EOS = 2
TOKEN = 7


def make(
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 16,
    prefill_chunk: int = 8,
    kv_capacity_tokens: int = 64,
    context_length: int = 100,
) -> Scheduler:
    return Scheduler(
        max_num_seqs, max_num_batched_tokens, prefill_chunk, kv_capacity_tokens, context_length
    )


def report(
    plan: StepPlan, token: Callable[[str], int] = lambda _: TOKEN
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """What a faithful engine reports: every chunk in full, a token per decode and last chunk."""
    prefilled = [(rid, n) for rid, _start, n, _last in plan.prefill]
    sampled = [(rid, token(rid)) for rid, _start, _n, last in plan.prefill if last]
    sampled += [(rid, token(rid)) for rid in plan.decode]
    return prefilled, sampled


def step(
    s: Scheduler, token: Callable[[str], int] = lambda _: TOKEN
) -> tuple[StepPlan, list[tuple[str, str]]]:
    plan = s.schedule()
    return plan, s.update(*report(plan, token))


# --- the life of a request ----------------------------------------------------------


def test_chunked_prefill_then_decode_until_max_tokens() -> None:
    s = make()
    s.add_request("a", 20, 3, [EOS])
    assert (s.num_waiting, s.num_running) == (1, 0)
    plans = [step(s) for _ in range(5)]
    assert [p.prefill for p, _ in plans[:3]] == [
        [("a", 0, 8, False)],
        [("a", 8, 8, False)],
        [("a", 16, 4, True)],
    ]
    assert [p.decode for p, _ in plans[3:]] == [["a"], ["a"]]
    assert [done for _, done in plans] == [[], [], [], [], [("a", "max_tokens")]]
    assert (s.num_waiting, s.num_running, s.kv_tokens_used) == (0, 0, 0)
    assert s.snapshot() == []
    assert s.abort("a") is False, "a request ends exactly once"


def test_stop_token_and_context_full() -> None:
    s = make(context_length=10)
    s.add_request("stops", 4, 50, [EOS])
    s.add_request("fills", 8, 50)
    step(s)
    _, done = step(s, lambda rid: EOS)
    assert done == [("stops", "stop_token"), ("fills", "context_full")]


def test_max_tokens_zero_finishes_after_the_prompt() -> None:
    s = make()
    s.add_request("a", 5, 0)
    plan = s.schedule()
    assert plan.prefill == [("a", 0, 5, True)]
    assert s.update([("a", 5)], []) == [("a", "max_tokens")]


def test_abort_and_external_finish_are_reported_by_their_return_value() -> None:
    s = make()
    for rid in ("a", "b", "c"):
        s.add_request(rid, 4, 10)
    step(s)
    assert s.finish("a", "external") is True
    assert s.abort("b") is True
    assert s.abort("b") is False
    assert s.finish("b", "external") is False
    assert s.abort("never-added") is False
    _, done = step(s)
    assert done == []
    assert [row[0] for row in s.snapshot()] == ["c"]
    assert s.kv_tokens_used == 5


def test_plan_and_snapshot_describe_the_step() -> None:
    s = make(max_num_seqs=1)
    s.add_request("a", 4, 10)
    s.add_request("b", 4, 10)
    plan, _ = step(s)
    assert plan.num_tokens == 4
    assert plan.decode == [] and plan.preempted == []
    assert "prefill=1" in repr(plan)
    assert s.snapshot() == [("a", "running", 4, 1), ("b", "waiting", 0, 0)]
    with pytest.raises(AttributeError):
        plan.decode = []  # type: ignore[misc]
    with pytest.raises(TypeError):
        StepPlan()  # type: ignore[call-arg]


def test_kv_pressure_preempts_the_newest_and_it_recomputes() -> None:
    s = make(kv_capacity_tokens=24)
    s.add_request("a", 8, 100)
    s.add_request("b", 8, 100)
    step(s)
    while not (plan := step(s)[0]).preempted:
        assert plan.decode == ["a", "b"]
    assert plan.preempted == ["b"]
    assert s.snapshot()[1] == ("b", "preempted", 0, 5)
    assert s.finish("a", "external")
    plan, _ = step(s)
    assert plan.prefill == [("b", 0, 8, False)]
    plan, _ = step(s)
    assert plan.prefill == [("b", 8, 5, True)]
    assert step(s)[0].decode == ["b"]


# --- errors ----------------------------------------------------------------------------


def test_misuse_raises_scheduler_error() -> None:
    s = make()
    s.add_request("a", 4, 10)
    with pytest.raises(SchedulerError, match=r"duplicate request id \"a\""):
        s.add_request("a", 4, 10)
    plan = s.schedule()
    with pytest.raises(SchedulerError, match="before update"):
        s.schedule()
    with pytest.raises(SchedulerError, match=r"unknown request \"zz\""):
        s.update([("zz", 1)], [])
    with pytest.raises(SchedulerError, match="nothing was sampled"):
        s.update([("a", 4)], [])
    with pytest.raises(SchedulerError, match="prefilled 5 tokens, 4 planned"):
        s.update([("a", 5)], [("a", TOKEN)])
    s.check_invariants()
    assert s.update(*report(plan)) == []  # the plan survived the bad reports
    with pytest.raises(SchedulerError, match="not planned"):
        s.update([], [("a", TOKEN)])


def test_bad_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens must be at least"):
        make(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="prefill_chunk"):
        make(prefill_chunk=0)
    s = make()
    with pytest.raises(ValueError, match="empty"):
        s.add_request("a", 0, 10)
    with pytest.raises(ValueError, match="leaves no room"):
        s.add_request("a", 65, 10)  # 64 tokens of KV: at most 64 per sequence
    with pytest.raises(ValueError, match="unknown finish reason"):
        s.finish("a", "stop")
    with pytest.raises(OverflowError):
        s.add_request("a", -1, 10)
    assert s.num_waiting == 0


def test_snapshot_from_another_thread_while_stepping() -> None:
    s = make(kv_capacity_tokens=40)
    for i in range(8):
        s.add_request(f"r{i}", 6, 20)
    stop = threading.Event()
    errors: list[BaseException] = []

    def poll() -> None:
        try:
            while not stop.is_set():
                rows = s.snapshot()
                assert all(status != "finished" for _, status, _, _ in rows)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        ended = 0
        for _ in range(1000):
            ended += len(step(s)[1])
            if ended == 8:
                break
    finally:
        stop.set()
        poller.join()
    assert errors == []
    assert ended == 8


# --- random sequences -----------------------------------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(0, 12)),
        st.tuples(st.just("step"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(False)),
        st.tuples(st.just("finish"), st.integers(0, 50), st.just(False)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    max_num_seqs=st.integers(1, 4),
    extra_budget=st.integers(0, 10),
    prefill_chunk=st.integers(1, 10),
    kv_capacity_tokens=st.integers(4, 48),
    context_length=st.integers(3, 60),
    ops=ops,
)
def test_every_request_ends_exactly_once(
    max_num_seqs: int,
    extra_budget: int,
    prefill_chunk: int,
    kv_capacity_tokens: int,
    context_length: int,
    ops: list[tuple[str, int, int | bool]],
) -> None:
    budget = max_num_seqs + extra_budget
    s = Scheduler(max_num_seqs, budget, prefill_chunk, kv_capacity_tokens, context_length)
    added: list[str] = []
    ended: Counter[str] = Counter()

    def run_step(token: int) -> None:
        plan = s.schedule()
        assert plan.num_tokens <= budget
        assert s.num_running <= max_num_seqs
        for rid, reason in s.update(*report(plan, lambda _: token)):
            assert reason in {"stop_token", "max_tokens", "context_full"}
            ended[rid] += 1

    for op, a, b in ops:
        if op == "add":
            rid = f"r{len(added)}"
            try:
                s.add_request(rid, a, int(b), [0])
            except ValueError:
                continue  # the prompt does not fit this configuration
            added.append(rid)
        elif op == "step":
            run_step(a)
        elif added:
            rid = added[a % len(added)]
            was_live = s.abort(rid) if op == "abort" else s.finish(rid, "external")
            ended[rid] += was_live
        s.check_invariants()
    for _ in range(5000):
        if s.num_running + s.num_waiting == 0:
            break
        run_step(TOKEN)
        s.check_invariants()
    assert s.num_running + s.num_waiting == 0, s.snapshot()
    assert s.kv_tokens_used == 0
    assert ended == Counter(added)
    assert all(n == 1 for n in ended.values())
