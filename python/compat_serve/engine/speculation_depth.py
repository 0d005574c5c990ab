"""`--speculative-tokens auto`: the deepest draft worth verifying, chosen per model from
measured acceptance and measured step cost, and chosen again as acceptance drifts.

A verify step of depth k (each row drafts up to k tokens; the step feeds k + 1
positions) emits, per row, one token of the model's own plus the drafts it accepts. Of
the drafts proposed at position i, the fraction accepted is `a_i` (the telemetry of
`SpeculationStats`: a draft position is accepted only with every position before it, so
`a_i` is already the chance of reaching and passing i). A step of depth k is expected to
emit `E(k) = 1 + a_1 + ... + a_k` tokens per row and costs `c(k)` plain steps (the
measured wall time of a verify of width k + 1 over a plain step of as many rows,
`StepCosts`). A plain step emits one token for one plain step, so depth k pays
`E(k) / c(k)` tokens per plain-step time, and `choose_depth` takes the k in
`1..AUTO_MAX_DEPTH` that maximises it (the shallower on a tie).

`DepthTuner` keeps the counts behind `a_i`, halved at each choice so they follow the
recent text, and chooses again every `EVERY` verify steps. A position the depth in use
no longer drafts stops being measured: once its halved count falls under
`MIN_PROPOSED` it counts as unmeasured, and an unmeasured `a_i` is taken to be `a_{i-1}`
(the most it can be in expectation: passing i needs passing i - 1). That optimistic
estimate is the floor that lets a deeper depth be tried again when acceptance rises: the
depth grows while the estimate says the next position would pay, the next choice then
measures it, and a depth that did not pay is left until its count decays again.
Unmeasured costs are taken from `StepCosts.estimate` (interpolated, else the widest
measured: optimistic the same way). The per-step choice of how many drafted tokens to
verify (`StepCosts.choose_width`, `RowState`) still runs under the chosen depth.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from compat_serve.engine.step_costs import StepCosts

AUTO = "auto"
AUTO_MAX_DEPTH = 8
# The depth `auto` starts at, before anything is measured (the fixed default's).
AUTO_START_DEPTH = 4


def expected_tokens(acceptance: Sequence[float], depth: int) -> float:
    """Tokens a row is expected to emit from one verify step of `depth`."""
    return 1.0 + sum(acceptance[:depth])


def choose_depth(acceptance: Sequence[float], relative_cost: Sequence[float]) -> int:
    """The depth k (1-based) that maximises `expected_tokens(acceptance, k) /
    relative_cost[k - 1]`: `acceptance[i]` is position i + 1's, `relative_cost[i]` the
    cost of a verify step of depth i + 1 in plain steps (at least one)."""
    best, best_score = 1, -1.0
    for depth in range(1, min(len(acceptance), len(relative_cost)) + 1):
        score = expected_tokens(acceptance, depth) / max(relative_cost[depth - 1], 1.0)
        if score > best_score:
            best, best_score = depth, score
    return best


class DepthTuner:
    """The depth in use under `--speculative-tokens auto` (see the module docstring)."""

    EVERY = 16  # verify steps between choices
    DECAY = 0.5  # the counts' weight after each choice
    MIN_PROPOSED = 4.0  # drafts at a position before its acceptance counts as measured

    def __init__(self, max_depth: int = AUTO_MAX_DEPTH) -> None:
        self.max_depth = max_depth
        self.depth = min(AUTO_START_DEPTH, max_depth)
        self.choices = 0
        self._proposed = [0.0] * max_depth
        self._accepted = [0.0] * max_depth
        self._steps = 0

    def record(self, drafted: int, accepted: int) -> None:
        """One row of a verify step: `drafted` tokens proposed, the first `accepted` kept."""
        for i in range(min(drafted, self.max_depth)):
            self._proposed[i] += 1.0
            self._accepted[i] += 1.0 if i < accepted else 0.0

    def acceptance(self) -> list[float]:
        """Each position's acceptance; an unmeasured one's is the position before it's
        (position 1's: 1.0, so depth 1 is always worth measuring)."""
        table: list[float] = []
        previous = 1.0
        for proposed, accepted in zip(self._proposed, self._accepted, strict=True):
            if proposed >= self.MIN_PROPOSED:
                previous = accepted / proposed
            table.append(previous)
        return table

    def after_verify(self, costs: StepCosts, rows: int) -> bool:
        """Count a verify step of `rows` rows; every `EVERY` steps choose the depth again
        (True when it changed)."""
        self._steps += 1
        if self._steps % self.EVERY:
            return False
        plain = costs.estimate(rows, 1)
        relative = [
            1.0 if plain is None else (costs.estimate(rows, depth + 1) or plain) / plain
            for depth in range(1, self.max_depth + 1)
        ]
        chosen = choose_depth(self.acceptance(), relative)
        self._proposed = [p * self.DECAY for p in self._proposed]
        self._accepted = [a * self.DECAY for a in self._accepted]
        self.choices += 1
        changed, self.depth = chosen != self.depth, chosen
        return changed
