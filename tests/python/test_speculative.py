"""Speculative decoding (engine/speculation.py): prompt-lookup drafts verified in the
batched engine give the same tokens as plain decoding — alone, batched with mixed rows,
with stop strings and a JSON-schema grammar — rollback keeps every row's cache exact,
and the sampling rule preserves the target distribution."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import pytest

from compat_serve.engine.batch import can_rollback
from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.sampling import accept_draft
from compat_serve.engine.speculation import NGramDrafter, RowState, SpeculationConfig
from compat_serve.engine.step_costs import StepCosts
from compat_serve.engine.types import EngineEvent, EngineRequest, FinishReason, Grammar
from compat_serve.engine.verify_rollback import verify_can_roll_back
from compat_serve.parsers.events import ToolCallArgsDelta, ToolCallStart
from compat_serve.parsers.registry import resolve_tool_format
from compat_serve.parsers.tool_calls import ToolCallParser
from tests.greedy_ties import assert_same_as_engine_or_near_tie, assert_same_or_near_tie
from tests.python.rollback_rows import KEPT, rolled_back_and_exact
from tests.python.test_batching import chat_ids, greedy
from tests.tiny_models import HYBRID_CONFIGS, SLIDING_WINDOW, tiny_model

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

PASSAGE = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step. All that glitters is not gold."
)
CODE = (
    "def add(a, b):\n    return a + b\n\n\n"
    "def scale(values, factor):\n    return [v * factor for v in values]\n"
)
COPY_PROMPTS = [
    f"Repeat this text exactly:\n{PASSAGE}",
    f"Rewrite this Python code adding type hints:\n{CODE}",
]
FREE_PROMPT = "Name three colours."
HYBRID_TOKENS = 24  # decoded per row on sliding-window and hybrid models


def spec_engine(loaded: LoadedModel, mode: str = "ngram", **config: Any) -> Engine:
    engine = Engine(
        loaded,
        EngineConfig(
            prefill_chunk=128,
            max_num_seqs=8,
            prefix_cache=False,
            # Verify every draft: the cost policy times steps, so what it drafts depends
            # on the machine's load (its own tests are test_step_costs_*).
            speculation=SpeculationConfig(mode, num_tokens=4, cost_aware=False),
            **config,
        ),
    )
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engines(embedded_model: LoadedModel) -> Iterator[tuple[Engine, Engine]]:
    plain, spec = spec_engine(embedded_model, "off"), spec_engine(embedded_model)
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


async def run(engine: Engine, request: EngineRequest) -> list[EngineEvent]:
    return [event async for event in engine.submit(request)]


def outputs(engine: Engine, requests: list[EngineRequest]) -> list[list[EngineEvent]]:
    async def all_of() -> list[list[EngineEvent]]:
        return list(await asyncio.gather(*(run(engine, r) for r in requests)))

    return asyncio.run(all_of())


def tokens(events: list[EngineEvent]) -> list[int]:
    final = events[-1]
    assert final.finish_reason is not FinishReason.ERROR, final.error
    out = [t for e in events for t in e.token_ids]
    return out + ([final.stop_token_id] if final.stop_token_id is not None else [])


def requests(loaded: LoadedModel, tag: str, max_tokens: int = 32, **extra: Any) -> list[Any]:
    prompts = [*COPY_PROMPTS, FREE_PROMPT]
    return [
        EngineRequest(f"{tag}{i}", chat_ids(loaded, text), greedy(max_tokens, **extra))
        for i, text in enumerate(prompts)
    ]


def assert_telemetry_adds_up(status: dict[str, Any], depth: int, metrics: str) -> None:
    """The per-position counts add up to the totals, a verified row emitted its accepted
    drafts plus one token (less what followed its request's end: the model's token after
    an accepted stop token, drafts after a stop string), and the depths stay within
    `depth`."""
    positions = status["positions"]
    assert [p["position"] for p in positions] == list(range(1, len(positions) + 1))
    assert sum(p["draft_tokens"] for p in positions) == status["draft_tokens"], status
    assert sum(p["accepted_tokens"] for p in positions) == status["accepted_tokens"], status
    assert all(0 <= p["accepted_tokens"] <= p["draft_tokens"] for p in positions), status
    emitted = status["emitted_tokens"]
    assert status["verified_rows"] <= emitted <= status["accepted_tokens"] + status["verified_rows"]
    assert 1 <= len(positions) <= depth, status
    drafted = status["draft_depth"]
    assert drafted["max"] == depth and 1 <= drafted["last"] <= depth, status
    # Each drafting row proposed position 1: the mean depth is drafted over those rows.
    assert drafted["mean"] == round(status["draft_tokens"] / positions[0]["draft_tokens"], 3)
    widths = {c["width"] for c in status["step_costs"]}
    assert widths and max(widths) <= depth + 1, status
    # /metrics has the same counts per position.
    lines = set(metrics.splitlines())
    for p in positions:
        label = f'{{position="{p["position"]}"}}'
        assert f"compat_spec_position_draft_tokens_total{label} {p['draft_tokens']}" in lines
        assert f"compat_spec_position_accepted_tokens_total{label} {p['accepted_tokens']}" in lines
    assert f"compat_spec_draft_depth {depth}" in lines


def test_greedy_output_is_the_same_alone_and_batched_with_mixed_rows(
    engines: tuple[Engine, Engine], embedded_model: LoadedModel
) -> None:
    plain, spec = engines
    reqs = requests(embedded_model, "g")
    expected = [tokens(e) for e in outputs(plain, reqs)]
    # The first row alone, watched: /v1/status shows the request's own counters.
    alone = EngineRequest("g-status", reqs[0].prompt_ids, reqs[0].sampling)

    async def watched() -> tuple[list[EngineEvent], list[dict[str, Any]]]:
        events, rows = [], []
        async for event in spec.submit(alone):
            events.append(event)
            rows += [r for r in spec.status.snapshot() if r["request_id"] == "g-status"]
        return events, rows

    events, rows = asyncio.run(watched())
    together = [tokens(e) for e in outputs(spec, reqs)]
    assert_same_or_near_tie(embedded_model, reqs[0].prompt_ids, expected[0], tokens(events))
    for request, want, got in zip(reqs, expected, together, strict=True):
        assert_same_or_near_tie(embedded_model, request.prompt_ids, want, got)
    status = spec.speculation_status()
    assert status["accepted_tokens"] > 20, status  # the copy prompts were drafted
    assert_telemetry_adds_up(status, 4, spec.metrics.render())
    # Usage counts every emitted token once.
    final = events[-1]
    assert final.usage is not None and final.usage.completion_tokens == len(tokens(events))
    assert rows and rows[-1]["accepted_tokens"] > 0
    assert all(0 <= r["accepted_tokens"] <= r["draft_tokens"] for r in rows)


def test_stop_strings_and_max_tokens_end_at_the_same_token(
    engines: tuple[Engine, Engine], embedded_model: LoadedModel
) -> None:
    plain, spec = engines
    reqs = requests(embedded_model, "s", max_tokens=30, stop_strings=("lazy", "factor"))
    reqs += requests(embedded_model, "m", max_tokens=7)
    want = outputs(plain, reqs)
    got = outputs(spec, reqs)
    for request, w, g in zip(reqs, want, got, strict=True):
        if assert_same_or_near_tie(embedded_model, request.prompt_ids, tokens(w), tokens(g)):
            continue  # parted on a near tie: the texts after it are not comparable
        assert "".join(e.text for e in w) == "".join(e.text for e in g)
        ends = [(e[-1].finish_reason, e[-1].matched_stop) for e in (w, g)]
        assert ends[0] == ends[1]


def test_json_schema_constraint_stays_exact(
    engines: tuple[Engine, Engine], embedded_model: LoadedModel
) -> None:
    plain, spec = engines
    schema = {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"enum": ["alpha", "beta"]}, "maxItems": 4}
        },
        "required": ["items"],
    }
    prompt = 'Answer in JSON: {"items": ["alpha", "beta", "alpha", "beta", "alpha"]}'
    reqs = [
        EngineRequest(
            f"j{i}",
            chat_ids(embedded_model, prompt),
            greedy(40),
            grammar=Grammar("json_schema", json.dumps(schema)),
        )
        for i in range(2)
    ]
    reqs.append(requests(embedded_model, "jx")[0])  # an unconstrained row beside them
    want = [tokens(e) for e in outputs(plain, reqs)]
    got_events = outputs(spec, reqs)
    got = [tokens(e) for e in got_events]
    for request, w, g in zip(reqs, want, got, strict=True):
        # The reference's margin among the tokens its grammar allows (its own logprobs).
        assert_same_as_engine_or_near_tie(plain, request, w, g)
    text = "".join(e.text for e in got_events[0])
    assert isinstance(json.loads(text)["items"], list)


def test_tool_call_output_parses_the_same(
    engines: tuple[Engine, Engine], embedded_model: LoadedModel
) -> None:
    """The model copies a tool call (its reply prefilled with the call's start): the
    hermes parser sees the same text and the same call with and without speculation."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    head = '<tool_call>\n{"name": "get_weather", "arguments": {"city":'
    prompt = chat_ids(embedded_model, f"Output exactly this and nothing else:\n{call}")
    prompt += tuple(embedded_model.tokenizer.encode(head))
    plain, spec = engines
    req = EngineRequest("t", prompt, greedy(24))
    want, got = outputs(plain, [req])[0], outputs(spec, [req])[0]
    if assert_same_or_near_tie(embedded_model, prompt, tokens(want), tokens(got)):
        return  # parted on a near tie: the texts after it are not comparable
    assert "".join(e.text for e in want) == "".join(e.text for e in got)
    fmt = resolve_tool_format("hermes", None)
    assert fmt is not None
    tools = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}
    parsed = []
    for events in (want, got):
        parser = ToolCallParser(fmt, tools, new_id=lambda: "call_0")
        out = [*parser.feed(head), *(o for e in events for o in parser.feed(e.text))]
        parsed.append(out + parser.finish())
    assert parsed[0] == parsed[1]
    starts = [o for o in parsed[1] if isinstance(o, ToolCallStart)]
    assert [s.name for s in starts] == ["get_weather"], parsed[1]
    arguments = "".join(o.fragment for o in parsed[1] if isinstance(o, ToolCallArgsDelta))
    assert json.loads(arguments) == {"city": "Paris"}


# ---- rollback on every cache type -----------------------------------------------------


def test_rollback_of_rows_with_different_rejections_matches_an_exact_cache(
    embedded_model: LoadedModel,
) -> None:
    """Three rows verify drafts of different lengths; after the rollback each row's
    next logits equal those of a cache that only ever saw the accepted tokens."""
    from compat_serve.engine.runner import ModelRunner

    runner = ModelRunner(embedded_model)
    prompts = [list(chat_ids(embedded_model, t)) for t in ("Hi", "Count to five please", "Go")]
    batch, rolled, exact = rolled_back_and_exact(runner, prompts)
    assert mx.abs(rolled - exact).max().item() < 1e-3
    for layer in batch.cache:
        assert layer.offset.tolist() == [len(p) + k + 1 for p, k in zip(prompts, KEPT, strict=True)]


@pytest.mark.parametrize("model_type", ["gemma3_text", *sorted(HYBRID_CONFIGS)])
def test_rollback_on_windows_and_recurrent_state_matches_an_exact_cache(
    model_type: str, embedded_model: LoadedModel
) -> None:
    """The same three rows on a sliding-window model (prompts longer than the window:
    it has wrapped) and on hybrids with recurrent layers (engine/verify_rollback.py)."""
    from compat_serve.engine.runner import ModelRunner

    loaded = tiny_model(model_type, embedded_model)
    runner = ModelRunner(loaded)
    assert verify_can_roll_back(runner.new_cache()) and not can_rollback(runner.new_cache())
    texts = (FREE_PROMPT, COPY_PROMPTS[0], "Go")
    prompts = [list(chat_ids(loaded, t)) for t in texts]
    assert max(len(p) for p in prompts) > SLIDING_WINDOW
    _, rolled, exact = rolled_back_and_exact(runner, prompts)
    assert mx.abs(exact).max().item() > 0.1
    assert mx.abs(rolled - exact).max().item() < 1e-3


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_next"])
def test_windows_and_recurrent_state_speculate_with_greedy_output_unchanged(
    model_type: str, embedded_model: LoadedModel
) -> None:
    """Prompt-lookup drafts on a sliding-window model and on a hybrid with recurrent
    layers, three rows of different lengths in one batch (two shorter than the window,
    which wraps while they decode): the tokens of plain decoding, with drafts accepted
    and rejected on the way. A 48-token vocabulary (random prompts in it) makes a random
    model's output repeat itself enough for prompt lookup to draft."""
    loaded = tiny_model(model_type, embedded_model, seed=3, overrides={"vocab_size": 48})
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 48, n).tolist() for n in (14, 40, 9)]
    assert min(map(len, prompts)) < SLIDING_WINDOW - HYBRID_TOKENS // 2 < SLIDING_WINDOW < 40
    reqs = [
        EngineRequest(f"w{i}", p, greedy(HYBRID_TOKENS, stop_at_eos=False))
        for i, p in enumerate(prompts)
    ]
    got: dict[str, list[list[int]]] = {}
    for mode in ("off", "ngram"):
        # One-token matches draft (more drafts, more of them rejected).
        spec = SpeculationConfig(mode, num_tokens=4, ngram_min=1, cost_aware=False)
        config = EngineConfig(prefill_chunk=128, prefix_cache=False, speculation=spec)
        engine = Engine(loaded, config)
        engine.start()
        try:
            got[mode] = [tokens(e) for e in outputs(engine, reqs)]
            status = engine.speculation_status()
        finally:
            engine.shutdown()
    assert status["mode"] == "ngram" and status["disabled_reason"] is None, status
    drafted, accepted = int(status["draft_tokens"]), int(status["accepted_tokens"])  # type: ignore[call-overload]
    assert 0 < accepted < drafted, status  # both paths of the rollback ran
    for request, want, have in zip(reqs, got["off"], got["ngram"], strict=True):
        assert len(want) == HYBRID_TOKENS
        assert_same_or_near_tie(loaded, request.prompt_ids, want, have)


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_next"])
def test_windows_and_recurrent_state_speculate_through_the_prefix_cache(
    model_type: str, embedded_model: LoadedModel
) -> None:
    """The same models with the prefix cache on: a second turn (prompt, first answer, a
    new message) and its repeat, read from the cache's blocks and state points, decode
    with drafts as without them (the rollback leaves only accepted tokens behind)."""
    loaded = tiny_model(model_type, embedded_model, seed=3, overrides={"vocab_size": 48})
    rng = np.random.default_rng(0)
    first_prompts = [rng.integers(3, 48, n).tolist() for n in (14, 40, 9)]
    sampling = greedy(HYBRID_TOKENS, stop_at_eos=False)
    firsts = [EngineRequest(f"a{i}", p, sampling) for i, p in enumerate(first_prompts)]
    got: dict[str, list[list[int]]] = {}
    # Second turns and their repeats, built from plain decoding's first answers.
    later: list[EngineRequest] = []
    for mode in ("off", "ngram"):
        spec = SpeculationConfig(mode, num_tokens=4, ngram_min=1, cost_aware=False)
        engine = Engine(loaded, EngineConfig(prefill_chunk=16, block_size=16, speculation=spec))
        engine.start()
        try:
            got[mode] = [tokens(e) for e in outputs(engine, firsts)]
            if not later:
                second = [p + f + [5, 6, 7] for p, f in zip(first_prompts, got[mode], strict=True)]
                later = [
                    EngineRequest(f"{t}{i}", p, sampling)
                    for t in "bc"
                    for i, p in enumerate(second)
                ]
            got[mode] += [tokens(e) for e in outputs(engine, later[:3])]
            got[mode] += [tokens(e) for e in outputs(engine, later[3:])]
            status = engine.speculation_status()
            assert engine.prefix is not None and engine.prefix.metrics()["hit_tokens"] > 0
        finally:
            engine.shutdown()
    assert int(status["draft_tokens"]) > 0, status  # type: ignore[call-overload]
    for request, want, have in zip([*firsts, *later], got["off"], got["ngram"], strict=True):
        assert_same_or_near_tie(loaded, request.prompt_ids, want, have)


# ---- drafter and sampling rule ----------------------------------------------------------


def test_ngram_drafter_proposes_what_followed_the_latest_longest_match() -> None:
    drafter = NGramDrafter(2, 3)
    seq = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # Suffix [1, 2, 3] occurred at the start: 4, 5 follow.
    assert drafter.propose("a", seq, 2) == [4, 5]
    # [6, 2, 3] never occurred; [2, 3] last occurred before the 4, 5, 6 just added.
    assert drafter.propose("a", [*seq, 4, 5, 6, 2, 3], 3) == [4, 5, 6]
    assert drafter.propose("b", [1, 2, 3], 3) == []
    state = RowState(4)
    state.record(4, 0)
    state.record(2, 0)
    assert state.k == 1 and not state.wants_draft()


@pytest.mark.parametrize("deterministic", [True, False])
def test_speculative_sampling_rule_keeps_the_target_distribution(deterministic: bool) -> None:
    """Tokens emitted at the first drafted position follow p exactly, whatever q."""
    rng = np.random.default_rng(0)
    p = np.array([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]], dtype=np.float32)
    q = np.array([[0.1, 0.2, 0.3, 0.4]], dtype=np.float32)
    n = 40_000
    counts = np.zeros(4)
    for _ in range(n):
        if deterministic:
            draft, q_rows = [2], None
        else:
            draft, q_rows = [int(rng.choice(4, p=q[0]))], q
        counts[accept_draft(p, draft, rng, q_rows)[0]] += 1
    observed = counts / n
    assert np.abs(observed - p[0]).max() < 0.01, observed


# ---- cost-aware policy -----------------------------------------------------------------


def test_step_costs_draft_only_when_the_expected_tokens_pay_for_the_verify() -> None:
    drafts = [[1, 2, 3, 4], [5, 6], []]
    costs = StepCosts()
    assert costs.choose_width(drafts, [0.5] * 3) == 1  # nothing measured: the narrowest
    costs.observe(3, 5, 0.2)
    assert costs.choose_width(drafts, [0.5] * 3) == 0  # then measure a plain step
    costs.observe(3, 1, 0.1)
    assert costs.estimate(3, 3) == pytest.approx(0.15)  # between measured neighbours
    assert costs.estimate(3, 9) == 0.2  # no less than a narrower one
    for width in (2, 3, 4):
        costs.observe(3, width, 0.2)
    # A verify step costs twice a plain one (this CPU): 3 rows emit 3 tokens plainly;
    # drafts right 90% of the time emit ~7.8 at cap 4, drafts right 10% of the time ~3.2.
    assert costs.choose_width(drafts, [0.9, 0.9, 0.0]) == 4
    assert costs.choose_width(drafts, [0.1, 0.1, 0.1]) == 0
    # Widths are climbed one at a time while they pay.
    climb = StepCosts()
    for width in (2, 3, 4):
        assert climb.choose_width(drafts, [0.9] * 3) == width - 1
        climb.observe(3, width, 0.11)
        if width == 2:
            assert climb.choose_width(drafts, [0.9] * 3) == 0  # a plain step, measured
            climb.observe(3, 1, 0.1)
    # Where a verify costs about one step (a GPU), even a poor draft pays.
    gpu = StepCosts()
    gpu.observe(3, 1, 0.1)
    for width in (2, 3, 4, 5):
        gpu.observe(3, width, 0.101)
    assert gpu.choose_width(drafts, [0.2, 0.2, 0.2]) == 4
    assert set(gpu.status()) == {"3x1", "3x2", "3x3", "3x4", "3x5"}
    # A batch size that stopped verifying tries again (a load spike must not stick),
    # after 64 plain steps, then after 128, the shape it measured least recently; never
    # for drafts that cannot gain 10%.
    costs.observe(3, 5, 0.2)  # the last verify at 3 rows; widths 2, 3, 4 are older
    for wait, width in ((StepCosts.REEXPLORE_FIRST, 2), (2 * StepCosts.REEXPLORE_FIRST, 3)):
        for _ in range(wait - 1):
            assert costs.choose_width(drafts, [0.5, 0.5, 0.5]) == 0
        assert costs.choose_width(drafts, [0.5, 0.5, 0.5]) == width - 1
        costs.observe(3, width, 0.2)
    # Costs are medians of recent steps: one spike does not move them.
    costs.observe(3, 5, 5.0)
    assert costs.estimate(3, 5) == 0.2
    assert all(costs.choose_width(drafts, [0.01] * 3) == 0 for _ in range(300))


def test_row_rate_follows_recent_acceptance() -> None:
    state = RowState(4)
    assert state.rate == 0.5
    for _ in range(5):
        state.record(4, 4)
    high = state.rate
    for _ in range(10):
        state.record(1, 0)
    assert high > 0.9 and state.rate < 0.4
