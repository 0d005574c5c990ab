"""What a decode step costs, measured online per shape (rows x positions), and how many
drafted tokens per row a verify step should take on given those costs (`StepCosts`)."""

from __future__ import annotations

import statistics
from collections import deque


class StepCosts:
    """Wall time of a decode forward of `rows` rows by `width` positions (1: a plain step;
    more: a verify step, its drafting and rollback included), measured online: the
    median of the last `WINDOW` steps of that shape (a shared machine's load spikes
    only add time, and a mean would keep them).

    What a verify step costs against a plain one depends on the platform and the shape:
    on a GPU a few more positions cost about nothing (decode reads the weights once
    either way); on this CPU, whose plain step has a fused one-position path, a verify
    step costs two to four plain steps. So nothing is assumed: `choose_width` compares
    measured costs. A batch size first verifies one drafted token per row; a shape never
    measured is estimated from its measured neighbours (between a narrower and a wider
    one; else as the nearest narrower one: the GPU case), and a step verifies at most one
    position more than the widest measured, so widths are tried from the narrowest up
    while they pay. A batch size that has not verified
    for a while tries again, after 64 plain steps, then 128, ... (at most 4096), the
    shape it measured least recently (an interpolated estimate can hide a cheaper one:
    on this CPU 4 rows x 4 positions still take the skinny matmul kernel, 4 x 5 do not),
    so a cost measured under a load spike does not stick, and exploring costs free
    generation almost nothing."""

    WINDOW = 9
    REEXPLORE_FIRST = 64
    REEXPLORE_MAX = 4096
    # Explore only when the optimistic estimate gains at least this much.
    EXPLORE_GAIN = 1.1

    def __init__(self) -> None:
        self._recent: dict[tuple[int, int], deque[float]] = {}
        self._mean: dict[tuple[int, int], float] = {}  # the median of `_recent`
        self._seen: dict[tuple[int, int], int] = {}  # when each shape was last measured
        self._clock = 0
        self._plain_steps: dict[int, int] = {}  # per batch size, since its last verify
        self._explore_after: dict[int, int] = {}

    def observe(self, rows: int, width: int, seconds: float) -> None:
        key = (rows, width)
        recent = self._recent.setdefault(key, deque(maxlen=self.WINDOW))
        recent.append(seconds)
        self._mean[key] = statistics.median(recent)
        self._clock += 1
        self._seen[key] = self._clock
        if width > 1:
            self._plain_steps[rows] = 0

    def estimate(self, rows: int, width: int) -> float | None:
        """The measured cost; else interpolated between the nearest measured narrower and
        wider shapes of as many rows; else the nearest narrower one's; else None."""
        exact = self._mean.get((rows, width))
        if exact is not None:
            return exact
        widths = sorted(w for r, w in self._mean if r == rows)
        lower = [w for w in widths if w < width]
        upper = [w for w in widths if w > width]
        if not lower:
            return None
        lo = lower[-1]
        low_cost = self._mean[(rows, lo)]
        if not upper:
            return low_cost
        hi = upper[0]
        high_cost = max(self._mean[(rows, hi)], low_cost)
        return low_cost + (high_cost - low_cost) * (width - lo) / (hi - lo)

    def choose_width(self, drafts: list[list[int]], rates: list[float]) -> int:
        """How many drafted tokens per row to verify this step (0: a plain step): the cap
        that maximises expected emitted tokens per second. A row with draft `d` and
        acceptance rate `a` emits `1 + a + a^2 + ... + a^min(cap, len(d))` tokens."""
        rows = len(drafts)
        longest = max((len(d) for d in drafts), default=0)
        if longest == 0:
            return 0
        plain = self.estimate(rows, 1)
        if plain is None:  # try the narrowest verify first, then measure a plain step
            return 0 if any(r == rows for r, _ in self._mean) else 1
        expected = [
            sum(
                sum(rate**j for j in range(min(cap, len(draft)) + 1))
                for draft, rate in zip(drafts, rates, strict=True)
            )
            for cap in range(longest + 1)
        ]
        best, best_rate = 0, rows / plain
        widest = max(w for r, w in self._mean if r == rows)
        for cap in range(1, min(longest, widest) + 1):  # one wider than measured at most
            cost = self.estimate(rows, cap + 1)
            tokens_per_s = expected[cap] / max(plain if cost is None else cost, plain)
            if tokens_per_s > best_rate:
                best, best_rate = cap, tokens_per_s
        if best:
            return best
        waited = self._plain_steps.get(rows, 0) + 1
        self._plain_steps[rows] = waited
        after = self._explore_after.get(rows, self.REEXPLORE_FIRST)
        if waited >= after and expected[longest] >= self.EXPLORE_GAIN * rows:
            self._explore_after[rows] = min(2 * after, self.REEXPLORE_MAX)
            widths = range(2, longest + 2)
            return min(widths, key=lambda w: self._seen.get((rows, w), -1)) - 1
        return 0

    def measured(self) -> dict[tuple[int, int], float]:
        """Each measured (rows, width)'s cost in seconds (the median of its window)."""
        return dict(self._mean)

    def status(self) -> dict[str, float]:
        """Measured costs in ms by shape, e.g. `{"4x1": 61.2, "4x5": 118.0}`."""
        return {f"{r}x{w}": round(c * 1000, 1) for (r, w), c in sorted(self._mean.items())}
