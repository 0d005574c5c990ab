"""The engine's thinking-budget counter (engine/reasoning_budget.py) and the server's
mapping of budgets and effort levels (server/reasoning_budgets.py), without a model."""

from __future__ import annotations

import pytest

from compat_serve.chat.types import ThinkingAsk
from compat_serve.engine.reasoning_budget import BudgetCounter, ReasoningBudget
from compat_serve.server.errors import ApiError
from compat_serve.server.reasoning_budgets import ReasoningBudgets, parse_levels

FORCED = (901, 902, 903)  # stand-ins for the ids of "</think>\n\n"


def budget(tokens: int, open_tag: str = "<think>") -> ReasoningBudget:
    return ReasoningBudget(tokens, open_tag, "</think>", FORCED)


def run(counter: BudgetCounter, pieces: list[str]) -> list[int | str]:
    """Feeds `pieces` as sampled tokens (their text); a forced token replaces a piece and
    is recorded as its id."""
    taken: list[int | str] = []
    for i, text in enumerate(pieces):
        forced = counter.next_forced()
        if forced is not None:
            counter.observe(forced, "<forced>")
            taken.append(forced)
        else:
            counter.observe(i, text)
            taken.append(text)
    return taken


def test_a_block_the_prompt_opened_is_closed_after_exactly_the_budget() -> None:
    counter = BudgetCounter(budget(3, open_tag=""))
    taken = run(counter, ["a", "b", "c", "d", "e", "f", "answer"])
    assert taken == ["a", "b", "c", *FORCED, "answer"]
    assert counter.spent == 3 and counter.state == "done"


def test_a_block_the_output_opens_counts_from_the_token_after_the_tag() -> None:
    counter = BudgetCounter(budget(2))
    taken = run(counter, ["\n", "<th", "ink>\n", "x", "y", "z", "1", "2", "answer"])
    assert taken == ["\n", "<th", "ink>\n", "x", "y", *FORCED, "answer"]


def test_a_model_that_closes_in_time_is_left_alone() -> None:
    counter = BudgetCounter(budget(4))
    taken = run(counter, ["<think>", "x", "</", "think>", "y", "z", "w"])
    assert taken == ["<think>", "x", "</", "think>", "y", "z", "w"]
    assert counter.state == "done" and counter.spent == 3


def test_an_output_that_starts_with_an_answer_has_no_budget() -> None:
    counter = BudgetCounter(budget(1))
    assert run(counter, [" <", "b>", "x", "y", "z"]) == [" <", "b>", "x", "y", "z"]
    assert counter.state == "done"


def test_budget_zero_closes_at_once() -> None:
    inside = BudgetCounter(budget(0, open_tag=""))
    assert run(inside, ["a", "b", "c", "d"]) == [*FORCED, "d"]
    opened = BudgetCounter(budget(0))
    assert run(opened, ["<think>", "a", "b", "c", "d"]) == ["<think>", *FORCED, "d"]


def test_drafts_never_reach_the_forced_close() -> None:
    counter = BudgetCounter(budget(5, open_tag=""))
    assert counter.draft_room() == 4  # 4 drafts + the model's own token = 5
    run(counter, ["a", "b", "c", "d"])
    assert counter.draft_room() == 0  # one sampled token left
    run(counter, ["e"])
    assert counter.next_forced() == FORCED[0] and counter.draft_room() == 0
    run(counter, ["f", "g", "h"])
    assert counter.draft_room() is None  # closed: no limit
    assert BudgetCounter(budget(5)).draft_room() == 0  # the tag may still open it


def test_a_negative_budget_or_no_close_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        ReasoningBudget(-1, "", "</think>", FORCED)
    with pytest.raises(ValueError, match="close"):
        ReasoningBudget(1, "", "</think>", ())


def test_levels_map_efforts_and_name_the_allowed_ones() -> None:
    budgets = ReasoningBudgets(parse_levels("low=8, medium=16"), default=32)
    assert budgets.resolve(None) == 32
    assert budgets.resolve(ThinkingAsk()) == 32
    assert budgets.resolve(ThinkingAsk(budget=1500)) == 1500
    assert budgets.resolve(ThinkingAsk(effort="medium")) == 16
    assert budgets.resolve(ThinkingAsk(effort="none")) == 0
    assert budgets.resolve(ThinkingAsk(effort="minimal")) == 0
    with pytest.raises(ApiError) as caught:
        budgets.resolve(ThinkingAsk(effort="max", field="reasoning.effort"))
    assert caught.value.status == 400
    assert "reasoning.effort" in str(caught.value.message)
    assert "none, minimal, low, medium" in str(caught.value.message)


@pytest.mark.parametrize(
    ("flag", "error"),
    [
        ("low", "LEVEL=TOKENS"),
        ("low=x", "not a number"),
        ("low=-1", "negative"),
        ("none=5", "always means no reasoning"),
    ],
)
def test_bad_reasoning_budgets_flags_fail_at_start(flag: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_levels(flag)
