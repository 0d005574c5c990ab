"""Quantized sliding-window layers (`--kv-bits` on a model with rotating caches) through
the runner and the engine, on a tiny random Gemma 3 (a sliding-window layer, then a
global one; head dim 64 so the quantization groups divide it):

- logits of rows of different lengths, prefilled in chunks past the window and decoded
  as one batch, are exactly those of an unquantized cache holding the quantized values,
  and close to the unquantized model's;
- the engine serves from quantized windows: chunked prefill past the window, an abort in
  the middle of a batch, a repeat read from the prefix cache (the window's snapshot, in
  RAM and from the disk tier after a restart);
- speculation on quantized windows decodes as plain decoding, and a model whose
  attention cannot read quantized K/V (gpt-oss: attention sinks) fails at start naming
  the flag.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchRotatingKVCache, KVCache, RotatingKVCache

from compat_serve.engine.batch import merge_caches
from compat_serve.engine.engine import Engine, EngineConfig
from compat_serve.engine.kv_quant import KVFormat, QuantKV
from compat_serve.engine.kv_quant_rotating import BatchQuantRotatingKV, QuantRotatingKV
from compat_serve.engine.runner import ModelRunner
from compat_serve.engine.speculation import SpeculationConfig
from compat_serve.engine.types import EngineRequest, FinishReason, SamplingParams, Usage
from tests.greedy_ties import Q8_KV_TIE, assert_same_as_engine_or_near_tie
from tests.tiny_models import SLIDING_WINDOW, tiny_model

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

Q8 = KVFormat(8, 64)
BLOCK, CHUNK = 16, 32
HEAD_DIM_64 = {"hidden_size": 128, "num_attention_heads": 4, "head_dim": 64}
TEXT = "The quick brown fox jumps over the lazy dog. "
_ids = iter(range(10**9))


@pytest.fixture(scope="module")
def gemma(embedded_model: LoadedModel) -> LoadedModel:
    # Attention scale 1/sqrt(64), as a real Gemma 3's head dim gives.
    return tiny_model(
        "gemma3_text", embedded_model, overrides={**HEAD_DIM_64, "query_pre_attn_scalar": 64}
    )


def started(loaded: LoadedModel, **config: Any) -> Engine:
    engine = Engine(loaded, EngineConfig(prefill_chunk=CHUNK, block_size=BLOCK, **config))
    engine.start()
    return engine


@pytest.fixture(scope="module")
def eight_bit(gemma: LoadedModel) -> Iterator[Engine]:
    engine = started(gemma, kv_format=Q8)
    yield engine
    engine.shutdown()


def prompt(loaded: LoadedModel, repeats: int) -> list[int]:
    ids: list[int] = loaded.tokenizer.encode(TEXT * repeats)
    return ids


def request(prompt_ids: list[int], max_tokens: int) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, stop_at_eos=False)
    return EngineRequest(f"rot{next(_ids)}", tuple(prompt_ids), sampling)


async def collect(engine: Engine, req: EngineRequest) -> tuple[list[int], Usage]:
    events = [e async for e in engine.submit(req)]
    assert events[-1].finish_reason is not FinishReason.ERROR, events[-1].error
    assert events[-1].usage is not None
    return [t for e in events for t in e.token_ids], events[-1].usage


def run(engine: Engine, prompt_ids: list[int], max_tokens: int = 8) -> tuple[list[int], Usage]:
    return asyncio.run(collect(engine, request(prompt_ids, max_tokens)))


# ---- logits through the runner ---------------------------------------------------------


def _fake_quantized(bits: int) -> type[RotatingKVCache]:
    """An unquantized rotating cache fed the values `mx.quantize` keeps (the reference a
    quantized window must reproduce exactly), batched likewise."""

    def rounded(x: mx.array) -> mx.array:
        return mx.dequantize(*mx.quantize(x, group_size=64, bits=bits), group_size=64, bits=bits)

    class Batched(BatchRotatingKVCache):
        def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
            return super().update_and_fetch(rounded(keys), rounded(values))

    class Single(RotatingKVCache):
        def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
            return super().update_and_fetch(rounded(keys), rounded(values))

        @classmethod
        def merge(cls, caches: list[Any]) -> Any:
            merged = BatchRotatingKVCache.merge(caches)
            merged.__class__ = Batched
            return merged

    return Single


def batch_logits(
    loaded: LoadedModel, window: str, bits: int = 8, feed: list[list[int]] | None = None
) -> tuple[mx.array, list[list[int]], list[Any]]:
    """Logits `[steps, rows, vocab]` of three prompts longer than the window, each
    prefilled alone in chunks of 16, then decoded together 8 steps (greedy, or fed
    `feed`). Full-attention layers stay unquantized; the sliding-window layer is
    `window`: "native", "quantized" or "rounded" (unquantized, fed quantized values)."""
    runner = ModelRunner(loaded, KVFormat(bits, 64) if window == "quantized" else KVFormat())
    rows, first = [], []
    for ids in (prompt(loaded, n) for n in (3, 5, 8)):
        cache = [KVCache() if type(layer) is QuantKV else layer for layer in runner.new_cache()]
        if window == "rounded":
            cache = [
                _fake_quantized(bits)(layer.max_size) if type(layer) is RotatingKVCache else layer
                for layer in cache
            ]
        for start in range(0, len(ids) - 1, 16):
            runner.prefill(cache, ids[start : min(start + 16, len(ids) - 1)])
        first.append(runner.last_logits(cache, ids[-1:])[0])
        rows.append(cache)
    batch = merge_caches(rows)
    steps = [mx.stack(first)]
    fed: list[list[int]] = []
    for step in range(8):
        tokens = feed[step] if feed is not None else mx.argmax(steps[-1], axis=-1).tolist()
        fed.append(tokens)
        steps.append(runner.decode_logits(batch, tokens))
    return mx.stack(steps), fed, batch


def test_window_logits_are_those_of_its_quantized_values(
    gemma: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx_lm.models import base

    reads: list[tuple[Any, int]] = []
    real = base.quantized_scaled_dot_product_attention

    def spy(queries: mx.array, q_keys: Any, q_values: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append((q_keys[0].dtype, int(q_keys[0].shape[-2])))
        return real(queries, q_keys, q_values, *args, **kwargs)

    native, fed, _ = batch_logits(gemma, "native")
    monkeypatch.setattr(base, "quantized_scaled_dot_product_attention", spy)
    quantized, _, batch = batch_logits(gemma, "quantized", 8, fed)
    monkeypatch.undo()
    assert isinstance(batch[0], BatchQuantRotatingKV) and batch[0].rotated
    # The wrapped window was read by mlx-lm's quantized attention, packed: the last decode
    # step saw exactly `max_size` positions of uint32.
    assert reads[-1] == (mx.uint32, SLIDING_WINDOW)
    rounded, _, _ = batch_logits(gemma, "rounded", 8, fed)
    # Same values, same positions, same masks: equal up to float32 summation order.
    assert mx.abs(quantized - rounded).max().item() < 1e-3
    # Against the unquantized model: 8-bit rounding of the window (step (max - min) / 255
    # per group of 64) moves these logits by ~3% of their range; 4-bit (a 17x coarser
    # step) by far more, so the 8-bit cache is not merely reading some other values.
    scale = mx.abs(native).max().item()
    error8 = mx.abs(quantized - native).max().item()
    four, _, _ = batch_logits(gemma, "quantized", 4, fed)
    error4 = mx.abs(four - native).max().item()
    assert scale > 1.0
    assert error8 < 0.1 * scale, (error8, scale)
    assert error4 > 4 * error8, (error4, error8)


# ---- the engine ------------------------------------------------------------------------


class BatchSpy:
    """Records the decode batch's sliding-window layer at each step (observed, not
    replaced): its class and the dtype of what it stores, and the batch's rows."""

    def __init__(self, engine: Engine) -> None:
        self.windows: list[tuple[str, Any]] = []
        self.rows: list[int] = []
        runner = engine._runner
        real = runner.decode_logits

        def spy(cache: Any, tokens: Any, *args: Any) -> Any:
            window = cache[0]
            self.windows.append((type(window).__name__, window.keys[0].dtype))
            self.rows.append(len(tokens))
            return real(cache, tokens, *args)

        runner.decode_logits = spy  # type: ignore[method-assign]


def test_the_engine_serves_and_repeats_from_quantized_windows(
    eight_bit: Engine, gemma: LoadedModel
) -> None:
    assert eight_bit._runner.kv_layout == {
        "layers": {"QuantKV": 1, "QuantRotatingKV": 1},
        "dtype": "uint32",
        "bits": [8],
    }
    spy = BatchSpy(eight_bit)
    ids = prompt(gemma, 8)
    assert len(ids) > 3 * SLIDING_WINDOW and len(ids) > 2 * CHUNK  # chunks past the window
    first = run(eight_bit, ids)
    assert len(first[0]) == 8 and first[1].cached_tokens == 0
    assert spy.windows and set(spy.windows) == {("BatchQuantRotatingKV", mx.uint32)}
    # The prefix cache snapshotted the quantized window at the last block boundary (and
    # before the last token); the repeat restores it and computes only the last token,
    # with the same output.
    prefix = eight_bit.prefix
    assert prefix is not None and prefix.hybrid
    snapshots = list(prefix.store._snapshots.values())
    assert snapshots
    kind, state, _ = snapshots[-1][0]
    assert kind is QuantRotatingKV
    assert [a.dtype for a in state[0]] == [mx.uint32, mx.float32, mx.float32]
    again = run(eight_bit, ids)
    # Restored vs computed: the same tokens up to a near tie of the engine's 8-bit logits.
    assert_same_as_engine_or_near_tie(
        eight_bit, request(ids, 8), first[0], again[0], tolerance=Q8_KV_TIE
    )
    assert again[1].cached_tokens == len(ids) - 1  # the state point before the last token
    assert prefix.faults == 0


def test_an_abort_in_a_batch_leaves_the_other_rows_right(
    eight_bit: Engine, gemma: LoadedModel
) -> None:
    long_req = request(prompt(gemma, 4), max_tokens=200)
    # A row past the window and one that starts inside it (left-padded when batched),
    # both decoding past the window.
    others = [(gemma.tokenizer.encode("Hello there"), 32), (prompt(gemma, 6), 24)]
    alone = [run(eight_bit, ids, max_tokens=n)[0] for ids, n in others]
    spy = BatchSpy(eight_bit)

    async def scenario() -> tuple[list[list[int]], FinishReason | None]:
        aborted = eight_bit.submit(long_req)
        rest: list[asyncio.Future[tuple[list[int], Usage]]] = []
        seen, last = 0, None
        while last is None:  # one reader, so the stream is not abandoned between loops
            event = await aborted.next()
            assert event is not None
            seen += len(event.token_ids)
            if seen >= 2 * len(rest) + 1 and len(rest) < len(others):
                # Each joins the decoding batch on its own (`extend`); the short one is
                # left-padded to the window.
                ids, n = others[len(rest)]
                rest.append(asyncio.ensure_future(collect(eight_bit, request(ids, n))))
            elif len(rest) == len(others) and seen >= 8 and seen - len(event.token_ids) < 8:
                eight_bit.abort(long_req.request_id)  # mid-batch: the others decode on
            last = event.finish_reason
        return [(await r)[0] for r in rest], last

    together, reason = asyncio.run(scenario())
    assert reason is FinishReason.ABORTED
    # The surviving rows' windows are kept through join and filter: each row's tokens are
    # its tokens alone, up to a near tie of 8-bit KV (batched rows sum in another order).
    for (ids, n), a, t in zip(others, alone, together, strict=True):
        assert_same_as_engine_or_near_tie(eight_bit, request(ids, n), a, t, tolerance=Q8_KV_TIE)
    assert 3 in spy.rows and spy.rows[-1] == 1, spy.rows  # decoded together, then fewer
    assert spy.windows and set(spy.windows) == {("BatchQuantRotatingKV", mx.uint32)}


def test_a_restart_reads_the_quantized_window_from_disk(gemma: LoadedModel, tmp_path: Path) -> None:
    ids = prompt(gemma, 5)
    writer = started(gemma, kv_format=Q8, cache_dir=str(tmp_path))
    try:
        expected = run(writer, ids, max_tokens=4)[0]
        assert writer.prefix is not None and writer.prefix.disk is not None
        assert writer.prefix.disk.flush()
    finally:
        writer.shutdown()
    restarted = started(gemma, kv_format=Q8, cache_dir=str(tmp_path))
    try:
        tokens, usage = run(restarted, ids, max_tokens=4)
        assert usage.cached_tokens == len(ids) - 1  # blocks and the state point, from disk
        assert restarted.prefix is not None and restarted.prefix.faults == 0
        assert restarted.prefix.metrics()["disk_hit_tokens"] == usage.cached_tokens
        # Read from disk vs computed: a near tie of 8-bit KV at most.
        assert_same_as_engine_or_near_tie(
            restarted, request(ids, 4), expected, tokens, tolerance=Q8_KV_TIE
        )
    finally:
        restarted.shutdown()
    unquantized = started(gemma, cache_dir=str(tmp_path))
    try:
        assert run(unquantized, ids, max_tokens=4)[1].cached_tokens == 0  # another format
    finally:
        unquantized.shutdown()


def test_speculation_on_quantized_windows_decodes_as_plain_and_sinks_fail_at_start(
    embedded_model: LoadedModel,
) -> None:
    """Prompt-lookup drafts on 8-bit windows (rolled back as in engine/verify_rollback.py;
    a 48-token vocabulary makes the random model repeat itself enough to draft): rows of
    two lengths, the shorter wrapping its window while it decodes, give the tokens of
    plain 8-bit decoding, with drafts accepted and rejected."""
    small = tiny_model(
        "gemma3_text",
        embedded_model,
        seed=3,
        overrides={**HEAD_DIM_64, "query_pre_attn_scalar": 64, "vocab_size": 48},
    )
    rng = np.random.default_rng(0)
    reqs = [request(rng.integers(3, 48, n).tolist(), 20) for n in (12, 40)]
    assert len(reqs[0].prompt_ids) < SLIDING_WINDOW < len(reqs[1].prompt_ids)
    spec = SpeculationConfig("ngram", num_tokens=4, ngram_min=1, cost_aware=False)
    plain, fast = started(small, kv_format=Q8), started(small, kv_format=Q8, speculation=spec)

    async def both(engine: Engine) -> list[list[int]]:
        done = await asyncio.gather(*(collect(engine, r) for r in reqs))
        return [list(t) for t, _ in done]

    try:
        want, have = asyncio.run(both(plain)), asyncio.run(both(fast))
        status = fast.speculation_status()
        assert status["disabled_reason"] is None, status
        drafted, accepted = int(status["draft_tokens"]), int(status["accepted_tokens"])  # type: ignore[call-overload]
        assert 0 < accepted < drafted, status
        for req, expected, got in zip(reqs, want, have, strict=True):
            assert len(expected) == 20
            assert_same_as_engine_or_near_tie(plain, req, expected, got, tolerance=Q8_KV_TIE)
    finally:
        plain.shutdown()
        fast.shutdown()
    gpt_oss = tiny_model("gpt_oss", embedded_model, overrides=HEAD_DIM_64)
    with pytest.raises(ValueError, match=r"^--kv-bits 8: this model's attention .*sinks"):
        Engine(gpt_oss, EngineConfig(kv_format=Q8))
