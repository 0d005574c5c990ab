"""Quantized KV (`--kv-bits`) through the whole engine on the embedded model: greedy
output matches unquantized, the prefix cache and its disk tier hold the stored format
(twice the tokens under the same budget; another format's files are a miss), speculation
rolls back quantized rows, and `--context-length auto` sizes the window to the budget."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from compat_serve.engine.engine import Engine
from compat_serve.engine.kv_quant import KVFormat
from compat_serve.engine.speculation import SpeculationConfig
from compat_serve.engine.types import EngineRequest, FinishReason, SamplingParams, Usage
from tests.greedy_ties import (
    F32_TIE,
    Q8_KV_TIE,
    assert_argmax_equal_up_to_tie,
    assert_greedy_equal_up_to_tie,
    assert_same_or_near_tie,
)
from tests.python.kv_quant_reference import SHORT_PROMPTS, mlx_lm_greedy_logits
from tests.python.test_prefix_cache import FIRST_FACTS, TEXT, run, started

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

Q8 = KVFormat(8, 64)
_ids = iter(range(10**9))


def together(
    engine: Engine, prompts: list[tuple[int, ...]], max_tokens: int = 12
) -> list[tuple[list[int], Usage]]:
    """The prompts submitted at once (they decode as one batch), greedy."""

    async def one(prompt: tuple[int, ...]) -> tuple[list[int], Usage]:
        request = EngineRequest(
            f"kvq{next(_ids)}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0)
        )
        events = [e async for e in engine.submit(request)]
        assert events[-1].finish_reason is not FinishReason.ERROR, events[-1].error
        assert events[-1].usage is not None
        return [t for e in events for t in e.token_ids], events[-1].usage

    async def go() -> list[tuple[list[int], Usage]]:
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(go())


@pytest.fixture(scope="module")
def native(embedded_model: LoadedModel) -> Iterator[Engine]:
    engine = started(embedded_model)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def eight_bit(embedded_model: LoadedModel) -> Iterator[Engine]:
    engine = started(embedded_model, kv_format=Q8)
    yield engine
    engine.shutdown()


def encode(model: LoadedModel, text: str) -> tuple[int, ...]:
    return tuple(model.tokenizer.encode(text))


def test_eight_bit_greedy_matches_unquantized_and_repeats_from_cache(
    native: Engine, eight_bit: Engine, embedded_model: LoadedModel
) -> None:
    prompts = [encode(embedded_model, p) for p in SHORT_PROMPTS]
    reference = together(native, prompts)
    first = together(eight_bit, prompts)
    same = sum(a[0] == b[0] for a, b in zip(reference, first, strict=True))
    assert same >= 4, (same, [r[0] for r in reference], [f[0] for f in first])
    # The same prompts again: served from quantized cache blocks, the same tokens (up to a
    # near tie of 8-bit KV: the cached rows prefill in other chunks), and the same cached
    # reads as the unquantized engine.
    again = together(eight_bit, prompts)
    for prompt, a, f in zip(prompts, again, first, strict=True):
        assert_same_or_near_tie(
            embedded_model, prompt, f[0], a[0], tolerance=Q8_KV_TIE, kv_format=Q8
        )
    reference_again = together(native, prompts)
    assert [u.cached_tokens for _, u in again] == [u.cached_tokens for _, u in reference_again]
    assert eight_bit.kv_format_status()["format"] == "q8g64"
    assert eight_bit._kv_bytes_per_token * 3.5 <= native._kv_bytes_per_token


def test_eight_bit_batched_greedy_is_mlx_lm_quantized_kv_greedy(
    eight_bit: Engine, embedded_model: LoadedModel
) -> None:
    """The reference for 8-bit KV is mlx-lm's `QuantizedKVCache`: the engine's batched,
    left-padded quantized rows give its tokens, 16 of them, on every prompt, up to a near
    tie of mlx-lm's own logits. A batch and mlx-lm's one sequence sum in other orders, and
    8-bit rounding turns that into whole steps (issue #34: on another AVX-512 EPYC prompt 5
    departed at token 12; here, with the kernels off, a chat prompt departs on a margin of
    0.032, benches/greedy_tie_tolerances.py)."""
    prompts = [encode(embedded_model, p) for p in SHORT_PROMPTS]
    batched = [tokens for tokens, _ in together(eight_bit, prompts, max_tokens=16)]
    for prompt, tokens in zip(prompts, batched, strict=True):
        reference, logits = mlx_lm_greedy_logits(embedded_model, Q8, prompt, 16)
        assert_greedy_equal_up_to_tie(
            reference, tokens, logits.__getitem__, tolerance=Q8_KV_TIE, what=str(prompt)
        )


def test_a_budget_that_holds_part_of_a_prompt_holds_all_of_it_at_eight_bit(
    embedded_model: LoadedModel,
) -> None:
    prompt = encode(embedded_model, TEXT)
    assert 200 < len(prompt) < 300
    budget = 8 * 16 * 46080  # 8 blocks of the model's float32 K/V: 128 tokens
    reads = {}
    for kv_format in (KVFormat(), Q8):
        engine = started(embedded_model, cache_memory_bytes=budget, kv_format=kv_format)
        try:
            first = run(engine, prompt, max_tokens=2)
            second = run(engine, prompt, max_tokens=2)
        finally:
            engine.shutdown()
        assert second[0] == first[0]
        reads[kv_format.tag] = second[1].cached_tokens
    assert reads["native"] < len(prompt) - 1
    assert reads["q8g64"] == len(prompt) - 1


def test_disk_tier_keeps_the_format_and_another_format_misses(
    embedded_model: LoadedModel, tmp_path: Path
) -> None:
    # Ten of TEXT's facts: blocks enough to write, read back and miss, at less prefill.
    prompt = encode(embedded_model, FIRST_FACTS + "<|im_end|>\n")
    assert len(prompt) > 8 * 16
    writer = started(embedded_model, kv_format=Q8, cache_dir=str(tmp_path))
    try:
        expected = run(writer, prompt, max_tokens=3)[0]
        assert writer.prefix is not None and writer.prefix.disk is not None
        assert writer.prefix.disk.flush()
    finally:
        writer.shutdown()
    restarted = started(embedded_model, kv_format=Q8, cache_dir=str(tmp_path))
    try:
        tokens, usage = run(restarted, prompt, max_tokens=3)
        # Read back from disk (the stored bytes) vs computed: a near tie at most.
        assert_same_or_near_tie(
            embedded_model, prompt, expected, tokens, tolerance=Q8_KV_TIE, kv_format=Q8
        )
        assert usage.cached_tokens == len(prompt) - 1  # all of it from disk
    finally:
        restarted.shutdown()
    unquantized = started(embedded_model, cache_dir=str(tmp_path))
    try:
        _, usage = run(unquantized, prompt, max_tokens=0)  # the prefill's reads are the point
        assert usage.cached_tokens == 0  # 8-bit files are never read as model-dtype K/V
    finally:
        unquantized.shutdown()


def test_speculation_rolls_back_quantized_rows(embedded_model: LoadedModel) -> None:
    text = "one two three four five six seven eight one two three four five six seven"
    prompts = [encode(embedded_model, text), encode(embedded_model, text + " eight")]
    plain = started(embedded_model, kv_format=Q8, prefix_cache=False)
    speculating = started(
        embedded_model,
        kv_format=Q8,
        prefix_cache=False,
        speculation=SpeculationConfig("ngram", 4, cost_aware=False),
    )
    try:
        expected = together(plain, prompts, max_tokens=16)
        got = together(speculating, prompts, max_tokens=16)
        for prompt, g, e in zip(prompts, got, expected, strict=True):
            assert_same_or_near_tie(
                embedded_model, prompt, e[0], g[0], tolerance=Q8_KV_TIE, kv_format=Q8
            )
        assert speculating.speculation_status()["draft_tokens"] > 0
    finally:
        plain.shutdown()
        speculating.shutdown()


def auto_engine(model: LoadedModel, **config: Any) -> Engine:
    return started(model, auto_context=True, **config)


def test_auto_context_serves_what_the_kv_budget_holds(embedded_model: LoadedModel) -> None:
    budget = 24 * 2**20
    engine = auto_engine(embedded_model, kv_memory_bytes=budget, kv_format=Q8)
    try:
        window = engine.model.context_length
        assert window == budget // engine._kv_bytes_per_token
        assert 256 <= window < 2000
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match=r"--context-length auto: --kv-memory holds only 91"):
        auto_engine(embedded_model, kv_memory_bytes=4 * 2**20)
    with pytest.raises(ValueError, match=r"--kv-group-size 128 does not divide .* head dim 64"):
        started(embedded_model, kv_format=KVFormat(8, 128))


def test_bad_kv_flags_fail_before_the_model_loads() -> None:
    from compat_serve.bootstrap import ServeOptions, build_state

    for options, message in [
        (ServeOptions(kv_bits="3"), r"^--kv-bits must be 8 or 4, not 3$"),
        (ServeOptions(kv_bits=8, kv_group_size="48"), r"--kv-group-size must be 32, 64 or 128"),
        (ServeOptions(context_length="0"), r"--context-length must be auto or an integer >= 2"),
        (ServeOptions(context_length="big"), r"--context-length must be auto or an integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            build_state(options, loaded=None)  # raises before load_model(None) runs


@pytest.fixture(scope="module")
def fused_model(embedded_model: LoadedModel) -> LoadedModel:
    """The embedded model with its decode steps fused (`DecodeBlock`). Where this CPU has no
    AVX-512 the loader leaves them out; a second copy is then loaded with them, and they run
    on the Rust kernels' scalar pass: the same code above the SIMD loop."""
    from compat_serve.models import cpu_linear
    from compat_serve.models.loader import load_model

    if "decode_blocks" in embedded_model.extra:
        return embedded_model
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_linear, "kernel_available", lambda: True)
        loaded = load_model(None)
    assert "decode_blocks" in loaded.extra, loaded.extra
    return loaded


def _dequantized_with_step(x: Any) -> tuple[Any, Any]:
    """`x` through the cache's 8-bit quantizer (`Q8`), and each value's step (the size of
    its group's scale, which MLX may store negative), both shaped as `x`."""
    import mlx.core as mx

    packed, scales, biases = mx.quantize(x, group_size=Q8.group_size, bits=Q8.bits)
    values = mx.dequantize(packed, scales, biases, group_size=Q8.group_size, bits=Q8.bits)
    return values, mx.repeat(mx.abs(scales), Q8.group_size, axis=-1)


def test_fused_decode_over_quantized_kv_matches_the_stock_block(
    fused_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps over 8-bit KV take the Rust projection, then quantized attention
    (models/cpu_decode_block.py); their logits agree with mlx-lm's stock block.

    The two paths compute each new K/V row in two float orders, and 8-bit rounding turns a
    difference of one ulp into a whole step where a value sits at a rounding boundary (a
    Xeon saw 0.0115 in the logits that way). So the comparison is built in two parts that
    hold on any CPU: the new rows of the two paths are the same up to one quantization step
    each, and the stock block, fed the fused path's rows (quantized once: the same stored
    K/V for both), gives the fused path's logits up to float32 order."""
    import mlx.core as mx

    from compat_serve.engine import kv_quant
    from compat_serve.engine.batch import merge_caches
    from compat_serve.engine.runner import ModelRunner
    from compat_serve.models import cpu_decode_block

    runner = ModelRunner(fused_model, Q8)
    calls = []
    fused = cpu_decode_block._quantized_step
    store = kv_quant.BatchQuantKV.update_and_fetch
    fed: list[tuple[mx.array, mx.array]] = []  # the fused path's new rows, layer by layer
    own: list[tuple[mx.array, mx.array]] = []  # the stock block's own rows

    def counted(*args: Any) -> Any:
        calls.append(1)
        return fused(*args)

    def recorded(self: Any, keys: mx.array, values: mx.array) -> Any:
        fed.append((keys, values))
        return store(self, keys, values)

    def replayed(self: Any, keys: mx.array, values: mx.array) -> Any:
        own.append((keys, values))
        return store(self, *fed[len(own) - 1])

    def logits() -> mx.array:
        caches = []
        for i in range(3):
            cache = runner.new_cache()
            runner.prefill(cache, list(range(100 + i, 130 + 7 * i)))
            caches.append(cache)
        batch = merge_caches(caches)
        out = runner.decode_logits(batch, [5, 6, 7])
        mx.eval(out)
        return out

    monkeypatch.setattr(cpu_decode_block, "_quantized_step", counted)
    monkeypatch.setattr(kv_quant.BatchQuantKV, "update_and_fetch", recorded)
    ours = logits()
    assert calls  # the quantized decode path ran
    layers = len(fused_model.model.layers)
    assert len(fed) == layers
    monkeypatch.setattr(
        cpu_decode_block, "_quantized_step", cpu_decode_block.llama.TransformerBlock.__call__
    )
    monkeypatch.setattr(kv_quant.BatchQuantKV, "update_and_fetch", replayed)
    stock = logits()
    assert len(own) == layers
    for layer, (mine, theirs) in enumerate(zip(fed, own, strict=True)):
        for name, a, b in zip(("keys", "values"), mine, theirs, strict=True):
            quantized_a, step = _dequantized_with_step(a)
            quantized_b, _ = _dequantized_with_step(b)
            # Bound: the two float paths differ by ~1e-6 of a row's range, far below one
            # 8-bit step ((max - min) / 255 of its group of 64), so rounding moves a value
            # by at most one step; the extra half step covers the group's scale and bias,
            # which differ by float noise too. A wrong row or position is many steps off.
            excess = mx.abs(quantized_a - quantized_b) - 1.5 * step
            assert excess.max().item() <= 0, f"layer {layer} {name}: more than a step apart"
    # Bound: both read the same quantized K/V, so only float32 order differs (Rust vs MLX
    # products, norms, RoPE), ~1e-6 relative per op: measured 6.2e-5 here on a run where no
    # value flipped, 7.1e-5 in log-probabilities of whole decodes (#34); 1e-3 is 14x that,
    # while a wrong row or a stale block moves logits by whole units.
    assert mx.abs(ours - stock).max().item() < 1e-3
    # The greedy token of each row is the stock block's, up to a near tie of its logits.
    assert_argmax_equal_up_to_tie(stock, ours, tolerance=F32_TIE)
