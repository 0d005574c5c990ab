"""The test-only one-ulp nudge of the Rust kernels' outputs (models/kernel_perturbation.py),
used by `make test-numeric-variants`: it moves each value exactly one ulp in its fixed
pattern, it reaches a kernel's output, and it is off unless the variable is set."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from compat_serve.models import cpu_linear, kernel_perturbation
from compat_serve.models.kernel_perturbation import PERTURB_ENV, nudge


def test_nudge_moves_each_value_one_ulp_up_at_even_and_down_at_odd_indices() -> None:
    values = np.array([[1.0, 1.0, -3.5], [0.0, 1e-30, 7.0]], dtype=np.float32)
    out = values.copy()
    nudge(out)
    flat, before = out.reshape(-1), values.reshape(-1)
    up = np.float32(np.inf)
    down = np.float32(-np.inf)
    expected = [np.nextafter(v, up if i % 2 == 0 else down) for i, v in enumerate(before)]
    assert flat.tolist() == [float(v) for v in expected]
    assert np.all(out != values)


def test_a_kernel_output_is_nudged_only_when_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    x = mx.random.normal((2, 64), key=mx.random.key(0))
    w = mx.random.normal((8, 64), key=mx.random.key(1))
    plain = np.array(cpu_linear.skinny_product(x, w))
    monkeypatch.setattr(cpu_linear, "PERTURB", True)
    nudged = np.array(cpu_linear.skinny_product(x, w))
    expected = plain.copy()
    nudge(expected)
    assert np.array_equal(nudged, expected)
    assert not np.array_equal(nudged, plain)


def test_the_switch_is_off_by_default_and_read_from_the_environment() -> None:
    assert PERTURB_ENV == "COMPAT_SERVE_TEST_PERTURB_ULP"
    assert kernel_perturbation.PERTURB is (os.environ.get(PERTURB_ENV) == "1")
    code = "from compat_serve.models.kernel_perturbation import PERTURB; print(PERTURB)"
    for value, shown in (("1", "True"), ("", "False"), ("0", "False")):
        env = {**os.environ, PERTURB_ENV: value}
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert run.stdout.strip() == shown
