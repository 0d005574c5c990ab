"""Which sampling settings a request that sends none gets (server/sampling_defaults.py)."""

from __future__ import annotations

import pytest

from compat_serve.engine.types import SamplingParams
from compat_serve.server.sampling_defaults import (
    SamplingDefaults,
    check_generation_config_choice,
    check_sampling_flags,
    resolve_sampling_defaults,
)

GEN = "generation_config.json"


def test_the_model_file_then_built_in_values() -> None:
    d = resolve_sampling_defaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20}, GEN)
    assert (d.temperature, d.top_p, d.top_k) == (0.6, 0.95, 20)
    assert d.sources == {"temperature": GEN, "top_p": GEN, "top_k": GEN}
    d = resolve_sampling_defaults({"temperature": 0.7, "eos_token_id": 2}, GEN)
    assert (d.temperature, d.top_p, d.top_k) == (0.7, 1.0, 0)
    assert d.sources == {"temperature": GEN, "top_p": "built-in", "top_k": "built-in"}
    assert resolve_sampling_defaults({}, GEN) == SamplingDefaults()


def test_the_model_file_wins_over_a_flag_which_the_log_names() -> None:
    d = resolve_sampling_defaults({"temperature": 0.6, "top_p": 0.95}, GEN, temperature=0.7)
    assert (d.temperature, d.top_p) == (0.6, 0.95)
    assert d.sources["temperature"] == GEN
    assert d.shadowed_flags == {"temperature": 0.7}
    assert d.describe().startswith(
        "temperature 0.6 (generation_config.json; --default-temperature 0.7 is used only "
        "when the model sets none; --generation-config none to ignore the model's file), "
        "top_p 0.95 (generation_config.json), top_k 0 (built-in)"
    )
    assert "shadowed_flags" not in d.as_dict()  # the API shows values and sources only


def test_a_flag_applies_where_the_model_file_is_silent() -> None:
    d = resolve_sampling_defaults({"temperature": 0.6}, GEN, temperature=0.0, top_p=0.5, top_k=1)
    assert (d.temperature, d.top_p, d.top_k) == (0.6, 0.5, 1)
    assert d.sources == {"temperature": GEN, "top_p": "command line", "top_k": "command line"}
    assert d.shadowed_flags == {"temperature": 0.0}
    assert "--default-top-p" not in d.describe()


def test_a_fallback_comes_after_the_flags_and_before_the_built_in_values() -> None:
    card = {"temperature": 0.2, "top_p": 0.9}
    d = resolve_sampling_defaults({}, GEN, fallback=card, fallback_source="card")
    assert (d.temperature, d.top_p, d.top_k) == (0.2, 0.9, 0)
    assert d.sources == {"temperature": "card", "top_p": "card", "top_k": "built-in"}
    d = resolve_sampling_defaults({}, GEN, temperature=0.0, fallback=card, fallback_source="card")
    assert (d.temperature, d.top_p) == (0.0, 0.9)
    assert d.sources["temperature"] == "command line"
    assert d.shadowed_flags == {}  # only the model's own file shadows a flag
    d = resolve_sampling_defaults({"top_p": 0.8}, GEN, fallback=card, fallback_source="card")
    assert (d.top_p, d.sources["top_p"]) == (0.8, GEN)


@pytest.mark.parametrize(
    "config",
    [
        {"temperature": "0.2", "top_p": None, "top_k": 2.5},
        {"temperature": -1, "top_p": 0, "top_k": True},
        {"temperature": 3.0, "top_p": 1.5},
    ],
)
def test_unusable_values_in_the_model_file_are_ignored(config: dict[str, object]) -> None:
    assert resolve_sampling_defaults(config, GEN) == SamplingDefaults()


def test_negative_top_k_in_the_model_file_means_off() -> None:
    assert resolve_sampling_defaults({"top_k": -1}, GEN).top_k == 0


def test_apply_fills_only_what_the_request_left_unset() -> None:
    d = SamplingDefaults(0.2, 0.9, 40)
    unset = d.apply(SamplingParams(max_tokens=4))
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.2, 0.9, 40)
    sent = d.apply(SamplingParams(max_tokens=4, temperature=1.0, top_p=1.0, top_k=0))
    assert (sent.temperature, sent.top_p, sent.top_k) == (1.0, 1.0, 0)
    greedy = d.apply(SamplingParams(max_tokens=4, temperature=0))
    assert greedy.greedy and greedy.top_p == 0.9


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ((2.5, None, None), "--default-temperature"),
        ((-0.1, None, None), "--default-temperature"),
        ((None, 0.0, None), "--default-top-p"),
        ((None, 1.1, None), "--default-top-p"),
        ((None, None, -1), "--default-top-k"),
    ],
)
def test_bad_flags_name_themselves(
    flags: tuple[float | None, float | None, int | None], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_sampling_flags(*flags)
    check_sampling_flags(0.0, 1.0, 0)  # the edges are fine


def test_generation_config_takes_auto_or_none() -> None:
    check_generation_config_choice("auto")
    check_generation_config_choice("none")
    with pytest.raises(ValueError, match="--generation-config"):
        check_generation_config_choice("vllm")
