"""The model families people serve, as permanent tests (issue #14 item 4).

Each family is a tiny randomly initialised model of the real mlx-lm class, written to a
directory the way a user's download looks (config.json, safetensors, tokenizer files;
4-bit variants quantized by mlx-lm's own `quantize_model`) and loaded through our loader.
On each: the loaded model computes what the source model computes, greedy output batched
equals output alone, a second turn reads the first from the prefix cache with the output
(and next-token logits) of an uncached run, a restarted server resumes from the disk tier,
and a speculative rollback leaves the cache a non-speculating run would have (or
speculation is off where the cache cannot roll back).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.speculation import SpeculationConfig
from compat_serve.engine.types import EngineRequest, FinishReason, SamplingParams, Usage
from compat_serve.engine.verify_rollback import verify_can_roll_back
from compat_serve.models.loader import load_model
from tests.chat_prompts import chat_ids
from tests.greedy_ties import assert_argmax_equal_up_to_tie, assert_same_or_near_tie
from tests.python.rollback_rows import rolled_back_and_exact
from tests.python.test_batching import DecodeSpy, greedy, run_alone_then_together
from tests.tiny_models import FAMILY_CONFIGS, SLIDING_WINDOW, write_model_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

BLOCK = 16
CHUNK = 32
# Quantized checkpoints: (family, bits, mode). MXFP4 is gpt-oss's own format: its experts
# in MXFP4, the other layers 8-bit affine (as mlx-community's gpt-oss MXFP4-Q8).
QUANTIZED: dict[str, tuple[str, int | None, str]] = {
    "qwen3_moe-4bit": ("qwen3_moe", 4, "affine"),
    "gpt_oss-4bit": ("gpt_oss", 4, "affine"),
    "gpt_oss-mxfp4": ("gpt_oss", 4, "mxfp4"),
}
FAMILIES = [*sorted(FAMILY_CONFIGS), *QUANTIZED]
# The cache kinds each family must bring (so the test covers what it claims to).
CACHE_KINDS = {
    "gemma3_text": {"RotatingKVCache", "KVCache"},
    "gpt_oss": {"RotatingKVCache", "KVCache"},
    "ministral3": {"RotatingKVCache", "KVCache"},
    "nemotron_h": {"ArraysCache", "KVCache"},
    "qwen3_5": {"ArraysCache", "KVCache"},
    "lfm2": {"ArraysCache", "KVCache"},
    "qwen3_next": {"ArraysCache", "KVCache"},
}
PROMPTS = ["Name three colours.", "What is 2+2?", "Write a haiku about rain."]
TURN2 = "<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"
# Setup and test seconds per family, printed at the end of the module (-s shows them).
TIMES: dict[str, float] = {}


@dataclass
class Family:
    name: str
    model_type: str
    loaded: LoadedModel
    source: Any  # the mlx-lm model that was written to the directory
    cached: Engine
    uncached: Engine


def engine(loaded: LoadedModel, **config: Any) -> Engine:
    started = Engine(loaded, EngineConfig(prefill_chunk=CHUNK, block_size=BLOCK, **config))
    started.start()
    return started


@pytest.fixture(scope="module", params=FAMILIES)
def family(
    request: pytest.FixtureRequest, embedded_model: LoadedModel, tmp_path_factory: Any
) -> Iterator[Family]:
    name: str = request.param
    model_type, bits, mode = QUANTIZED.get(name, (name, None, "affine"))
    t0 = time.perf_counter()
    out = tmp_path_factory.mktemp("families") / name
    source = write_model_dir(out, model_type, embedded_model, bits=bits, mode=mode)
    # A quantized checkpoint runs quantized (as on a GPU); dense ones as loaded on the CPU.
    loaded = load_model(str(out), dtype="quantized" if bits else None)
    fam = Family(
        name, model_type, loaded, source, engine(loaded), engine(loaded, prefix_cache=False)
    )
    yield fam
    fam.cached.shutdown()
    fam.uncached.shutdown()
    TIMES[name] = time.perf_counter() - t0


@pytest.fixture(scope="module", autouse=True)
def report_times() -> Iterator[None]:
    yield
    total = sum(TIMES.values())
    print("\nfamily seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in TIMES.items()))
    print(f"family total: {total:.1f}s")


_ids = iter(range(10**9))
SYSTEM = (
    "<|im_start|>system\nYou are a careful assistant. Answer in one short sentence.<|im_end|>\n"
)


def prompt_ids(loaded: LoadedModel, text: str) -> tuple[int, ...]:
    """A system and a user turn asking for the assistant's reply (longer than the window)."""
    return tuple(loaded.tokenizer.encode(SYSTEM)) + chat_ids(loaded, text)


def run(engine: Engine, prompt: tuple[int, ...], max_tokens: int) -> tuple[list[int], Usage]:
    async def go() -> tuple[list[int], Usage]:
        request = EngineRequest(
            f"f{next(_ids)}",
            prompt,
            SamplingParams(max_tokens=max_tokens, temperature=0, stop_at_eos=False),
        )
        events = [e async for e in engine.submit(request)]
        assert events[-1].finish_reason is not FinishReason.ERROR, events[-1].error
        assert events[-1].usage is not None
        return [t for e in events for t in e.token_ids], events[-1].usage

    return asyncio.run(go())


def test_the_directory_loads_as_the_model_that_was_written(family: Family) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    loaded = family.loaded
    assert loaded.model_type == family.model_type
    kinds = {type(c).__name__ for c in make_prompt_cache(loaded.model)}
    assert kinds == CACHE_KINDS.get(family.model_type, {"KVCache"})
    x = mx.array([chat_ids(loaded, PROMPTS[0])])
    got, expected = loaded.model(x), family.source(x)
    # Same weights; the CPU fast paths sum in another order.
    assert mx.abs(got - expected).max().item() < 1e-3
    # Bound: two float orders; greedy tokens may part only on a near tie (F32_TIE).
    assert_argmax_equal_up_to_tie(expected, got)
    if family.name in QUANTIZED:
        _, bits, mode = QUANTIZED[family.name]
        # The checkpoint's base quantization (experts in another mode have their own entry).
        assert loaded.dtype == f"quantized-{bits if mode == 'affine' else 8}bit"
        switches = [
            m for _, m in loaded.model.named_modules() if isinstance(m, QuantizedSwitchLinear)
        ]
        assert switches, "the experts were not quantized"
        assert {(m.mode, m.bits) for m in switches} == {(mode, bits)}
        # The default load on the CPU dequantizes every layer, experts included.
        dense = load_model(family.loaded.extra["model_dir"])
        assert dense.dtype == "float32"
        assert not [m for _, m in dense.model.named_modules() if "Quantized" in type(m).__name__]
        assert mx.abs(dense.model(x) - got).max().item() < 1e-3
    else:
        assert loaded.dtype == "float32"


def test_greedy_output_batched_equals_alone(family: Family) -> None:
    loaded = family.loaded
    spy = DecodeSpy(family.uncached)
    # Different prompt and output lengths: rows join with left padding and leave while
    # others keep decoding; outputs run past the sliding window.
    requests = [
        EngineRequest(
            f"{family.name}-{i}", prompt_ids(loaded, text), greedy(6 + 4 * i, stop_at_eos=False)
        )
        for i, text in enumerate(PROMPTS)
    ]
    assert all(len(r.prompt_ids) > SLIDING_WINDOW for r in requests)
    alone, together = run_alone_then_together(family.uncached, requests)
    assert max(spy.rows) == len(requests), spy.rows
    for request, a, b in zip(requests, alone, together, strict=True):
        assert_same_or_near_tie(loaded, request.prompt_ids, a, b)


def test_turn_two_reads_turn_one_from_the_cache(family: Family) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    loaded, cached = family.loaded, family.cached
    tokenizer = loaded.tokenizer
    turn1 = prompt_ids(loaded, "Tell me about rivers and the sea, in a few words.")
    reply, first = run(cached, turn1, max_tokens=8)
    assert first.cached_tokens == 0
    turn2 = turn1 + tuple(reply) + tuple(tokenizer.encode(TURN2))
    tokens, second = run(cached, turn2, max_tokens=8)
    prefix = cached.prefix
    assert prefix is not None
    # Blocks, then the finished request's tail (attention) or the state point at the end
    # of its reply (hybrid): turn 1 and its reply, but the reply's last token (never fed).
    assert second.cached_tokens >= len(turn1) + len(reply) - 1
    assert_same_or_near_tie(loaded, turn2, run(family.uncached, turn2, max_tokens=8)[0], tokens)

    # Next-token logits from the cached blocks (and snapshot) equal a full forward.
    model: Any = loaded.model
    n = second.cached_tokens // BLOCK
    if prefix.hybrid:  # the last block with a snapshot (points: test_state_points.py)
        hashes = prefix.cache.block_hashes(list(turn2[: n * BLOCK]), None)
        n = max((i + 1 for i, h in enumerate(hashes) if prefix.store.has_snapshot(h)), default=0)
        assert n > 0
    admission = prefix.cache.admit("probe", list(turn2[: n * BLOCK + 1]), None)
    try:
        assert admission.cached_tokens == n * BLOCK
        cache = make_prompt_cache(model)
        prefix.store.assemble(list(admission.block_ids), cache)
        if prefix.hybrid:
            last = prefix.cache.block_hashes(list(turn2[: n * BLOCK]), None)[-1]
            prefix.store.restore_snapshot(last, cache)
        warm = model(mx.array([turn2[n * BLOCK :]]), cache=cache)[0, -1]
        cold = model(mx.array([turn2]), cache=make_prompt_cache(model))[0, -1]
        assert mx.abs(cold).max().item() > 0.1  # logits of a size 1e-3 can tell apart
        assert mx.abs(warm - cold).max().item() < 1e-3
    finally:
        prefix.cache.release("probe")


def test_a_restart_resumes_from_the_disk_tier(family: Family, tmp_path: Path) -> None:
    """Blocks, and the state snapshots of rotating / recurrent layers, read back from disk."""
    loaded = family.loaded
    prompt = prompt_ids(loaded, PROMPTS[2])
    expected = run(family.uncached, prompt, max_tokens=6)[0]
    for restart in (False, True):
        disk = engine(loaded, cache_dir=str(tmp_path), cache_disk_bytes=1 << 30)
        try:
            tokens, usage = run(disk, prompt, max_tokens=6)
            assert disk.prefix is not None
            if restart:
                full = (len(prompt) - 1) // BLOCK * BLOCK
                assert usage.cached_tokens >= full
                assert disk.prefix.metrics()["disk_hit_tokens"] == usage.cached_tokens
                assert disk.prefix.faults == 0
            else:
                assert usage.cached_tokens == 0
            assert_same_or_near_tie(loaded, prompt, expected, tokens)
        finally:
            disk.shutdown()


def test_speculative_rollback_matches_an_exact_cache(family: Family) -> None:
    """Where the cache can roll back (attention, sliding windows, recurrent state), rows
    verify drafts of different lengths and, after the rollback, their next logits equal
    those of a cache that only saw the accepted tokens; elsewhere the engine turns
    speculation off."""
    import mlx.core as mx

    from compat_serve.engine.runner import ModelRunner

    loaded = family.loaded
    runner = ModelRunner(loaded)
    if not verify_can_roll_back(runner.new_cache()):
        spec = Engine(loaded, EngineConfig(speculation=SpeculationConfig("ngram", 4)))
        spec.start()
        try:
            assert spec.speculation_status()["disabled_reason"]
        finally:
            spec.shutdown()
        return
    prompts = [list(prompt_ids(loaded, text)) for text in PROMPTS]
    _, rolled, exact = rolled_back_and_exact(runner, prompts)
    assert mx.abs(exact).max().item() > 0.1
    assert mx.abs(rolled - exact).max().item() < 1e-3
