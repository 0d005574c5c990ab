"""A test-only switch that nudges every output of the Rust CPU kernels by one ulp.

Two CPUs sum floats in different orders (SIMD width, OpenBLAS core type), so a test that
compares two numeric paths sees other noise on another machine. With
`COMPAT_SERVE_TEST_PERTURB_ULP=1` each float32 a kernel writes (`matmul_nt`, `swiglu_mlp`,
`attention_decode`, `DecodeBlock`) moves one ulp, up at even flat indices and down at odd
ones: a fixed, deterministic pattern of the size of that noise, so one machine shows what
the others would. The variable is read once, at import; off, the cost is one bool test per
kernel call. Never set it outside tests.
"""

from __future__ import annotations

import os

import numpy as np

PERTURB_ENV = "COMPAT_SERVE_TEST_PERTURB_ULP"
PERTURB = os.environ.get(PERTURB_ENV, "").strip().lower() in ("1", "on", "true", "yes")


def nudge(out: np.ndarray) -> None:
    """Moves each value of the float32 array `out` (contiguous, written in place) one ulp:
    up at even flat indices, down at odd ones."""
    flat = out.reshape(-1)
    flat[0::2] = np.nextafter(flat[0::2], np.float32(np.inf))
    flat[1::2] = np.nextafter(flat[1::2], np.float32(-np.inf))
