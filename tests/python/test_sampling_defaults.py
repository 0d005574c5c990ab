"""Which sampling settings a request that sends none gets (server/sampling_defaults.py)."""

from __future__ import annotations

import pytest

from compat_serve.engine.types import SamplingParams
from compat_serve.server.sampling_defaults import (
    SamplingDefaults,
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


def test_a_flag_overrides_the_model_file() -> None:
    d = resolve_sampling_defaults({"temperature": 0.6, "top_p": 0.95}, GEN, temperature=0.0)
    assert (d.temperature, d.top_p) == (0.0, 0.95)
    assert d.sources["temperature"] == "command line"
    d = resolve_sampling_defaults({}, GEN, top_p=0.5, top_k=1)
    assert (d.temperature, d.top_p, d.top_k) == (1.0, 0.5, 1)


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
