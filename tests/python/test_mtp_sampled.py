"""Sampled output with `--speculative mtp` follows the model's own distribution.

The unit test of the rule is tests/python/test_speculative_distribution.py; this one runs
it through the engine: the embedded SmolLM2 at temperature 1 with a random-weight head,
many requests batched, each emitting its third to fifth tokens from verify steps (every
row drafts 2 tokens at its first verify; the head's hidden state exists only after the
first plain decode step, so tokens 1-2 are never drafted).

Each such token `t`, drawn from the engine, is compared with the distribution `p` a plain
forward of the model (its module called once on whole sequences: no engine, no KV cache,
no batching of rows of different lengths) gives at its position, by the
randomised probability integral transform: with tokens ordered by falling `p`,
`u = P(tokens before t) + V * p(t)` (V uniform on [0, 1), seeded) is uniform on [0, 1)
exactly when `t ~ p`, whatever `p` is, and the transforms of a row's successive tokens are
independent (Rosenblatt). Ten equal bins, chi-square, p > 1e-4 required. Emitting drafts
the target would reject puts `u` near 1 (a random head's tokens are far down `p`): with
every draft kept the same test gave p < 1e-14 (notes/2026-11-29-mtp-combos.md). It does
not see a rejection resampled from `p` instead of the residual (a random head's `q` is
too diffuse for that to matter): the unit test covers that. The two
numeric paths' `p` differ by float rounding (~1e-3 relative), far below what a few
hundred samples can detect.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from compat_serve.engine.mtp_head import MTPHead
from compat_serve.engine.types import EngineRequest, SamplingParams
from tests.chi_square import p_value
from tests.python.test_mtp import engine_for, random_head  # noqa: F401 (a fixture)
from tests.python.test_speculative import outputs, tokens

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

ROWS = 64
OUT = 5  # tokens 3 to 5 (indices 2-4) come from verify steps, 2 drafted at the first
BINS = 10


def transforms(p: np.ndarray, drawn: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The randomised PIT of each `drawn[i]` under `p[i]` (rows of `[n, vocab]`)."""
    order = np.argsort(-p, axis=-1, kind="stable")
    ranked = np.take_along_axis(p, order, axis=-1)
    rank = np.argmax(order == drawn[:, None], axis=-1)
    before = (
        np.cumsum(ranked, axis=-1)[np.arange(len(drawn)), rank]
        - ranked[np.arange(len(drawn)), rank]
    )
    u = before + rng.random(len(drawn)) * p[np.arange(len(drawn)), drawn]
    return np.clip(u, 0.0, np.nextafter(1.0, 0.0))  # rounding must not drop a sample


def test_sampled_mtp_tokens_follow_the_models_softmax(
    embedded_model: LoadedModel,
    random_head: MTPHead,  # noqa: F811
) -> None:
    prompt = embedded_model.tokenizer.encode("Once upon a time, in a small village,")
    reqs = [
        EngineRequest(
            f"t{i}",
            list(prompt),
            SamplingParams(max_tokens=OUT, temperature=1.0, seed=1000 + i, stop_at_eos=False),
        )
        for i in range(ROWS)
    ]
    engine = engine_for(embedded_model, random_head, prefix_cache=True, max_num_seqs=32)
    try:
        got = [tokens(e) for e in outputs(engine, reqs)]
        status = engine.speculation_status()
    finally:
        engine.shutdown()
    assert all(len(t) == OUT for t in got)
    assert int(status["draft_tokens"]) >= 2 * ROWS, status  # type: ignore[call-overload]

    sequences = mx.array([[*prompt, *t] for t in got])
    logits = embedded_model.model(sequences)[:, len(prompt) + 1 : len(prompt) + OUT - 1]
    p = np.array(mx.softmax(logits.astype(mx.float32), axis=-1), dtype=np.float64)
    p /= p.sum(axis=-1, keepdims=True)
    drawn = np.array([t[2:] for t in got])
    u = transforms(p.reshape(-1, p.shape[-1]), drawn.ravel(), np.random.default_rng(0))
    counts = np.histogram(u, bins=BINS, range=(0.0, 1.0))[0]
    assert counts.sum() == ROWS * (OUT - 2)
    assert p_value(counts, np.full(BINS, 1.0 / BINS)) > 1e-4, counts
