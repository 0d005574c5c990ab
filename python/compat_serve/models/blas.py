"""The fast CPU path: an optimized BLAS loaded with global symbols before `mlx.core`.

The Linux `mlx[cpu]` wheel links a bundled *reference* BLAS (~3 GFLOP/s for a dense f32
matmul on the target machine). `libmlx.so` resolves `cblas_sgemm` lazily through the global
symbol scope first, so a library that exports unprefixed `cblas_*` symbols and was loaded with
`RTLD_GLOBAL` *before* `mlx.core` is imported wins, and matmuls run 15-20x faster (measured
50-70 GFLOP/s with Debian's `libopenblas0-pthread`). Loading it after `mlx.core` has no effect.

This module must not import mlx. Call `ensure_fast_blas()` at the very top of the entry point
(the CLI, the test conftest) before anything imports `mlx.core`.

Environment:
    COMPAT_SERVE_BLAS=/path/to/libopenblas.so.0   use this library
    COMPAT_SERVE_BLAS=none                        do not load any (reference BLAS, slow)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "BLAS_ENV",
    "BlasSource",
    "BlasStatus",
    "ensure_fast_blas",
    "fast_blas_status",
]

logger = logging.getLogger(__name__)

BLAS_ENV = "COMPAT_SERVE_BLAS"

BlasSource = Literal[
    "env",  # COMPAT_SERVE_BLAS=/path
    "preloaded",  # already in the global scope (LD_PRELOAD or loaded by someone earlier)
    "known-path",  # a distribution path we know about
    "ldconfig",  # found through `ldconfig -p`
    "find_library",  # found through ctypes.util.find_library
    "disabled",  # COMPAT_SERVE_BLAS=none
    "not-needed",  # not Linux: MLX uses Accelerate (macOS) or has no CPU BLAS issue
    "not-found",  # nothing usable on this machine
    "too-late",  # mlx.core was imported before ensure_fast_blas() ran
    "not-attempted",  # ensure_fast_blas() has not run yet
]

FIX_HINT = (
    "install an optimized BLAS: `sudo apt-get install libopenblas0-pthread` (Debian/Ubuntu) "
    "or run `make setup`; or point COMPAT_SERVE_BLAS at a library exporting unprefixed "
    "cblas_* symbols"
)

# Debian/Ubuntu (pthread variant first: it is the one `make setup` installs), Fedora, Arch.
_KNOWN_PATHS: tuple[str, ...] = (
    "/usr/lib/{triplet}/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{triplet}/libopenblas.so.0",
    "/usr/lib/{triplet}/openblas-openmp/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/lib/libopenblas.so",
)
_LIB_NAMES: tuple[str, ...] = ("libopenblas.so.0", "libopenblasp.so.0", "libopenblas.so")
_FAST_MARKERS: tuple[str, ...] = ("openblas", "mkl", "blis")


@dataclass(frozen=True)
class BlasStatus:
    """What `ensure_fast_blas()` did.

    `active` is True when an optimized BLAS provides the global `cblas_sgemm` that libmlx binds
    to (or when the platform does not need one: `source == "not-needed"`).
    """

    active: bool
    source: BlasSource
    library: str | None = None
    reason: str | None = None

    def describe(self) -> str:
        if self.source == "not-needed":
            return f"fast BLAS not needed ({self.reason})"
        if self.active:
            return f"fast BLAS active: {self.library} ({self.source})"
        return f"fast BLAS NOT active ({self.source}): {self.reason}"


_lock = threading.Lock()
_state: dict[str, BlasStatus] = {}  # "status" -> the recorded outcome
_handles: list[ctypes.CDLL] = []  # keep loaded libraries alive


class _DlInfo(ctypes.Structure):
    _fields_ = (
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    )


def _global_sgemm_provider() -> str | None:
    """Path of the library that provides `cblas_sgemm` in the process' global scope."""
    try:
        process = ctypes.CDLL(None)
        symbol = process.cblas_sgemm
    except (OSError, AttributeError):
        return None
    try:
        address = ctypes.cast(symbol, ctypes.c_void_p).value
        info = _DlInfo()
        if not process.dladdr(ctypes.c_void_p(address), ctypes.byref(info)):
            return "<unknown>"
        return os.fsdecode(info.dli_fname) if info.dli_fname else "<unknown>"
    except (OSError, AttributeError):
        return "<unknown>"


def _is_fast(path: str) -> bool:
    name = os.path.basename(path).lower()
    return any(marker in name for marker in _FAST_MARKERS)


def _in_ld_preload(path: str) -> bool:
    entries = os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
    real = os.path.realpath(path)
    return any(
        os.path.realpath(e) == real or os.path.basename(e) == os.path.basename(path)
        for e in entries
    )


def _mlx_already_loaded() -> bool:
    if "mlx.core" in sys.modules:
        return True
    if sys.platform != "linux":  # /proc is Linux's; elsewhere sys.modules is the answer
        return False
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any("libmlx" in line for line in maps)
    except OSError:
        return False


def _multiarch_triplet() -> str:
    machine = platform.machine()
    return {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(
        machine, f"{machine}-linux-gnu"
    )


def _ldconfig_candidates() -> list[str]:
    ldconfig = shutil.which("ldconfig") or (
        "/sbin/ldconfig" if os.path.exists("/sbin/ldconfig") else None
    )
    if ldconfig is None:
        return []
    try:
        out = subprocess.run(
            [ldconfig, "-p"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found: list[str] = []
    for line in out.splitlines():
        name, _, rest = line.strip().partition(" ")
        if name in _LIB_NAMES and "=>" in rest:
            found.append(rest.split("=>", 1)[1].strip())
    return found


def _candidates() -> list[tuple[BlasSource, str]]:
    triplet = _multiarch_triplet()
    out: list[tuple[BlasSource, str]] = [
        ("known-path", p.format(triplet=triplet)) for p in _KNOWN_PATHS
    ]
    out += [("ldconfig", p) for p in _ldconfig_candidates()]
    lib = ctypes.util.find_library("openblas")
    if lib:
        out.append(("find_library", lib))
    seen: set[str] = set()
    unique: list[tuple[BlasSource, str]] = []
    for source, path in out:
        if path in seen or (os.path.isabs(path) and not os.path.exists(path)):
            continue
        seen.add(path)
        unique.append((source, path))
    return unique


def _try_load(path: str) -> str | None:
    """Load `path` with global symbols; None on success, else why not."""
    try:
        handle = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        return f"cannot load {path}: {exc}"
    if not hasattr(handle, "cblas_sgemm"):
        return f"{path} does not export an unprefixed cblas_sgemm"
    _handles.append(handle)
    return None


def _decide() -> BlasStatus:
    env = os.environ.get(BLAS_ENV, "").strip()
    if env.lower() in {"none", "off", "0", "false", "no", "disable", "disabled"}:
        return BlasStatus(False, "disabled", reason=f"{BLAS_ENV}={env}")
    if sys.platform != "linux":
        return BlasStatus(True, "not-needed", reason=f"platform {sys.platform}")

    provider = _global_sgemm_provider()
    if (
        provider is not None
        and _is_fast(provider)
        and (_in_ld_preload(provider) or not _mlx_already_loaded())
    ):
        return BlasStatus(True, "preloaded", library=provider)

    if _mlx_already_loaded():
        return BlasStatus(
            False,
            "too-late",
            reason="mlx.core was imported before ensure_fast_blas(); call it first",
        )

    if env:
        error = _try_load(env)
        if error is not None:
            return BlasStatus(False, "not-found", reason=f"{BLAS_ENV}: {error}")
        return BlasStatus(True, "env", library=_global_sgemm_provider() or env)

    errors: list[str] = []
    for source, path in _candidates():
        error = _try_load(path)
        if error is None:
            return BlasStatus(True, source, library=_global_sgemm_provider() or path)
        errors.append(error)
    reason = "no optimized BLAS found" + (f" ({'; '.join(errors)})" if errors else "")
    return BlasStatus(False, "not-found", reason=reason)


def ensure_fast_blas() -> BlasStatus:
    """Load an optimized BLAS with global symbols, once; call before importing `mlx.core`.

    Never raises: when nothing usable is found it logs a loud warning with the fix and MLX
    runs on its reference BLAS (correct, ~15x slower matmuls).
    """
    with _lock:
        if "status" in _state:
            return _state["status"]
        status = _decide()
        _state["status"] = status
    if status.active:
        logger.info("%s", status.describe())
    elif status.source == "disabled":
        logger.warning("%s: MLX CPU matmuls will be ~15x slower", status.describe())
    elif status.source == "too-late":
        logger.warning(
            "!!! %s. MLX on the CPU will be ~15x slower. Fix: call "
            "compat_serve.models.blas.ensure_fast_blas() before anything imports mlx.core, "
            "or start Python with LD_PRELOAD=<path to libopenblas.so.0>.",
            status.describe(),
        )
    else:
        logger.warning(
            "!!! %s. MLX on the CPU will be ~15x slower. Fix: %s.", status.describe(), FIX_HINT
        )
    return status


def fast_blas_status() -> BlasStatus:
    """The recorded status, or `not-attempted` (with what the process has now) if never run."""
    if "status" in _state:
        return _state["status"]
    provider = _global_sgemm_provider() if sys.platform == "linux" else None
    if (
        provider is not None
        and _is_fast(provider)
        and (_in_ld_preload(provider) or not _mlx_already_loaded())
    ):
        return BlasStatus(True, "preloaded", library=provider)
    return BlasStatus(False, "not-attempted", reason="ensure_fast_blas() has not been called")
