"""Rejection sampling (`sampling.accept_draft`) keeps the target distribution: a
statistical test of the first two emitted tokens.

A toy two-token "language model" with exact tables: the target's next-token
distributions `p0` and `p1[t0]` (temperature 0.8 and top-p 0.9 applied by the request's
own sampler, so some tokens have probability 0), and a drafter's `q0` and `q1[t0]` that
put mass where `p` has none. Speculative decoding is simulated the way the engine runs it:
two drafts verified at once; when the first is rejected, the second token comes from the
next step, which drafts again from the emitted token. The joint distribution of
`(t0, t1)` must be `p0[t0] * p1[t0][t1]` exactly, whatever the drafter.

Pearson's chi-square over the 20 cells `p` allows (a count in any other cell fails at
once), at three fixed seeds, each required to give p > 1e-4 (the least expected count is
37): a correct rule fails with probability under 3e-4 per fresh seed set; the seeds
are fixed, so the outcome is deterministic. Against the two usual mistakes (emitting every
draft; resampling a rejection from `p` instead of the residual `max(p - q, 0)`) the same
samples give p-values below 1e-13 at every seed, for either drafter
(notes/2026-11-29-mtp-combos.md).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest

from compat_serve.engine.sampling import RequestSampler, accept_draft
from compat_serve.engine.types import SamplingParams
from tests.chi_square import chi_square_survival, p_value

V = 6
SAMPLES = 8_000
SEEDS = (0, 1, 2)
ALPHA = 1e-4


def _target_tables() -> tuple[np.ndarray, np.ndarray]:
    """`p0 [V]` and `p1 [V, V]` (row t0: the distribution after t0), as the request's
    sampler turns logits into the distribution it samples (temperature, top-p)."""
    sampler = RequestSampler(SamplingParams(max_tokens=2, temperature=0.8, top_p=0.9, seed=0))
    logits = np.random.default_rng(45).normal(0.0, 1.5, size=(V + 1, V)).astype(np.float32)
    probs = np.array(sampler.probs(mx.array(logits)), dtype=np.float64)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs[0], probs[1:]


def _draft_tables() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    q = rng.dirichlet(np.full(V, 0.7), size=V + 1)
    return q[0], q[1:]


UNIFORM = np.full(V, 1.0 / V)


def sample_pairs(
    seed: int, *, deterministic: bool, rule: Callable[..., list[int]] = accept_draft
) -> np.ndarray:
    """Counts `[V, V]` of the first two emitted tokens over `SAMPLES` runs."""
    p0, p1 = _target_tables()
    q0, q1 = _draft_tables()
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V))
    for _ in range(SAMPLES):
        if deterministic:  # a drafter that always proposes its own most likely token
            d0 = int(q0.argmax())
            d1 = int(q1[d0].argmax())
            draft_probs = None
        else:
            d0 = int(rng.choice(V, p=q0))
            d1 = int(rng.choice(V, p=q1[d0]))
            draft_probs = np.stack([q0, q1[d0]])
        out = rule(np.stack([p0, p1[d0], UNIFORM]), [d0, d1], rng, draft_probs)
        t0 = out[0]
        if len(out) >= 2:
            t1 = out[1]
        else:  # the next step drafts again, from the token just emitted
            d = int(q1[t0].argmax()) if deterministic else int(rng.choice(V, p=q1[t0]))
            t1 = rule(
                np.stack([p1[t0], UNIFORM]), [d], rng, None if deterministic else q1[t0 : t0 + 1]
            )[0]
        counts[t0, t1] += 1
    return counts


def expected_pairs() -> np.ndarray:
    p0, p1 = _target_tables()
    return p0[:, None] * p1


def test_the_chi_square_survival_function_matches_its_closed_forms() -> None:
    """Even degrees of freedom have a closed form: exp(-x/2) sum_{i<df/2} (x/2)^i / i!."""
    for x in (0.5, 3.0, 10.0, 40.0):
        for df in (2, 4, 10):
            closed = np.exp(-x / 2) * sum(
                (x / 2) ** i / np.prod(np.arange(1, i + 1)) for i in range(df // 2)
            )
            assert abs(chi_square_survival(x, df) - closed) <= 1e-12 * max(1.0, closed) + 1e-15


def test_the_toy_tables_exercise_the_rule() -> None:
    """Top-p leaves impossible tokens the drafter still proposes, and q differs from p."""
    p0, p1 = _target_tables()
    q0, _ = _draft_tables()
    assert (p0 == 0).any() and (p1 == 0).any()
    assert q0[p0 == 0].sum() > 0.05
    assert np.abs(p0 - q0).sum() > 0.3


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-drafter", "point-drafter"])
def test_the_first_two_emitted_tokens_follow_the_target_distribution(deterministic: bool) -> None:
    want = expected_pairs()
    for seed in SEEDS:
        counts = sample_pairs(seed, deterministic=deterministic)
        assert p_value(counts, want) > ALPHA, (seed, counts)
