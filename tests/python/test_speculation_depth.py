"""`--speculative-tokens auto` (engine/speculation_depth.py): the depth rule on given
acceptance and cost tables (expected values worked out by hand from the formula
`(1 + a_1 + ... + a_k) / c(k)`), the tuner's measured table as acceptance drifts, the
flag's parsing, and `auto` in the engine: greedy-exact, its chosen depth reported."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from compat_serve.bootstrap import ServeOptions
from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.speculation import SpeculationConfig
from compat_serve.engine.speculation_depth import DepthTuner, choose_depth, expected_tokens
from compat_serve.engine.step_costs import StepCosts
from compat_serve.serve_flags import build_serve_parser
from compat_serve.serve_models import ModelFlags, build_hub, entry_options
from tests.greedy_ties import assert_same_or_near_tie
from tests.python.test_speculative import outputs, requests, tokens

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel


@pytest.mark.parametrize(
    ("acceptance", "cost", "depth"),
    [
        # 1.9/1.2 = 1.58, 2.7/1.5 = 1.80, 3.2/2.0 = 1.60, 3.3/3.0 = 1.10
        ([0.9, 0.8, 0.5, 0.1], [1.2, 1.5, 2.0, 3.0], 2),
        # Verify costs nothing more (a GPU): every accepted position pays, 3.3 at depth 4.
        ([0.9, 0.8, 0.5, 0.1], [1.0, 1.0, 1.0, 1.0], 4),
        # Nothing pays: still depth 1 (each step's own policy then decodes plainly).
        ([0.1, 0.0], [3.0, 4.0], 1),
        # A tie (1.5/1 = 1.5/1) goes to the shallower depth.
        ([0.5, 0.0], [1.0, 1.0], 1),
        # A cost under one plain step counts as one: 1.6/1 against 2.2/1.
        ([0.6, 0.6], [0.5, 0.9], 2),
    ],
)
def test_choose_depth_maximises_expected_tokens_per_step_cost(
    acceptance: list[float], cost: list[float], depth: int
) -> None:
    assert choose_depth(acceptance, cost) == depth


def test_expected_tokens_adds_each_positions_acceptance_to_the_models_own_token() -> None:
    assert expected_tokens([0.5, 0.25, 0.125], 2) == 1.75
    assert expected_tokens([0.5, 0.25, 0.125], 3) == 1.875


def _costs(*relative: float) -> StepCosts:
    """One row: a plain step of 1 s, a verify of depth k costing `relative[k - 1]`."""
    costs = StepCosts()
    costs.observe(1, 1, 1.0)
    for depth, seconds in enumerate(relative, start=1):
        costs.observe(1, depth + 1, seconds)
    return costs


def test_depth_tuner_chooses_from_measured_acceptance_and_follows_it_up_again() -> None:
    costs = _costs(1.2, 1.5, 2.0, 3.0)
    tuner = DepthTuner(max_depth=4)
    assert tuner.depth == 4  # the fixed default's depth until something is measured
    # 16 rows drafting 4: 8 reject the first token, 4 accept one, 4 accept two.
    for accepted in [0] * 8 + [1] * 4 + [2] * 4:
        tuner.record(4, accepted)
    assert tuner.acceptance() == [0.5, 0.25, 0.0, 0.0]
    changed = [tuner.after_verify(costs, 1) for _ in range(DepthTuner.EVERY)]
    # 1.5/1.2 = 1.25, 1.75/1.5 = 1.17, 1.75/2 = 0.88, 1.75/3 = 0.58: depth 1, chosen once.
    assert changed == [False] * (DepthTuner.EVERY - 1) + [True]
    assert (tuner.depth, tuner.choices) == (1, 1)
    # The text turns copy-heavy: depth 1's drafts are all accepted. Deeper positions are
    # no longer drafted; their halved counts fall under MIN_PROPOSED and they are
    # estimated as position 1's, so a deeper depth is tried again.
    depths = []
    for _ in range(4):
        for _ in range(DepthTuner.EVERY):
            tuner.record(1, 1)
        for _ in range(DepthTuner.EVERY):
            tuner.after_verify(costs, 1)
        depths.append(tuner.depth)
    # By hand (the counts halve after each choice; position 1 then gains 16 of 16):
    # round 1: position 1 20/24, position 2 2/8 (measured): 1.83/1.2 = 1.53 > 2.08/1.5.
    # round 2: position 1 26/28, position 2 1/4 (still measured): 1.93/1.2 > 2.18/1.5.
    # round 3: position 1 29/30; positions 2-4 under 4 proposed, so estimated 29/30 too:
    # 1.97/1.2 = 1.64, 2.93/1.5 = 1.96, 3.90/2 = 1.95, 4.87/3 = 1.62: depth 2.
    # round 4: position 1 30.5/31, the rest as it: (1 + 2a)/1.5 > (1 + 3a)/2 while a < 1.
    assert depths == [1, 1, 2, 2]
    assert tuner.acceptance() == pytest.approx([30.5 / 31] * 4)


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5", "Auto"])
def test_speculative_tokens_takes_a_positive_integer_or_auto(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_serve_parser()
    assert parser.parse_args(["--speculative-tokens", "auto"]).speculative_tokens == "auto"
    assert parser.parse_args(["--speculative-tokens", "3"]).speculative_tokens == 3
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--speculative-tokens", bad])
    assert exit_.value.code == 2
    error = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert error == [
        "compat-serve: error: argument --speculative-tokens: must be a positive integer or "
        f"auto, not {bad!r}"
    ]


def test_a_models_file_takes_speculative_tokens_auto_and_refuses_other_words(
    tmp_path: Path,
) -> None:
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    models = tmp_path / "models.yaml"
    entry = "models:\n  - id: a\n    path: a.gguf\n    speculative: ngram\n"
    models.write_text(entry + "    speculative_tokens: auto\n")
    hub = build_hub(ServeOptions(), ModelFlags(models_file=str(models)))
    assert entry_options(ServeOptions(), hub.slots["a"].entry).speculative_tokens == "auto"
    models.write_text(entry + "    speculative_tokens: fast\n")
    with pytest.raises(
        ValueError,
        match=rf"{models}:2: model 'a': --speculative-tokens must be a positive integer or "
        "auto, not 'fast'",
    ):
        build_hub(ServeOptions(), ModelFlags(models_file=str(models)))


def test_auto_depth_decodes_greedy_exact_and_reports_its_chosen_depth(
    embedded_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(DepthTuner, "EVERY", 2)  # choose a few times within one request
    reqs = requests(embedded_model, "auto")[:1]  # the copy prompt: drafts are accepted
    results = []
    for tokens_flag in ("off", "auto"):
        engine = Engine(
            embedded_model,
            EngineConfig(
                prefill_chunk=128,
                prefix_cache=False,
                speculation=SpeculationConfig(
                    "off" if tokens_flag == "off" else "ngram",
                    4 if tokens_flag == "off" else "auto",
                    cost_aware=False,
                ),
            ),
        )
        engine.start()
        try:
            results.append((tokens(outputs(engine, reqs)[0]), engine.speculation_status()))
        finally:
            engine.shutdown()
    (expected, _), (got, status) = results
    assert_same_or_near_tie(embedded_model, reqs[0].prompt_ids, expected, got)
    depth = status["draft_depth"]
    assert isinstance(depth, dict) and depth["auto"] is True, status
    assert depth["auto_choices"] >= 1, status
    assert 1 <= depth["max"] <= 8 and 1 <= depth["last"] <= 8, status
    assert int(status["accepted_tokens"]) > 0, status  # type: ignore[call-overload]
