"""The prefix cache on real models: hits give the same tokens and logits as no cache,
usage is exact, salts isolate, faults fall back, hybrid models hit at snapshots, and the
cache stays within its memory budget."""

from __future__ import annotations

import asyncio
import dataclasses
import resource
from typing import TYPE_CHECKING, Any

import pytest

from compat_serve.engine.engine import Engine
from compat_serve.engine.types import EngineRequest, FinishReason, SamplingParams, Usage
from tests.greedy_ties import assert_same_or_near_tie
from tests.platform_gates import needs_proc_rss
from tests.python.prefix_engines import BLOCK, CHUNK, started
from tests.tiny_models import tiny_model

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

TEXT = (
    "<|im_start|>system\nYou are a careful assistant.<|im_end|>\n<|im_start|>user\n"
    + " ".join(f"Fact {i}: the river number {i} flows north." for i in range(16))
    + "<|im_end|>\n<|im_start|>assistant\n"
)
# TEXT up to its tenth fact, unterminated: 8 blocks and three prefill chunks, for the tests
# that need a long prefix but not TEXT's whole length.
FIRST_FACTS = TEXT[: TEXT.index(" Fact 10:")]


_ids = iter(range(10**9))


def run(
    engine: Engine, prompt: tuple[int, ...], max_tokens: int = 8, salt: bytes | None = None
) -> tuple[list[int], Usage]:
    async def go() -> tuple[list[int], Usage]:
        request = EngineRequest(
            f"q{next(_ids)}",
            prompt,
            SamplingParams(max_tokens=max_tokens, temperature=0),
            cache_salt=salt,
        )
        events = [e async for e in engine.submit(request)]
        assert events[-1].finish_reason is not FinishReason.ERROR, events[-1].error
        assert events[-1].usage is not None
        return [t for e in events for t in e.token_ids], events[-1].usage

    return asyncio.run(go())


def check_usage(usage: Usage) -> None:
    assert usage.prompt_tokens - usage.cached_tokens - usage.cache_creation_tokens >= 0


@pytest.fixture(scope="module")
def uncached_output(uncached: Engine, embedded_model: LoadedModel) -> list[int]:
    """TEXT's greedy output with no cache: what every split must reproduce (computed once,
    the uncached engine is deterministic)."""
    return run(uncached, tuple(embedded_model.tokenizer.encode(TEXT)))[0]


@pytest.mark.parametrize("split", [1, 15, 16, 17, 63, 64, 65, 130, 200])
def test_a_hit_at_any_split_gives_the_uncached_output(
    cached: Engine, uncached_output: list[int], embedded_model: LoadedModel, split: int
) -> None:
    prompt = tuple(embedded_model.tokenizer.encode(TEXT))
    assert len(prompt) > 200
    salt = f"split-{split}".encode()  # each split starts from an empty cache
    warm_tokens, warm = run(cached, prompt[:split], max_tokens=0, salt=salt)  # pre-warm
    assert warm_tokens == [] and warm.completion_tokens == 0
    # Whole blocks plus the partial last block (a tail) are stored.
    assert warm.cached_tokens == 0 and warm.cache_creation_tokens == split
    tokens, usage = run(cached, prompt, salt=salt)
    assert_same_or_near_tie(embedded_model, prompt, uncached_output, tokens)
    assert usage.cached_tokens == split
    # Everything it did not read ends up stored: blocks, then its own tail at the end.
    assert usage.cache_creation_tokens == len(prompt) - split
    check_usage(usage)


def test_next_token_logits_from_assembled_blocks_match_a_full_forward(
    cached: Engine, embedded_model: LoadedModel
) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    prompt = tuple(embedded_model.tokenizer.encode(FIRST_FACTS))
    run(cached, prompt, max_tokens=0, salt=b"logits")
    prefix = cached.prefix
    assert prefix is not None
    hashes = prefix.cache.block_hashes(list(prompt), b"logits")
    assert len(hashes) > 6  # one, five and all but one of its blocks are three readings
    model: Any = embedded_model.model
    cold = model(mx.array([prompt]), cache=make_prompt_cache(model))[0, -1]
    for n_blocks in (1, 5, len(hashes) - 1):
        admission = prefix.cache.admit("probe", list(prompt[: n_blocks * BLOCK + 1]), b"logits")
        try:
            assert admission.cached_tokens == n_blocks * BLOCK
            cache = make_prompt_cache(model)
            prefix.store.assemble(list(admission.block_ids), cache)
            rest = prompt[n_blocks * BLOCK :]
            warm = model(mx.array([rest]), cache=cache)[0, -1]
            assert mx.abs(warm - cold).max().item() < 1e-3
        finally:
            prefix.cache.release("probe")


def test_concurrent_requests_sharing_a_prefix(
    tiny_cached: Engine, tiny_uncached: Engine, tiny_llama_model: LoadedModel
) -> None:
    cached, uncached, model = tiny_cached, tiny_uncached, tiny_llama_model
    base = FIRST_FACTS
    prompts = [
        tuple(model.tokenizer.encode(f"{base} Question {q}?<|im_end|>\n<|im_start|>assistant\n"))
        for q in ("one", "two", "three")
    ]

    async def together() -> list[list[int]]:
        async def one(p: tuple[int, ...]) -> list[int]:
            req = EngineRequest(
                f"c{next(_ids)}", p, SamplingParams(max_tokens=8, temperature=0), cache_salt=b"cc"
            )
            return [t for e in [e async for e in cached.submit(req)] for t in e.token_ids]

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    outputs = asyncio.run(together())
    for prompt, output in zip(prompts, outputs, strict=True):
        assert_same_or_near_tie(model, prompt, run(uncached, prompt)[0], output)
    # A later request with the same prefix reads it from the cache.
    _, usage = run(cached, prompts[0], salt=b"cc")
    assert len(prompts[0]) > 2 * CHUNK  # the shared prefix spans prefill chunks
    assert usage.cached_tokens >= len(prompts[0]) - BLOCK - 1


def test_the_salt_isolates_and_sampling_settings_do_not(
    tiny_cached: Engine, tiny_llama_model: LoadedModel
) -> None:
    cached = tiny_cached
    prompt = tuple(tiny_llama_model.tokenizer.encode(TEXT.replace("river", "lake")))
    _, first = run(cached, prompt, salt=b"alice")
    assert first.cached_tokens == 0
    _, other_key = run(cached, prompt, salt=b"bob")
    assert other_key.cached_tokens == 0
    hot = EngineRequest(
        "hot", prompt, SamplingParams(max_tokens=4, temperature=1.5, seed=7), cache_salt=b"alice"
    )

    async def sampled() -> Usage:
        events = [e async for e in cached.submit(hot)]
        assert events[-1].usage is not None
        return events[-1].usage

    again = asyncio.run(sampled())
    # Whole blocks, then the rest of the prompt's last block inside the block the first
    # request's reply filled: every token but the one computed.
    assert again.cached_tokens == len(prompt) - 1


def test_a_cache_fault_falls_back_to_recompute(
    cached: Engine,
    uncached_output: list[int],
    embedded_model: LoadedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prefix = cached.prefix
    assert prefix is not None
    # TEXT itself: its own salt keeps it apart from the other tests' entries, and its
    # uncached output is computed once for the module.
    prompt = tuple(embedded_model.tokenizer.encode(TEXT))
    warm_tokens, warm = run(cached, prompt, max_tokens=0, salt=b"fault")
    assert warm_tokens == [] and warm.cached_tokens == 0

    def broken(*_args: Any) -> None:
        raise RuntimeError("injected assembly fault")

    faults = prefix.faults
    monkeypatch.setattr(prefix.store, "assemble", broken)
    tokens, usage = run(cached, prompt, salt=b"fault")
    assert prefix.faults == faults + 1
    assert_same_or_near_tie(embedded_model, prompt, uncached_output, tokens)
    check_usage(usage)


def test_a_hybrid_model_hits_at_a_state_point(embedded_model: LoadedModel) -> None:
    tiny = tiny_model("lfm2", embedded_model)
    cached, uncached = started(tiny), started(tiny, prefix_cache=False)
    try:
        assert cached.prefix is not None and cached.prefix.hybrid
        tokenizer = tiny.tokenizer
        turn1 = tuple(tokenizer.encode(TEXT))
        reply, first = run(cached, turn1, max_tokens=12)
        assert first.cached_tokens == 0
        turn2 = (
            turn1
            + tuple(reply)
            + tuple(
                tokenizer.encode(
                    "<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"
                )
            )
        )
        tokens, second = run(cached, turn2, max_tokens=12)
        # Not a silent full recompute: served up to the state point at the end of turn
        # 1's reply (its last token never fed).
        assert second.cached_tokens == len(turn1) + len(reply) - 1
        assert_same_or_near_tie(tiny, turn2, run(uncached, turn2, max_tokens=12)[0], tokens)
        check_usage(second)
    finally:
        cached.shutdown()
        uncached.shutdown()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


@needs_proc_rss
def test_many_conversations_stay_within_the_cache_budget(embedded_model: LoadedModel) -> None:
    import mlx.core as mx
    from mlx_lm.models import llama

    args = llama.ModelArgs.from_dict(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "vocab_size": embedded_model.tokenizer.vocab_size,
            "tie_word_embeddings": True,
        }
    )
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    tiny = dataclasses.replace(embedded_model, model=model, name="tiny-llama")
    budget = 64 * 1024  # bytes: 2 layers x 2 heads x 16 dims x K,V x 4 B = 512 B/token
    engine = started(tiny, cache_memory_bytes=budget)
    try:
        prefix = engine.prefix
        assert prefix is not None
        rss = []
        for i in range(100):
            # 471 to 567 tokens: 29 blocks or more, over three times the budget's 8.
            text = f"Conversation {i}: " + " ".join(f"w{i}x{j}" for j in range(95))
            prompt = tuple(embedded_model.tokenizer.encode(text))
            assert len(prompt) >= 450
            run(engine, prompt, max_tokens=2)
            assert prefix.store.bytes_in_use <= budget
            if i % 10 == 9:
                rss.append(_rss_mib())
        stats = prefix.cache.stats()
        assert stats.evictions > 0 and stats.cached_blocks <= stats.num_blocks
        print(f"cache bytes {prefix.store.bytes_in_use} / {budget}; RSS MiB every 10: {rss}")
        # Flat after warm-up: no growth beyond allocator noise (measured: under 0.01 MiB).
        # 16 MiB over the last 70 conversations catches a leak of 240 KB each, less than
        # the K/V of their evicted blocks (~280 KB).
        assert max(rss[3:]) - rss[2] < 16, rss
    finally:
        engine.shutdown()
