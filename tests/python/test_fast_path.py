"""The fast CPU path (models/blas.py): an optimized BLAS is active under the test process.

`tests/conftest.py` calls `ensure_fast_blas()` before anything imports mlx.core. The matmul
floor is a functional check that the fast BLAS is really what MLX calls (the bundled
reference BLAS does ~3 GFLOP/s here, OpenBLAS 50+), not a benchmark.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import mlx.core as mx

from compat_serve.models.blas import ensure_fast_blas, fast_blas_status


def test_fast_blas_is_active() -> None:
    status = fast_blas_status()
    assert status.active, status.describe()
    if sys.platform == "linux":
        assert status.library is not None and "blas" in status.library.lower()
    assert ensure_fast_blas() is status  # idempotent


def test_dense_f32_matmul_is_fast() -> None:
    n = 1024
    a = mx.random.normal((n, n), key=mx.random.key(0))
    b = mx.random.normal((n, n), key=mx.random.key(1))
    mx.eval(a, b, a @ b)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - start)
    gflops = 2 * n**3 / best / 1e9
    assert gflops > 5, f"{gflops:.1f} GFLOP/s: the fast BLAS is not what MLX is calling"


def _status_in_subprocess(code: str, **env: str) -> str:
    script = textwrap.dedent(code)
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**os.environ, **env},
    )
    return out.stdout.strip().splitlines()[-1]


def test_disabled_by_env() -> None:
    line = _status_in_subprocess(
        """
        from compat_serve.models.blas import ensure_fast_blas
        s = ensure_fast_blas()
        print(s.active, s.source)
        """,
        COMPAT_SERVE_BLAS="none",
    )
    assert line == "False disabled"


def test_too_late_after_mlx_import_is_reported() -> None:
    line = _status_in_subprocess(
        """
        import mlx.core
        from compat_serve.models.blas import ensure_fast_blas
        s = ensure_fast_blas()
        print(s.active, s.source)
        """,
        COMPAT_SERVE_BLAS="",
    )
    assert line == "False too-late"


def test_bad_env_path_warns_and_continues() -> None:
    line = _status_in_subprocess(
        """
        from compat_serve.models.blas import ensure_fast_blas, fast_blas_status
        s = ensure_fast_blas()
        print(s.active, s.source, fast_blas_status() is s)
        """,
        COMPAT_SERVE_BLAS="/nonexistent/libopenblas.so.0",
    )
    assert line == "False not-found True"
