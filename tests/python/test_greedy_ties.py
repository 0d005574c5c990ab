"""The tie-aware greedy check (tests/greedy_ties.py) fails where it must: a difference at a
large margin of the reference, a candidate token the reference ranks far below its best,
a sequence that stops early. It passes equal sequences and a real near tie only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from tests.chat_prompts import chat_ids
from tests.greedy_ties import (
    F32_TIE,
    alone_scores,
    assert_argmax_equal_up_to_tie,
    assert_chat_same_or_near_tie,
    assert_greedy_equal_up_to_tie,
    assert_same_as_engine_or_near_tie,
    assert_same_or_near_tie,
    engine_scores,
    first_difference,
)

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel


def scores_with(best: int, runner_up: int, margin: float, vocab: int = 8) -> np.ndarray:
    scores = np.zeros(vocab)
    scores[best], scores[runner_up] = 5.0, 5.0 - margin
    return scores


def test_first_difference_counts_a_length_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 4, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_equal_sequences_never_ask_for_scores() -> None:
    def never(i: int) -> np.ndarray:
        raise AssertionError(f"scores asked for at {i}")

    assert assert_greedy_equal_up_to_tie([1, 2, 3], [1, 2, 3], never, tolerance=1e-3) is None


def test_a_near_tie_is_accepted_and_ends_the_comparison() -> None:
    tie = assert_greedy_equal_up_to_tie(
        [1, 2, 3, 4], [1, 5, 0, 0], lambda i: scores_with(2, 5, 2e-4), tolerance=1e-3
    )
    assert tie is not None and (tie.position, tie.candidate_token) == (1, 5)
    assert tie.margin == pytest.approx(2e-4)


def test_a_difference_at_a_large_margin_fails() -> None:
    with pytest.raises(AssertionError, match="not a near tie"):
        assert_greedy_equal_up_to_tie(
            [1, 2, 3], [1, 5, 3], lambda i: scores_with(2, 5, 0.5), tolerance=1e-3
        )


def test_a_candidate_token_far_below_a_tied_pair_fails() -> None:
    """The reference's top two are tied, but the candidate picked neither."""
    with pytest.raises(AssertionError, match="not tied"):
        assert_greedy_equal_up_to_tie(
            [1, 2, 3], [1, 7, 3], lambda i: scores_with(2, 5, 1e-5), tolerance=1e-3
        )


def test_a_candidate_token_missing_from_a_top_k_table_fails() -> None:
    table = {2: -0.1, 5: -0.1001}
    with pytest.raises(AssertionError, match="not tied"):
        assert_greedy_equal_up_to_tie([2], [9], lambda i: table, tolerance=1e-3)


def test_a_sequence_that_stops_early_fails() -> None:
    with pytest.raises(AssertionError, match="stops early"):
        assert_greedy_equal_up_to_tie(
            [1, 2, 3], [1, 2], lambda i: scores_with(3, 4, 0.0), tolerance=1
        )


def test_on_the_real_model_a_runner_up_at_a_real_margin_fails(embedded_model: LoadedModel) -> None:
    """The embedded model's greedy tokens, alone; a candidate that takes the runner-up
    where the margin is large is caught, and the same candidate passes only with a
    tolerance above that margin (the check reads the reference's real logits)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model: Any = embedded_model.model
    prompt = chat_ids(embedded_model, "What is 2+2?")
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    reference: list[int] = []
    margins = []
    for _ in range(6):
        order = np.argsort(np.array(logits))
        reference.append(int(order[-1]))
        margins.append((float(logits[order[-1]] - logits[order[-2]]), int(order[-2])))
        logits = model(mx.array([[reference[-1]]]), cache=cache)[0, -1]
    position = max(range(len(margins)), key=lambda i: margins[i][0])
    margin, runner_up = margins[position]
    assert margin > 100 * F32_TIE  # a decided position, not a tie
    candidate = [*reference[:position], runner_up, *reference[position + 1 :]]
    with pytest.raises(AssertionError, match="not a near tie"):
        assert_same_or_near_tie(embedded_model, prompt, reference, candidate)
    scores = alone_scores(embedded_model, prompt, reference)
    tie = assert_greedy_equal_up_to_tie(reference, candidate, scores, tolerance=margin * 1.01)
    assert tie is not None and tie.candidate_gap == pytest.approx(margin, rel=1e-3)


def test_an_engine_reference_reads_its_own_margin(embedded_model: LoadedModel) -> None:
    """`engine_scores` teacher-forces the engine on the reference's tokens: its best token
    at each position is the reference's, and a changed token at a decided position fails."""
    import asyncio

    from compat_serve.engine.config import EngineConfig
    from compat_serve.engine.engine import Engine
    from compat_serve.engine.types import EngineRequest, SamplingParams

    engine = Engine(embedded_model, EngineConfig(prefix_cache=False))
    engine.start()
    try:
        request = EngineRequest(
            "ref", chat_ids(embedded_model, "Name a colour."), SamplingParams(4, temperature=0)
        )

        async def go() -> list[int]:
            return [t async for e in engine.submit(request) for t in e.token_ids]

        reference = asyncio.run(go())
        assert len(reference) == 4
        scores = engine_scores(engine, request, reference)
        table = scores(2)
        assert max(table, key=lambda t: table[t]) == reference[2]
        ranked = sorted(table.values(), reverse=True)
        assert ranked[0] - ranked[1] > 100 * F32_TIE  # a decided position
        runner_up = sorted(table, key=lambda t: table[t])[-2]
        candidate = [*reference[:2], runner_up, reference[3]]
        with pytest.raises(AssertionError, match="not a near tie"):
            assert_same_as_engine_or_near_tie(engine, request, reference, candidate)
        assert assert_same_as_engine_or_near_tie(engine, request, reference, reference) is None
    finally:
        engine.shutdown()


def chat_body(tokens: list[str], tops: list[dict[str, float]]) -> dict[str, Any]:
    content = [
        {
            "token": t,
            "logprob": top[t],
            "top_logprobs": [{"token": k, "logprob": v} for k, v in top.items()],
        }
        for t, top in zip(tokens, tops, strict=True)
    ]
    message = {"role": "assistant", "content": "".join(tokens)}
    return {"choices": [{"message": message, "logprobs": {"content": content}}]}


def test_chat_completions_compare_by_their_top_logprobs() -> None:
    decided = {"Paris": -0.01, " Lyon": -4.6}
    tied = {" is": -0.6931, " was": -0.6932}
    reference = chat_body(["Paris", " is"], [decided, tied])
    assert assert_chat_same_or_near_tie(reference, reference) is None
    tie = assert_chat_same_or_near_tie(reference, chat_body(["Paris", " was"], [decided, tied]))
    assert tie is not None and tie.position == 1
    with pytest.raises(AssertionError, match="not a near tie"):
        assert_chat_same_or_near_tie(reference, chat_body([" Lyon", " is"], [decided, tied]))


def test_argmax_rows_part_only_on_a_near_tie() -> None:
    """`assert_argmax_equal_up_to_tie`: a row whose greedy token moved off a decided margin
    fails; a row that parted on a near tie of the reference passes and is reported."""
    reference = np.array([[0.0, 5.0, 1.0], [2.0, 2.0005, -1.0]], dtype=np.float32)
    same_up_to_tie = np.array([[0.0, 5.0, 1.0], [2.0005, 2.0, -1.0]], dtype=np.float32)
    ties = assert_argmax_equal_up_to_tie(reference, same_up_to_tie, tolerance=F32_TIE)
    assert [t.position for t in ties] == [0] and ties[0].candidate_token == 0
    wrong_row = np.array([[0.0, 1.0, 5.0], [2.0, 2.0005, -1.0]], dtype=np.float32)
    with pytest.raises(AssertionError, match="not a near tie"):
        assert_argmax_equal_up_to_tie(reference, wrong_row, tolerance=F32_TIE)
