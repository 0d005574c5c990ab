"""LoRA adapters through the real Engine, on a tiny random llama with the CPU fast paths
the loader installs (skinny linears, fused decode blocks) where this CPU has them: a
batch mixing three adapters and no adapter gives each row its solo result (chunked and
batched prefills, batched decode, speculative verification), a solo adapter row follows
the model with the adapter fused by mlx-lm, the prefix cache never serves one adapter's
blocks to another, and bad requests and adapters are refused clearly."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from compat_serve.adapters import AdapterError
from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.speculation import SpeculationConfig
from compat_serve.engine.types import EngineEvent, EngineRequest, FinishReason, SamplingParams
from compat_serve.models.cpu_decode_block import install_fused_decode_blocks
from compat_serve.models.cpu_linear import install_skinny_linears, kernel_available
from tests.greedy_ties import (
    F32_TIE,
    assert_greedy_equal_up_to_tie,
    assert_same_or_near_tie,
    first_difference,
    recorded_scores,
)
from tests.python.lora_files import (
    MLX_KEYS,
    PEFT_MODULES,
    mlx_lm_with_adapter,
    random_pairs,
    write_mlx_adapter,
    write_peft_adapter,
)
from tests.tiny_models import tiny_model

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

SEED = 11
CHUNK = 16
MAX_TOKENS = 12
TOP = 5
LOGIT_TOLERANCE = 1e-4
# Longer than a prefill chunk (several chunks) and shorter (prefilled together).
PROMPT_LENGTHS = (41, 9, 27, 6)


def tiny_with_fast_paths(embedded_model: LoadedModel) -> LoadedModel:
    loaded = tiny_model("llama", embedded_model, seed=SEED)
    skinny = install_skinny_linears(loaded.model)
    fused = install_fused_decode_blocks(loaded.model)
    if kernel_available():  # the paths that bypass the linears are really there
        assert skinny and fused == len(loaded.model.layers)
    return loaded


@pytest.fixture(scope="module")
def adapter_dirs(
    tmp_path_factory: pytest.TempPathFactory, embedded_model: LoadedModel
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-engine")
    model = tiny_model("llama", embedded_model, seed=SEED).model
    return {
        "style": write_mlx_adapter(
            root / "style", random_pairs(model, MLX_KEYS, seed=21), scale=2.0, layers=2
        ),
        "commit": write_mlx_adapter(
            root / "commit",
            random_pairs(model, ("self_attn.k_proj", "mlp.gate_proj"), seed=22, layers=1),
            scale=3.0,
            layers=1,
            keys=("self_attn.k_proj", "mlp.gate_proj"),
        ),
        "peft": write_peft_adapter(
            root / "peft", random_pairs(model, PEFT_MODULES, seed=23), alpha=16.0
        ),
    }


def start(loaded: LoadedModel, dirs: dict[str, Path], **config: Any) -> Engine:
    engine = Engine(loaded, EngineConfig(prefill_chunk=CHUNK, max_num_seqs=8, **config))
    for name, folder in dirs.items():
        engine.add_adapter(name, folder)
    engine.start()
    return engine


@pytest.fixture(scope="module")
def loaded(embedded_model: LoadedModel) -> LoadedModel:
    return tiny_with_fast_paths(embedded_model)


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel, adapter_dirs: dict[str, Path]) -> Iterator[Engine]:
    eng = start(loaded, adapter_dirs, prefix_cache=False)
    yield eng
    eng.shutdown()


def prompt(length: int, salt: int) -> tuple[int, ...]:
    rng = np.random.default_rng(salt)
    return tuple(int(t) for t in rng.integers(10, 1000, size=length))


def request(rid: str, ids: tuple[int, ...], adapter: str | None, **extra: Any) -> EngineRequest:
    sampling = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, stop_at_eos=False, logprobs=TOP, **extra
    )
    return EngineRequest(rid, ids, sampling, adapter=adapter)


def run_all(engine: Engine, requests: list[EngineRequest]) -> list[list[EngineEvent]]:
    async def one(req: EngineRequest) -> list[EngineEvent]:
        return [event async for event in engine.submit(req)]

    async def together() -> list[list[EngineEvent]]:
        return list(await asyncio.gather(*(one(r) for r in requests)))

    results = asyncio.run(together())
    for events in results:
        assert events[-1].finish_reason is not FinishReason.ERROR, events[-1].error
    return results


def tokens(events: list[EngineEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def logprob_rows(events: list[EngineEvent]) -> list[dict[int, float]]:
    return [dict(lp.top) for e in events for lp in e.logprobs]


def assert_same_as_solo(solo: list[EngineEvent], other: list[EngineEvent], what: str) -> None:
    """Greedy tokens equal up to a near tie of the solo run; the top log-probabilities
    (logit differences) within 1e-4 up to there."""
    reference, candidate = tokens(solo), tokens(other)
    assert_greedy_equal_up_to_tie(
        reference, candidate, recorded_scores(solo), tolerance=F32_TIE, what=what
    )
    same = first_difference(reference, candidate)
    upto = len(reference) if same is None else same
    rows = zip(logprob_rows(solo)[:upto], logprob_rows(other)[:upto], strict=True)
    for i, (a, b) in enumerate(rows):
        worst = max(abs(a[t] - b[t]) for t in a.keys() & b.keys())
        assert worst < LOGIT_TOLERANCE, f"{what}: position {i} differs by {worst}"
        # A token in one top-k only sits at the other's cut (a tie for the last place).
        for mine, theirs in ((a, b), (b, a)):
            for t in mine.keys() - theirs.keys():
                assert mine[t] < min(theirs.values()) + LOGIT_TOLERANCE, (what, i, t)


ROWS = ("style", None, "commit", "peft")


def test_mixed_batch_gives_each_row_its_solo_result(engine: Engine) -> None:
    prompts = [prompt(n, salt=i) for i, n in enumerate(PROMPT_LENGTHS)]
    solo = [
        run_all(engine, [request(f"solo{i}", ids, name)])[0]
        for i, (ids, name) in enumerate(zip(prompts, ROWS, strict=True))
    ]
    mixed = run_all(
        engine,
        [
            request(f"mix{i}", ids, name)
            for i, (ids, name) in enumerate(zip(prompts, ROWS, strict=True))
        ],
    )
    for name, alone, batched in zip(ROWS, solo, mixed, strict=True):
        assert_same_as_solo(alone, batched, f"row {name}")
    # One prompt through every adapter in one batch: a row that read another row's
    # slot would show here.
    same = prompts[0]
    together = run_all(engine, [request(f"one{i}", same, n) for i, n in enumerate(ROWS)])
    for i, (name, batched) in enumerate(zip(ROWS, together, strict=True)):
        alone = solo[0] if i == 0 else run_all(engine, [request(f"one-solo{i}", same, name)])[0]
        assert_same_as_solo(alone, batched, f"same prompt, row {name}")
    outputs = {tuple(tokens(events)) for events in together}
    assert len(outputs) == len(ROWS), "an adapter did not change the output"


def test_solo_adapter_row_follows_mlx_lm_fuse(
    engine: Engine, embedded_model: LoadedModel, adapter_dirs: dict[str, Path]
) -> None:
    """Through the engine (chunked prefill, the fast paths' decode): the model with the
    adapter fused by mlx-lm, greedy, alone."""
    reference = tiny_model("llama", embedded_model, seed=SEED)
    mlx_lm_with_adapter(reference.model, adapter_dirs["style"], fuse=True)
    ids = prompt(PROMPT_LENGTHS[0], salt=5)
    served = tokens(run_all(engine, [request("fuse", ids, "style")])[0])
    expected: list[int] = []
    from tests.greedy_ties import next_logits

    for _ in range(MAX_TOKENS):
        expected.append(int(np.argmax(next_logits(reference, [*ids, *expected]))))
    assert_same_or_near_tie(reference, ids, expected, served)


def test_cache_is_kept_per_adapter(loaded: LoadedModel, adapter_dirs: dict[str, Path]) -> None:
    """The engine mixes each adapter's fingerprint into the request's cache salt: a
    second run under the same adapter reads its blocks and gives the uncached run's
    result; another adapter, and the base model, read none of them."""
    cached = start(loaded, adapter_dirs, block_size=8)
    try:
        ids = prompt(PROMPT_LENGTHS[0], salt=9)

        def once(rid: str, adapter: str | None) -> list[EngineEvent]:
            return run_all(cached, [request(rid, ids, adapter)])[0]

        def read(events: list[EngineEvent]) -> int:
            usage = events[-1].usage
            assert usage is not None
            return usage.cached_tokens

        first = once("c1", "style")
        assert read(first) == 0
        again = once("c2", "style")
        assert read(again) >= 32  # the prompt's whole blocks
        assert_same_as_solo(first, again, "cached under style")
        for rid, other in (("c3", "peft"), ("c4", None), ("c5", "commit")):
            assert read(once(rid, other)) == 0, f"{other} read style's blocks"
        assert read(once("c6", None)) >= 32  # the base model's own blocks still serve it
    finally:
        cached.shutdown()


def test_speculative_verify_applies_the_adapter(
    loaded: LoadedModel, adapter_dirs: dict[str, Path], engine: Engine
) -> None:
    """A draft model (here the base model itself, drafting without the adapter) proposes;
    verification runs with each row's adapter, so the output is the plain engine's."""
    spec = start(
        loaded,
        adapter_dirs,
        prefix_cache=False,
        speculation=SpeculationConfig("draft", num_tokens=3, cost_aware=False, draft=loaded),
    )
    try:
        prompts = [prompt(n, salt=30 + i) for i, n in enumerate(PROMPT_LENGTHS)]
        reqs = [
            request(f"sp{i}", ids, n) for i, (ids, n) in enumerate(zip(prompts, ROWS, strict=True))
        ]
        plain = [run_all(engine, [r])[0] for r in reqs]
        drafted = run_all(spec, reqs)
        for name, alone, candidate in zip(ROWS, plain, drafted, strict=True):
            assert_greedy_equal_up_to_tie(
                tokens(alone),
                tokens(candidate),
                recorded_scores(alone),
                tolerance=F32_TIE,
                what=str(name),
            )
        status = spec.speculation_status()
        assert status["verify_steps"] and status["draft_tokens"], status
    finally:
        spec.shutdown()


def test_bad_adapters_and_requests_are_refused(
    engine: Engine, embedded_model: LoadedModel, tmp_path: Path
) -> None:
    ids = prompt(8, salt=40)

    async def unknown() -> None:
        engine.submit(request("x", ids, "nope"))

    with pytest.raises(ValueError, match=r"unknown adapter 'nope' \(loaded: style, commit, peft\)"):
        asyncio.run(unknown())
    with pytest.raises(AdapterError, match="no such adapter directory"):
        engine.add_adapter("missing", tmp_path / "missing")
    # Shapes checked on the engine thread, the error raised here.
    wide = tiny_model("llama", embedded_model, overrides={"intermediate_size": 96}).model
    folder = write_mlx_adapter(
        tmp_path / "wide", random_pairs(wide, MLX_KEYS, seed=1), scale=1.0, layers=2
    )
    with pytest.raises(AdapterError, match="do not fit"):
        engine.add_adapter("wide", folder)
    with pytest.raises(KeyError, match="no adapter named 'wide'"):
        engine.remove_adapter("wide")
    assert engine.adapter_names() == ["style", "commit", "peft"]

    async def in_use() -> None:
        long = dataclasses.replace(
            request("busy", ids, "peft"),
            sampling=SamplingParams(max_tokens=4000, temperature=0, stop_at_eos=False),
        )
        stream = engine.submit(long)
        with pytest.raises(ValueError, match="'peft' is in use by 1 request"):
            await asyncio.to_thread(engine.remove_adapter, "peft")
        engine.abort("busy")
        events = [event async for event in stream]
        assert events[-1].finish_reason is FinishReason.ABORTED

    asyncio.run(in_use())
    assert "peft" in engine.adapter_names()
