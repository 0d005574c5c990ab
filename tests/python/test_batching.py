"""Continuous batching on real models: many requests decode in one forward pass and each
still gets exactly what it would get alone, with its own sampling settings.

Each request's output is compared with its own run alone on the same engine, so what the
model says does not matter: the fallback, sampling and preemption tests run on the tiny
random llama (tests/tiny_models.py) at a fraction of the embedded model's compute; the
embedded model keeps the batched-prefill equality and the request arriving mid-batch
(whose point needs decode steps slow enough to overlap)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.types import EngineEvent, EngineRequest, FinishReason, SamplingParams
from tests.chat_prompts import chat_ids
from tests.greedy_ties import assert_same_or_near_tie
from tests.tiny_models import HYBRID_CONFIGS, tiny_model

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

PROMPTS = [
    "Name three colours.",
    "What is 2+2?",
    "Write a haiku about rain.",
    "Who wrote Hamlet?",
    "List five fruits.",
    "Explain gravity briefly.",
    "Say hello in French.",
    "Count to ten.",
]


def greedy(max_tokens: int, **extra: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **extra)


class DecodeSpy:
    """Wraps the engine's real batched decode to record how many rows each step had."""

    def __init__(self, engine: Engine) -> None:
        self.rows: list[int] = []
        runner = engine._runner  # observed, not replaced
        real = runner.decode_logits

        def spy(cache: Any, tokens: Any) -> Any:
            self.rows.append(len(tokens))
            return real(cache, tokens)

        runner.decode_logits = spy  # type: ignore[method-assign]


class PrefillTogetherSpy:
    """Wraps the engine's batched prefill to record how many requests each call took;
    `fail` makes it raise instead (the engine must then prefill each request alone)."""

    def __init__(self, engine: Engine, *, fail: bool = False) -> None:
        self.rows: list[int] = []
        runner = engine._runner  # observed, not replaced
        real = runner.last_logits_together

        def spy(caches: Any, token_lists: Any) -> Any:
            self.rows.append(len(token_lists))
            if fail:
                raise RuntimeError("injected: batched prefill failed")
            return real(caches, token_lists)

        runner.last_logits_together = spy  # type: ignore[method-assign]


def started(loaded: LoadedModel, **config: Any) -> Engine:
    engine = Engine(loaded, EngineConfig(**config))
    engine.start()
    return engine


@pytest.fixture
def engine(embedded_model: LoadedModel) -> Iterator[Engine]:
    eng = started(embedded_model, prefill_chunk=64, max_num_seqs=8)
    yield eng
    eng.shutdown()


async def tokens_of(engine: Engine, request: EngineRequest) -> list[int]:
    events = [event async for event in engine.submit(request)]
    final = events[-1]
    assert final.finish_reason is not FinishReason.ERROR, final.error
    produced = [t for e in events for t in e.token_ids]
    if final.stop_token_id is not None:
        produced.append(final.stop_token_id)
    return produced


def run_alone_then_together(
    engine: Engine, requests: list[EngineRequest]
) -> tuple[list[list[int]], list[list[int]]]:
    async def both() -> tuple[list[list[int]], list[list[int]]]:
        alone = [await tokens_of(engine, r) for r in requests]
        renamed = [EngineRequest(f"{r.request_id}-b", r.prompt_ids, r.sampling) for r in requests]
        together = await asyncio.gather(*(tokens_of(engine, r) for r in renamed))
        return alone, list(together)

    return asyncio.run(both())


def test_eight_concurrent_greedy_streams_match_each_run_alone(
    engine: Engine, embedded_model: LoadedModel
) -> None:
    spy, prefills = DecodeSpy(engine), PrefillTogetherSpy(engine)
    requests = [
        EngineRequest(f"g{i}", chat_ids(embedded_model, text), greedy(16))
        for i, text in enumerate(PROMPTS)
    ]
    alone, together = run_alone_then_together(engine, requests)
    batched_rows = spy.rows[sum(len(t) for t in alone) - len(alone) :]
    assert max(batched_rows) >= 6, f"the requests were not batched: {batched_rows}"
    # Requests admitted in the same step prefill together (their prompts are cached from
    # the runs alone, so each brings a restored prefix of its own length).
    assert max(prefills.rows, default=0) >= 4, f"prefills together: {prefills.rows}"
    for request, a, b in zip(requests, alone, together, strict=True):
        assert_same_or_near_tie(embedded_model, request.prompt_ids, a, b)


def test_a_failed_batched_prefill_falls_back_to_one_request_at_a_time(
    tiny_llama_model: LoadedModel,
) -> None:
    model = tiny_llama_model
    engine = started(model, prefill_chunk=64, max_num_seqs=8, prefix_cache=False)
    try:
        prefills = PrefillTogetherSpy(engine, fail=True)
        requests = [
            EngineRequest(f"f{i}", chat_ids(model, text), greedy(6))
            for i, text in enumerate(PROMPTS[:4])
        ]
        alone, together = run_alone_then_together(engine, requests)
        assert prefills.rows, "no batched prefill was attempted"
        for request, a, b in zip(requests, alone, together, strict=True):
            assert_same_or_near_tie(model, request.prompt_ids, a, b)
    finally:
        engine.shutdown()


def test_prompts_prefilled_together_match_each_alone(embedded_model: LoadedModel) -> None:
    """`last_logits_together` against `last_logits` per request: fresh caches and restored
    prefixes of different lengths, then one decode step on the caches it returns."""
    import mlx.core as mx

    from compat_serve.engine.batch import merge_caches
    from compat_serve.engine.runner import ModelRunner

    runner = ModelRunner(embedded_model)
    prompts = [list(chat_ids(embedded_model, text)) for text in PROMPTS[:4]]
    prefixes = [[], [], prompts[2][:5], prompts[3][:9]]

    def caches() -> list[Any]:
        made = []
        for prefix in prefixes:
            cache = runner.new_cache()
            if prefix:
                runner.prefill(cache, prefix)
            made.append(cache)
        return made

    alone_caches = caches()
    rest = [p[len(prefix) :] for p, prefix in zip(prompts, prefixes, strict=True)]
    alone = mx.concatenate(
        [runner.last_logits(c, t) for c, t in zip(alone_caches, rest, strict=True)]
    )
    given = caches()
    together, own = runner.last_logits_together(given, rest)
    assert mx.abs(together - alone).max().item() < 1e-4
    assert [c[0].offset for c in own] == [len(p) for p in prompts]
    assert [c[0].offset for c in given] == [len(p) for p in prefixes]  # not modified
    step = [5, 6, 7, 8]
    after_alone = runner.decode_logits(merge_caches(alone_caches), step)
    after_together = runner.decode_logits(merge_caches(own), step)
    assert mx.abs(after_together - after_alone).max().item() < 1e-4


def test_each_request_in_a_batch_follows_its_own_sampling_settings(
    tiny_llama_model: LoadedModel,
) -> None:
    engine = started(tiny_llama_model, prefill_chunk=64, max_num_seqs=8)
    try:
        check_sampling_settings(engine, tiny_llama_model)
    finally:
        engine.shutdown()


def check_sampling_settings(engine: Engine, model: LoadedModel) -> None:
    prompt = chat_ids(model, "Tell me a story about a dragon.")
    hot = {"temperature": 1.0, "stop_at_eos": False}
    n = 12  # at temperature 1, two seeds part within a few tokens
    settings = {
        "greedy": greedy(n, stop_at_eos=False),
        "seed1": SamplingParams(max_tokens=n, seed=1, **hot),  # type: ignore[arg-type]
        "seed1-again": SamplingParams(max_tokens=n, seed=1, **hot),  # type: ignore[arg-type]
        "seed2": SamplingParams(max_tokens=n, seed=2, **hot),  # type: ignore[arg-type]
        "top-k-1": SamplingParams(max_tokens=n, top_k=1, seed=3, **hot),  # type: ignore[arg-type]
    }
    requests = [EngineRequest(name, prompt, params) for name, params in settings.items()]
    spy = DecodeSpy(engine)
    alone, together = run_alone_then_together(engine, requests)
    assert max(spy.rows) == len(settings)
    out = dict(zip(settings, together, strict=True))
    by_itself = dict(zip(settings, alone, strict=True))
    assert out == by_itself  # every setting reproduces its solo run inside the batch
    assert out["seed1"] == out["seed1-again"]
    assert out["seed1"] != out["seed2"]
    assert out["seed1"] != out["greedy"]
    assert out["top-k-1"] == out["greedy"]


def test_a_request_arriving_mid_batch_starts_without_waiting(
    engine: Engine, embedded_model: LoadedModel
) -> None:
    # 32 tokens: the short request (a prefill and 4 tokens) takes about 6 of its steps.
    long_request = EngineRequest(
        "long", chat_ids(embedded_model, "Write a long essay."), greedy(32, stop_at_eos=False)
    )
    short_request = EngineRequest(
        "short", chat_ids(embedded_model, "Hi"), greedy(4, stop_at_eos=False)
    )

    async def scenario() -> tuple[list[EngineEvent], float, int]:
        long_events: list[EngineEvent] = []
        stream = engine.submit(long_request)
        while len(long_events) < 5:
            event = await stream.next(timeout=60)
            assert event is not None
            long_events.append(event)
        short_events = [e async for e in engine.submit(short_request)]
        short_done = time.monotonic()
        long_tokens_then = len(long_events)
        long_events.extend([e async for e in stream])
        assert short_events[-1].finish_reason is FinishReason.LENGTH
        return long_events, short_done, long_tokens_then

    long_events, _, long_tokens_then = asyncio.run(scenario())
    assert long_events[-1].finish_reason is FinishReason.LENGTH
    # The short request came and went while the long one was still generating.
    assert long_tokens_then < 32 - 4, long_tokens_then


def test_preemption_under_kv_pressure_recomputes_and_keeps_outputs(
    tiny_llama_model: LoadedModel,
) -> None:
    model = tiny_llama_model
    probe = started(model)
    per_token = probe.kv_bytes_per_token
    assert per_token > 0, per_token
    probe.shutdown()
    # Room for 80 tokens (five 16-token blocks): one request of ~30 prompt + 24 generated
    # (four blocks) fits, two do not.
    engine = started(model, prefill_chunk=32, kv_memory_bytes=80 * per_token)
    try:
        requests = [
            EngineRequest(f"p{i}", chat_ids(model, text), greedy(24, stop_at_eos=False))
            for i, text in enumerate(PROMPTS[:3])
        ]
        alone, together = run_alone_then_together(engine, requests)
        assert engine.metrics.preemptions.value() > 0
        for request, a, b in zip(requests, alone, together, strict=True):
            assert len(b) == 24
            assert_same_or_near_tie(model, request.prompt_ids, a, b)
        # The gauge is set at the end of the step that delivered the last event.
        deadline = time.monotonic() + 10
        while engine.metrics.kv_tokens_reserved.value() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.metrics.kv_tokens_reserved.value() == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("model_type", sorted(HYBRID_CONFIGS))
def test_hybrid_models_batch_attention_and_recurrent_state(
    embedded_model: LoadedModel, model_type: str
) -> None:
    """Attention KV caches and non-trimmable state caches (convolution / gated delta-net)
    merge, extend and filter together."""
    tiny = tiny_model(model_type, embedded_model)
    kinds = {type(c).__name__ for c in tiny.model.make_cache()}  # type: ignore[operator]
    assert kinds == {"KVCache", "ArraysCache"}
    engine = started(tiny, prefill_chunk=16)
    try:
        spy = DecodeSpy(engine)
        # Different prompt lengths and output lengths: rows join with left padding and
        # leave (filter) while others keep decoding.
        requests = [
            EngineRequest(f"h{i}", chat_ids(tiny, text), greedy(8 + 6 * i, stop_at_eos=False))
            for i, text in enumerate(PROMPTS[:4])
        ]
        alone, together = run_alone_then_together(engine, requests)
        assert max(spy.rows) >= 3
        for request, a, b in zip(requests, alone, together, strict=True):
            assert_same_or_near_tie(tiny, request.prompt_ids, a, b)
    finally:
        engine.shutdown()
