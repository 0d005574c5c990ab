"""Pearson's chi-square goodness-of-fit test, without SciPy (not a dependency).

`p_value(counts, probs)` is the probability that a sample drawn from `probs` would show a
statistic at least as large as `counts` does. The survival function of the chi-square
distribution is the regularised upper incomplete gamma function `Q(df / 2, x / 2)`,
computed here from its power series (exact to float64 rounding for the sizes tests use).
"""

from __future__ import annotations

import math

import numpy as np


def chi_square_survival(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square with `df` degrees of freedom."""
    if x <= 0:
        return 1.0
    a, z = df / 2.0, x / 2.0
    # P(a, z) = z^a e^-z / Gamma(a + 1) * sum_n z^n / ((a + 1) ... (a + n))
    term, total, n = 1.0, 1.0, 0
    while term > total * 1e-17:
        n += 1
        term *= z / (a + n)
        total += term
    lower = math.exp(a * math.log(z) - z - math.lgamma(a + 1.0)) * total
    return max(0.0, 1.0 - lower)


def p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """The goodness-of-fit p-value of observed `counts` against cell probabilities
    `probs` (same shape, summing to 1). Cells of probability 0 must be empty: a count
    there is impossible under `probs`, and the p-value is 0."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    live = probs > 0
    expected = probs[live] / probs[live].sum() * counts.sum()
    statistic = float((((counts[live] - expected) ** 2) / expected).sum())
    return chi_square_survival(statistic, int(live.sum()) - 1)
