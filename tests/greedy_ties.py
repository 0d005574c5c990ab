"""Tie-aware greedy equality: the one check every test uses that compares greedy tokens
with a reference path (alone vs batched, cached vs uncached, mlx-lm's caches, one rank...).

Two numeric paths that compute the same function still sum floats in different orders
(batch shape, chunked prefill, SIMD width of the CPU, Metal vs CUDA), so their logits
differ by a little noise. Greedy decoding turns that noise into a different token where
the reference's two best logits are closer than the noise: a near tie. From there on the
two sequences are different texts and no longer comparable.

`assert_greedy_equal_up_to_tie` therefore compares the two token lists exactly up to the
first difference, and there asserts that the difference is a near tie *of the reference*:
its top-two logit margin is below `tolerance`, and the candidate's token is within
`tolerance` of the reference's best (it is the runner-up, or tied with it). A real
divergence (a mixed-up batch row, a stale cache block) picks a token the reference ranks
far below its best and fails. After a tie it stops comparing.

Tolerances are per numeric path (measured in benches/greedy_tie_tolerances.py; the list of
tests and the numbers are in docs/notes/2026-11-27-tie-aware-tests.md): about twice to
seven times the largest change of a top-two margin measured between the two paths, and
below what a real divergence shows (a token the reference ranks whole logits down).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from compat_serve.engine.types import MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from compat_serve.engine.engine import Engine
    from compat_serve.engine.kv_quant import KVFormat
    from compat_serve.engine.types import EngineEvent, EngineRequest
    from compat_serve.models.types import LoadedModel

# float32 KV, weights float32 (the embedded model dequantized on the CPU, the tiny random
# models) or kept quantized (the users' path, --dtype quantized): batched vs alone, cached
# vs uncached, drafts vs plain, one rank vs two, the Rust kernels vs MLX's ops. Measured
# (benches/greedy_tie_tolerances.py, 8 prompts x 24 tokens; 8 on quantized weights):
# log-probabilities differ by at most 7.1e-5 between these paths, so a top-two margin
# moves by at most ~1.4e-4; the smallest margin met on the way was 5e-3.
F32_TIE = 1e-3
# 8-bit KV (q8, group 64), against mlx-lm's `QuantizedKVCache` or the engine's own 8-bit
# path in another batch shape: a float-order difference of 1e-6 in a new K/V row moves a
# value across a rounding boundary, a whole quantization step, and such steps add up over
# the decode. Measured: the top-two margin moves by up to 0.23 within 24 tokens (kernels on
# or off); with the kernels off prompt 6 departs at token 11 on a margin of 0.032.
Q8_KV_TIE = 0.5
# 4-bit KV: a step is 1/15 of the group's range, 17 times an 8-bit step. Measured: the
# top-two margin moves by up to 1.3 within 24 tokens; the bound is twice that, as Q8's is
# (0.5 over 0.23 measured). 4-bit KV departs from mlx-lm's cache onto its third choice, so
# it is compared only against the engine's own 4-bit path (MTP drafts vs plain decoding).
Q4_KV_TIE = 2.6

# The reference's scores at one position: a vector over the vocabulary (logits or
# log-probabilities; only differences matter), or the top few as {token: score}.
Scores = Any
ScoresAt = Callable[[int], Scores]


@dataclass(frozen=True)
class NearTie:
    """Where two greedy sequences part, and how close the reference was to a tie there."""

    position: int
    reference_token: Hashable  # a token id, or its text where an API reports texts
    candidate_token: Hashable
    margin: float  # reference: best score - second-best score
    candidate_gap: float  # reference: best score - score of the candidate's token


def first_difference(reference: Sequence[Hashable], candidate: Sequence[Hashable]) -> int | None:
    """The first position where the two lists differ (a length difference counts), or None."""
    for i, (a, b) in enumerate(zip(reference, candidate, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


def _as_mapping(scores: Scores) -> Mapping[Hashable, float]:
    if isinstance(scores, Mapping):
        return {t: float(s) for t, s in scores.items()}
    flat = np.asarray(scores, dtype=np.float64).reshape(-1)
    return dict(enumerate(flat.tolist()))


def tie_at(
    scores: Scores, position: int, reference_token: Hashable, candidate_token: Hashable
) -> NearTie:
    """The reference's margin at `position`, and how far below its best the candidate's token is
    (infinite when the reference's scores do not list it: a top-k that left it out)."""
    table = _as_mapping(scores)
    ranked = sorted(table.values(), reverse=True)
    assert len(ranked) >= 2, f"position {position}: need two scores, got {table}"
    best = ranked[0]
    candidate = table.get(candidate_token, -np.inf)
    return NearTie(position, reference_token, candidate_token, best - ranked[1], best - candidate)


def assert_greedy_equal_up_to_tie(
    reference: Sequence[Hashable],
    candidate: Sequence[Hashable],
    reference_scores: ScoresAt,
    *,
    tolerance: float,
    what: str = "",
) -> NearTie | None:
    """Exact equality up to the first difference; there, a near tie of the reference.

    `reference_scores(i)` gives the reference's scores for the token at position `i` (after
    the prompt and `reference[:i]`); it is called only where the lists differ. Returns the
    tie it accepted (None when the lists are equal)."""
    i = first_difference(reference, candidate)
    if i is None:
        return None
    label = f"{what}: " if what else ""
    assert i < len(reference) and i < len(candidate), (
        f"{label}one sequence stops early at {i} without a different token: "
        f"{list(reference)} vs {list(candidate)}"
    )
    tie = tie_at(reference_scores(i), i, reference[i], candidate[i])
    detail = (
        f"{label}position {i}: reference {tie.reference_token}, candidate {tie.candidate_token}; "
        f"reference margin {tie.margin:.3g}, candidate {tie.candidate_gap:.3g} below its best "
        f"(tolerance {tolerance:g})\nreference {list(reference)}\ncandidate {list(candidate)}"
    )
    assert tie.margin < tolerance, "not a near tie: " + detail
    assert tie.candidate_gap < tolerance, "the candidate's token is not tied: " + detail
    print("near tie accepted: " + detail.split("\n", maxsplit=1)[0])  # shown by pytest -rP
    return tie


def assert_argmax_equal_up_to_tie(
    reference: Any, candidate: Any, *, tolerance: float = F32_TIE, what: str = ""
) -> list[NearTie]:
    """The greedy token of each row of two logits arrays (`[..., vocab]`, MLX or numpy) is
    the same, or the two paths part on a near tie of the reference's row. Returns the ties
    accepted. For `argmax(a) == argmax(b)` between two float paths, which fails on any
    machine whose float noise lands on a row's near tie."""
    ref = np.asarray(reference, dtype=np.float32)
    cand = np.asarray(candidate, dtype=np.float32)
    assert ref.shape == cand.shape, (ref.shape, cand.shape)
    ref, cand = ref.reshape(-1, ref.shape[-1]), cand.reshape(-1, cand.shape[-1])
    ties = []
    for row in range(ref.shape[0]):
        tie = assert_greedy_equal_up_to_tie(
            [int(ref[row].argmax())],
            [int(cand[row].argmax())],
            lambda _, row=row: ref[row],
            tolerance=tolerance,
            what=f"{what} row {row}".strip(),
        )
        if tie is not None:
            ties.append(tie)
    return ties


def next_logits(
    loaded: LoadedModel,
    ids: Sequence[int],
    kv_format: KVFormat | None = None,
    prompt_length: int | None = None,
) -> Any:
    """The model's next-token logits after `ids`, alone (batch of one) on a fresh cache of
    mlx-lm's: float32 KV in one forward pass, or `QuantizedKVCache` of `kv_format` the way
    greedy decoding fills it: `ids[:prompt_length]` in one pass, then one token at a time.
    (A quantized cache read by many queries at once gives other logits, by up to ~0.3 on
    the embedded model: the shape of the quantized products matters; float32 KV does not
    care, ~1e-5.)"""
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    model: Any = loaded.model
    if kv_format is None or kv_format.bits is None:
        logits = model(mx.array([list(ids)]), cache=make_prompt_cache(model))[0, -1]
        return np.array(logits.astype(mx.float32))
    cache = [QuantizedKVCache(kv_format.group_size, kv_format.bits) for _ in model.layers]
    split = len(ids) if prompt_length is None else prompt_length
    logits = model(mx.array([list(ids[:split])]), cache=cache)[0, -1]
    for token in ids[split:]:
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return np.array(logits.astype(mx.float32))


def top2_gap(loaded: LoadedModel, ids: Sequence[int]) -> float:
    """Gap between the two largest next-token logits, computed alone (batch of one)."""
    top = np.sort(next_logits(loaded, ids))[-2:]
    return float(top[1] - top[0])


def alone_scores(
    loaded: LoadedModel,
    prompt: Sequence[int],
    reference: Sequence[int],
    kv_format: KVFormat | None = None,
) -> ScoresAt:
    """The reference's scores when the reference is the model run alone on `prompt`."""
    return lambda i: next_logits(loaded, [*prompt, *reference[:i]], kv_format, len(prompt))


def engine_scores(engine: Engine, request: EngineRequest, reference: Sequence[int]) -> ScoresAt:
    """The reference's scores when the reference is `engine` serving `request`: its top-20
    log-probabilities at position `i`. Without a grammar, one prefill of the prompt and
    `reference[:i]` (teacher forcing; prefill and decode differ by float order only). With
    one, the request again (its grammar state must advance), checked to retrace
    `reference[:i]`."""

    def at(i: int) -> Mapping[int, float]:
        sampling = dataclasses.replace(
            request.sampling,
            max_tokens=1 if request.grammar is None else i + 1,
            logprobs=MAX_TOP_LOGPROBS,
            stop_strings=(),
            stop_at_eos=False,
        )
        prompt = request.prompt_ids
        if request.grammar is None:
            prompt = (*prompt, *reference[:i])
        probe = dataclasses.replace(
            request, request_id=f"{request.request_id}-tie{i}", prompt_ids=prompt, sampling=sampling
        )

        async def go() -> list[EngineEvent]:
            return [e async for e in engine.submit(probe)]

        events = asyncio.run(go())
        assert events[-1].error is None, events[-1].error
        if request.grammar is not None:
            tokens = [t for e in events for t in e.token_ids]
            assert tokens[:i] == list(reference[:i]), (tokens, list(reference))
        recorded = [lp for e in events for lp in e.logprobs]
        assert len(recorded) == (1 if request.grammar is None else i + 1), recorded
        return dict(recorded[-1].top)  # the last position's: the token at `i`

    return at


def recorded_scores(events: Sequence[EngineEvent]) -> ScoresAt:
    """The reference's scores from its own engine run with `SamplingParams(logprobs=k)`: the
    top-k log-probabilities it recorded at each position (a token outside them is far)."""
    table = [
        {t: s for t, s in lp.top} for e in events for lp in e.logprobs
    ]  # one per emitted token
    return lambda i: table[i]


def assert_same_or_near_tie(
    loaded: LoadedModel,
    prompt: Sequence[int],
    alone: Sequence[int],
    batched: Sequence[int],
    *,
    tolerance: float = F32_TIE,
    kv_format: KVFormat | None = None,
) -> NearTie | None:
    """`assert_greedy_equal_up_to_tie` where the reference is the model alone on `prompt`
    (float32 KV, or mlx-lm's `QuantizedKVCache` of `kv_format`)."""
    return assert_greedy_equal_up_to_tie(
        alone, batched, alone_scores(loaded, prompt, alone, kv_format), tolerance=tolerance
    )


def assert_same_as_engine_or_near_tie(
    engine: Engine,
    request: EngineRequest,
    reference: Sequence[int],
    candidate: Sequence[int],
    *,
    tolerance: float = F32_TIE,
) -> NearTie | None:
    """`assert_greedy_equal_up_to_tie` where the reference is `engine` serving `request`
    (an uncached engine, one rank, a vision model with its images...)."""
    return assert_greedy_equal_up_to_tie(
        reference, candidate, engine_scores(engine, request, reference), tolerance=tolerance
    )


def chat_tokens(body: Mapping[str, Any]) -> list[str]:
    """The tokens (as texts) of an OpenAI chat completion asked with `logprobs: true`."""
    return [entry["token"] for entry in body["choices"][0]["logprobs"]["content"]]


def assert_chat_same_or_near_tie(
    reference: Mapping[str, Any], candidate: Mapping[str, Any], *, tolerance: float = F32_TIE
) -> NearTie | None:
    """Two greedy OpenAI chat completions (bodies asked with `logprobs: true` and
    `top_logprobs`), compared token by token; the reference's margin is read from its own
    `top_logprobs` (a log-probability difference is a logit difference)."""
    content = reference["choices"][0]["logprobs"]["content"]

    def scores(i: int) -> Mapping[Hashable, float]:
        return {top["token"]: top["logprob"] for top in content[i]["top_logprobs"]}

    tie = assert_greedy_equal_up_to_tie(
        chat_tokens(reference), chat_tokens(candidate), scores, tolerance=tolerance
    )
    if tie is None:
        assert candidate["choices"][0]["message"] == reference["choices"][0]["message"]
    return tie
