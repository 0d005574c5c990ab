"""The engine thread on the real embedded model: tokens, stops, aborts, limits, faults."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from compat_serve.engine.config import EngineConfig
from compat_serve.engine.detokenizer import IncrementalDetokenizer
from compat_serve.engine.engine import Engine
from compat_serve.engine.errors import EngineOverloaded, PromptTooLong
from compat_serve.engine.types import EngineEvent, EngineRequest, FinishReason, SamplingParams
from tests.chat_prompts import chat_ids
from tests.greedy_ties import assert_same_or_near_tie

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

CORPUS = [
    "def f(x):\n    return x ** 2  # square\n",
    "Prices: 1234567890, 3.14159, -42e10",
    "Emoji 🎉🚀👩‍👩‍👧 and flags 🇫🇷",
    "中文字符和日本語のテキスト、한국어",
    "  leading spaces\t\ttabs\n\n\nnewlines  ",
    "naïve café résumé — “quotes” …",
]


@pytest.fixture
def engine(embedded_model: LoadedModel) -> Iterator[Engine]:
    eng = Engine(embedded_model, EngineConfig(prefill_chunk=64, max_queue=4))
    eng.start()
    yield eng
    eng.shutdown()


async def run(engine: Engine, request: EngineRequest) -> list[EngineEvent]:
    stream = engine.submit(request)
    return [event async for event in stream]


@pytest.mark.parametrize("text", CORPUS)
def test_detokenizer_never_splits_characters(embedded_model: LoadedModel, text: str) -> None:
    tokenizer = embedded_model.tokenizer
    detok = IncrementalDetokenizer(tokenizer, frozenset(tokenizer.special_token_ids))
    deltas = [detok.add(t) for t in tokenizer.encode(text)]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_detokenizer_shows_only_visible_special_tokens(embedded_model: LoadedModel) -> None:
    tokenizer = embedded_model.tokenizer
    specials = frozenset(tokenizer.special_token_ids)
    start, end = tokenizer.encode("<|im_start|>"), tokenizer.encode("<|im_end|>")
    assert len(start) == len(end) == 1 and start[0] in specials and end[0] in specials
    ids = [*tokenizer.encode("héllo "), start[0], *tokenizer.encode("wörld"), end[0]]

    def render(visible: frozenset[int]) -> str:
        detok = IncrementalDetokenizer(tokenizer, specials, visible)
        return "".join(detok.add(t) for t in ids) + detok.flush()

    assert render(frozenset()) == "héllo wörld"
    assert render(frozenset(start)) == "héllo <|im_start|>wörld"
    assert render(frozenset(start + end)) == "héllo <|im_start|>wörld<|im_end|>"


def test_greedy_tokens_match_mlx_lm_generate_step(
    engine: Engine, embedded_model: LoadedModel
) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    ids = chat_ids(embedded_model, "Name three colours.")
    reference = [
        tok for tok, _ in generate_step(mx.array(ids), embedded_model.model, max_tokens=12)
    ]
    events = asyncio.run(
        run(engine, EngineRequest("r1", ids, SamplingParams(max_tokens=12, temperature=0)))
    )
    produced = [t for e in events for t in e.token_ids]
    final = events[-1]
    # Our token ids are reported for emitted text; the final stop token is not shown.
    if final.finish_reason is FinishReason.STOP_TOKEN:
        produced.append(final.stop_token_id)  # type: ignore[arg-type]
    assert_same_or_near_tie(embedded_model, ids, reference[: len(produced)], produced)
    assert final.usage is not None and final.usage.completion_tokens == len(produced)


def test_max_tokens_zero_processes_prompt_only(engine: Engine, embedded_model: LoadedModel) -> None:
    ids = chat_ids(embedded_model, "hello")
    events = asyncio.run(run(engine, EngineRequest("r0", ids, SamplingParams(max_tokens=0))))
    assert len(events) == 1
    assert events[0].finish_reason is FinishReason.LENGTH
    assert events[0].usage is not None
    assert events[0].usage.completion_tokens == 0
    assert events[0].usage.prompt_tokens == len(ids)


def test_abort_during_prefill_frees_the_request(
    engine: Engine, embedded_model: LoadedModel
) -> None:
    ids = chat_ids(embedded_model, "word " * 1500)
    assert len(ids) > 1000

    async def scenario() -> list[EngineEvent]:
        stream = engine.submit(EngineRequest("long", ids, SamplingParams(max_tokens=4)))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            rows = engine.status.snapshot()
            if rows and rows[0]["computed_tokens"] > 0:
                break
            await asyncio.sleep(0.01)
        stream_events = []
        engine.abort("long")
        async for event in stream:
            stream_events.append(event)
        return stream_events

    started = time.monotonic()
    events = asyncio.run(scenario())
    assert events[-1].finish_reason is FinishReason.ABORTED
    assert engine.status.snapshot() == []
    # Far less than the ~10 s a full 1.5k-token prefill takes here.
    assert time.monotonic() - started < 5


def test_prompt_too_long_is_refused(engine: Engine, embedded_model: LoadedModel) -> None:
    too_long = tuple([1] * embedded_model.context_length)

    async def submit() -> None:
        engine.submit(EngineRequest("big", too_long, SamplingParams(max_tokens=1)))

    with pytest.raises(PromptTooLong) as info:
        asyncio.run(submit())
    assert info.value.prompt_tokens == embedded_model.context_length
    assert info.value.context_length == embedded_model.context_length - 1


def test_queue_limit_raises_overloaded(engine: Engine, embedded_model: LoadedModel) -> None:
    ids = chat_ids(embedded_model, "hi")

    async def flood() -> None:
        streams = [
            engine.submit(EngineRequest(f"q{i}", ids, SamplingParams(max_tokens=2)))
            for i in range(engine.config.max_queue)
        ]
        with pytest.raises(EngineOverloaded):
            engine.submit(EngineRequest("one-too-many", ids, SamplingParams(max_tokens=2)))
        for stream in streams:
            async for _ in stream:
                pass

    asyncio.run(flood())


def test_engine_survives_a_failing_request(
    engine: Engine, embedded_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = chat_ids(embedded_model, "hi")
    runner = engine._runner
    real = runner.last_logits
    calls = {"n": 0}

    def fail_once(cache, token_ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real(cache, token_ids, *args, **kwargs)

    monkeypatch.setattr(runner, "last_logits", fail_once)
    failed = asyncio.run(run(engine, EngineRequest("bad", ids, SamplingParams(max_tokens=3))))
    assert failed[-1].finish_reason is FinishReason.ERROR
    assert "injected fault" in (failed[-1].error or "")
    ok = asyncio.run(run(engine, EngineRequest("good", ids, SamplingParams(max_tokens=3))))
    assert ok[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP_TOKEN)


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token() -> None:
    """top_p 5e-324 is 0 in float32: every token used to be dropped and the threshold read
    past the end, so a grammar-masked (-inf) token could be drawn (found by schemathesis)."""
    import mlx.core as mx

    from compat_serve.engine.sampling import RequestSampler
    from compat_serve.engine.types import SamplingParams

    logits = mx.full((1, 64), -float("inf"))
    logits[0, 7] = 0.5
    logits[0, 9] = 0.25
    sampler = RequestSampler(SamplingParams(max_tokens=1, temperature=1.0, top_p=5e-324, seed=1))
    assert {int(sampler(logits).item()) for _ in range(20)} == {7}
