"""What weight plan a loaded model actually runs: its dtype, the `--dtype` asked for, and
which CPU fast paths (models/loader.py) replaced stock mlx-lm code. `/v1/status`, the
dashboard and `/api/ps` report it, so a run on the users' path (`--dtype quantized`: weights
as stored, stock modules, MLX's kernels) can be told from the CPU test-bench path."""

from __future__ import annotations

from typing import Any

from compat_serve.models.types import LoadedModel

__all__ = ["FAST_PATH_KEYS", "weights_status"]

# `LoadedModel.extra` keys the loader sets when it installs a CPU fast path.
FAST_PATH_KEYS = ("weight_layout", "decode_blocks", "attention")


def weights_status(loaded: LoadedModel) -> dict[str, Any]:
    """The weight plan of `loaded` as JSON: `dtype` as loaded ("float32",
    "quantized-4bit"...), `requested` (the --dtype value), `modules` ("stock mlx-lm" or
    "CPU fast paths") and the fast paths installed, each described."""
    fast_paths = {key: loaded.extra[key] for key in FAST_PATH_KEYS if key in loaded.extra}
    return {
        "dtype": loaded.dtype,
        "requested": loaded.extra.get("dtype_requested", "auto"),
        # Set when --dtype auto kept the weights as stored because float32 would not fit.
        "auto_kept_as_stored": loaded.extra.get("dtype_auto"),
        "modules": "CPU fast paths" if fast_paths else "stock mlx-lm",
        "fast_paths": fast_paths,
    }
