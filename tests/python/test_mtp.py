"""`--speculative mtp` (engine/mtp_head.py): a multi-token-prediction head drafts from the
main model's last hidden state, and the engine verifies the drafts.

Exactness does not depend on acceptance: a randomly initialised head (its drafts almost
always rejected) must leave greedy output exactly as plain decoding has it, in a batch
with other rows and alone, through a prefix-cache repeat, and with 8-bit KV.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.kv_quant import KVFormat
from compat_serve.engine.mtp_head import (
    DRAFT_VOCAB,
    MTPHead,
    MTPHeadError,
    load_head,
    new_llama_head,
    quantize_head_weights,
)
from compat_serve.engine.speculation import SpeculationConfig
from compat_serve.engine.types import EngineRequest, FinishReason, SamplingParams, Usage
from tests.chat_prompts import chat_ids
from tests.greedy_ties import Q8_KV_TIE, assert_same_or_near_tie
from tests.python.test_batching import greedy
from tests.python.test_speculative import (
    COPY_PROMPTS,
    FREE_PROMPT,
    assert_telemetry_adds_up,
    outputs,
    tokens,
)

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

Q8 = KVFormat(8, 64)
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def random_head(embedded_model: LoadedModel) -> MTPHead:
    mx.random.seed(45)
    return MTPHead(new_llama_head(embedded_model.model), embedded_model.model)


def engine_for(
    loaded: LoadedModel, head: MTPHead | None, *, prefix_cache: bool = False, **config: object
) -> Engine:
    """Drafting with `head` on every step it can (None: no speculation)."""
    spec = SpeculationConfig("mtp", num_tokens=3, mtp=head, cost_aware=False)
    settings: dict[str, object] = {"prefill_chunk": 128, "max_num_seqs": 8, **config}
    engine = Engine(
        loaded,
        EngineConfig(
            prefix_cache=prefix_cache,
            speculation=spec if head is not None else SpeculationConfig(),
            **settings,  # type: ignore[arg-type]
        ),
    )
    engine.start()
    return engine


def greedy_requests(loaded: LoadedModel, tag: str) -> list[EngineRequest]:
    return [
        EngineRequest(f"{tag}{i}", chat_ids(loaded, text), greedy(MAX_TOKENS))
        for i, text in enumerate([*COPY_PROMPTS, FREE_PROMPT])
    ]


def run_one(engine: Engine, request: EngineRequest) -> tuple[list[int], Usage]:
    async def go() -> tuple[list[int], Usage]:
        events = [e async for e in engine.submit(request)]
        assert events[-1].finish_reason is not FinishReason.ERROR, events[-1].error
        assert events[-1].usage is not None
        return tokens(events), events[-1].usage

    return asyncio.run(go())


@dataclasses.dataclass
class Plain:
    outputs: list[list[int]]  # each greedy request's tokens
    repeat: tuple[int, int]  # the first request again: (cached, created) prompt tokens


@pytest.fixture(scope="module")
def plain(embedded_model: LoadedModel) -> Plain:
    """Plain decoding of the greedy requests batched, then a prefix-cache repeat of the
    first one alone."""
    engine = engine_for(embedded_model, None, prefix_cache=True)
    try:
        reqs = greedy_requests(embedded_model, "p")
        got = [tokens(e) for e in outputs(engine, reqs)]
        _, usage = run_one(engine, dataclasses.replace(reqs[0], request_id="p-again"))
    finally:
        engine.shutdown()
    return Plain(got, (usage.cached_tokens, usage.cache_creation_tokens))


def test_mtp_drafts_leave_greedy_output_unchanged_batched_alone_and_on_a_cache_repeat(
    embedded_model: LoadedModel, random_head: MTPHead, plain: Plain
) -> None:
    """Three greedy rows and a sampled one (drafts drawn from the head's distribution) in
    one batch, then the first greedy request again alone: a prefix-cache repeat, which
    must read exactly what it reads without MTP (drafts never enter the cache)."""
    engine = engine_for(embedded_model, random_head, prefix_cache=True)
    try:
        reqs = greedy_requests(embedded_model, "b")
        sampled = EngineRequest(
            "s",
            chat_ids(embedded_model, FREE_PROMPT),
            SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3),
        )
        batched = outputs(engine, [*reqs, sampled])
        alone, usage = run_one(engine, dataclasses.replace(reqs[0], request_id="alone"))
        status, metrics = engine.speculation_status(), engine.metrics.render()
    finally:
        engine.shutdown()
    for request, want, events in zip(reqs, plain.outputs, batched, strict=False):
        assert_same_or_near_tie(embedded_model, request.prompt_ids, want, tokens(events))
    assert_same_or_near_tie(embedded_model, reqs[0].prompt_ids, plain.outputs[0], alone)
    assert (usage.cached_tokens, usage.cache_creation_tokens) == plain.repeat
    assert plain.repeat[0] > 0, plain.repeat
    assert tokens(batched[-1])  # the sampled row ran to its end
    assert status["mode"] == "mtp", status
    assert int(status["draft_tokens"]) > 10, status  # type: ignore[call-overload]
    assert_telemetry_adds_up(status, 3, metrics)


def test_mtp_with_8_bit_kv_decodes_as_plain_8_bit_kv(
    embedded_model: LoadedModel, random_head: MTPHead
) -> None:
    request = greedy_requests(embedded_model, "q")[2]
    plain_q8 = engine_for(embedded_model, None, kv_format=Q8)
    try:
        want, _ = run_one(plain_q8, request)
    finally:
        plain_q8.shutdown()
    engine = engine_for(embedded_model, random_head, kv_format=Q8)
    try:
        have, _ = run_one(engine, request)
        drafted = int(engine.speculation_status()["draft_tokens"])  # type: ignore[call-overload]
    finally:
        engine.shutdown()
    assert drafted > 0
    assert_same_or_near_tie(
        embedded_model, request.prompt_ids, want, have, tolerance=Q8_KV_TIE, kv_format=Q8
    )


def test_mtp_without_a_head_fails_at_start_naming_the_model_and_the_families(
    embedded_model: LoadedModel,
) -> None:
    from compat_serve.bootstrap import ServeOptions, build_state

    with pytest.raises(MTPHeadError) as caught:
        build_state(ServeOptions(speculative="mtp", prefix_cache=False), embedded_model)
    message = str(caught.value)
    assert "\n" not in message
    assert embedded_model.name in message and "has no MTP weights" in message
    assert "DeepSeek-V3" in message and "Qwen3-Next" in message and "--mtp-head" in message
    with pytest.raises(ValueError, match="--mtp-head is only used with --speculative mtp"):
        SpeculationConfig("ngram", mtp_head="head.safetensors").validate()


def test_a_head_file_missing_a_tensor_names_it_and_a_whole_one_loads(
    embedded_model: LoadedModel, random_head: MTPHead, tmp_path: Path
) -> None:
    weights = dict(tree_flatten(random_head.layer.parameters()))
    whole = tmp_path / "head.safetensors"
    mx.save_safetensors(str(whole), weights)
    loaded = load_head(whole, embedded_model.model)
    for name, value in tree_flatten(loaded.layer.parameters()):
        assert mx.array_equal(value, weights[name]), name
    missing = tmp_path / "partial.safetensors"
    mx.save_safetensors(str(missing), {k: v for k, v in weights.items() if k != "hnorm.weight"})
    with pytest.raises(MTPHeadError, match=r"no tensor 'hnorm\.weight'"):
        load_head(missing, embedded_model.model)
    from compat_serve.bootstrap import ServeOptions, build_state

    options = ServeOptions(speculative="mtp", mtp_head=str(missing), prefix_cache=False)
    with pytest.raises(MTPHeadError, match=r"no tensor 'hnorm\.weight'"):
        build_state(options, embedded_model)


def test_an_8_bit_head_file_loads_within_a_quantization_step(
    embedded_model: LoadedModel, random_head: MTPHead, tmp_path: Path
) -> None:
    """Projections stored 8-bit (mlx-lm's `weight`/`scales`/`biases`, group 64) come back
    within one step (the group's range / 255) of the original: rounding is half a step,
    and mlx snaps the grid so the group's larger edge is exact, shifting it by up to
    half a step more. Norms come back as float16."""
    weights = dict(tree_flatten(random_head.layer.parameters()))
    path = tmp_path / "head-q8.safetensors"
    mx.save_safetensors(str(path), quantize_head_weights(weights, 8))
    loaded = dict(tree_flatten(load_head(path, embedded_model.model).layer.parameters()))
    for name, original in weights.items():
        if original.ndim == 2:
            groups = original.reshape(original.shape[0], -1, 64)
            step = (groups.max(axis=-1) - groups.min(axis=-1)) / 255
            error = mx.abs(loaded[name] - original).reshape(groups.shape).max(axis=-1)
            assert bool(mx.all(error <= step * 1.01 + 1e-7)), name
        else:
            assert mx.array_equal(loaded[name], original.astype(mx.float16).astype(mx.float32))


def test_a_draft_vocabulary_scores_only_its_ids_and_decoding_is_unchanged(
    embedded_model: LoadedModel, random_head: MTPHead, plain: Plain, tmp_path: Path
) -> None:
    """A head file's `draft_vocab` (FR-Spec): the head scores those ids through their rows
    of the tied vocabulary head and every other id gets -inf; the main model verifies, so
    greedy output is plain decoding's. Two float paths (gathered rows vs the whole
    head): each logit is an n = 576-term dot product, and a sum of n terms computed in
    any order is within gamma_n * sum|x_i w_i| of the exact one (gamma_n = n u / (1 - n u),
    u half the dtype's eps), so the two differ by at most twice that."""
    model = embedded_model.model
    ids = mx.array(sorted({*range(0, 49152, 7), *plain.outputs[0]}), dtype=mx.uint32)
    weights = dict(tree_flatten(random_head.layer.parameters()))
    path = tmp_path / "head-vocab.safetensors"
    mx.save_safetensors(str(path), {**weights, DRAFT_VOCAB: ids.astype(mx.int32)})
    head = load_head(path, model)
    assert head.draft_vocab is not None and mx.array_equal(head.draft_vocab, ids)

    hidden = mx.random.normal((3, model.args.hidden_size))
    tokens_in = mx.array([1, 2, 3], dtype=mx.uint32)
    sub, _ = head.step(hidden, tokens_in)
    full, _ = random_head.step(hidden, tokens_in)
    inside = mx.zeros(full.shape[-1], dtype=mx.bool_)
    inside[ids] = True
    assert bool(mx.all(mx.isneginf(sub) != inside[None]))  # -inf exactly outside the ids
    rows = model.model.embed_tokens.weight[ids]
    normed, _ = head._compose(head.layer, head._embed(tokens_in), hidden)
    n, u = rows.shape[-1], mx.finfo(sub.dtype).eps / 2
    gamma = n * u / (1 - n * u)
    bound = 2 * gamma * (mx.abs(normed) @ mx.abs(rows).T)  # [3, len(ids)], per logit
    assert bool(mx.all(mx.abs(sub[:, ids] - full[:, ids]) <= bound))

    engine = engine_for(embedded_model, head)
    try:
        request = greedy_requests(embedded_model, "v")[0]
        have, _ = run_one(engine, request)
        drafted = int(engine.speculation_status()["draft_tokens"])  # type: ignore[call-overload]
    finally:
        engine.shutdown()
    assert drafted > 0
    assert_same_or_near_tie(embedded_model, request.prompt_ids, plain.outputs[0], have)

    bad = tmp_path / "head-bad-vocab.safetensors"
    mx.save_safetensors(str(bad), {**weights, DRAFT_VOCAB: mx.array([5, 49152], dtype=mx.int32)})
    with pytest.raises(MTPHeadError, match="draft_vocab must list token ids below 49152"):
        load_head(bad, model)
