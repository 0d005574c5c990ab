"""One memory figure that is true (#43): the estimate before a load, `/v1/status`
`resident_bytes` and the memory budget's accounting (all `registry.slots.resident_bytes`
/ `models.resident_size`) equal the resident set a load really adds, measured as VmRSS in a
subprocess, within 10%: on the default load (float32 on the CPU) and on `--dtype
quantized`, for a byte-level BPE GGUF with Q4_1/Q8_0 tensors (the embedded SmolLM2) and a
SentencePiece GGUF with K-quants and a 262k vocabulary (Gemma 3 270M). It used to count the
KV and prefix-cache budgets (half the machine's spare memory) as resident: 11.9 GB for a
model that takes 1.1 GB. And `--dtype auto` keeps weights as stored where float32 would
not fit the budget. The embedded model's default load also shows that the text-only
install never imports mlx_vlm: the probe imports the server, the CLI and the engine and
loads as the server does."""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from compat_serve.models.auto_dtype import choose_auto_dtype
from compat_serve.models.resident_size import estimate_resident_bytes
from tests.gemma_gguf import original_gemma_gguf

ROOT = Path(__file__).resolve().parents[2]
MARGIN = 0.10  # the bound; measured 1-8% here (the remainder: allocator slack)


@functools.cache
def _probe(model: str, dtype: str) -> dict[str, object]:
    """One fresh process per load, shared by the checks on it."""
    args = [sys.executable, "-m", "tests.resident_probe", model, dtype]
    done = subprocess.run(args, check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("dtype", ["auto", "quantized"])
@pytest.mark.parametrize("model", ["embedded", "gemma"])
def test_reported_size_is_the_measured_resident_size(model: str, dtype: str) -> None:
    path = str(original_gemma_gguf()) if model == "gemma" else "embedded"
    measured = _probe(path, dtype)
    growth = int(measured["growth"])  # type: ignore[call-overload]
    reported = int(measured["resident_bytes"])  # type: ignore[call-overload]
    assert measured["estimate"] == reported  # one figure before and after the load
    assert abs(reported - growth) <= MARGIN * growth, measured
    assert str(measured["dtype"]).startswith("float32" if dtype == "auto" else "quantized")


def test_the_text_only_install_never_imports_mlx_vlm() -> None:
    """The server, the CLI, the engine and the embedded model's default load, in a fresh
    process, leave mlx_vlm unimported: only a vision model's load imports it."""
    measured = _probe("embedded", "auto")
    assert str(measured["dtype"]).startswith("float32")  # the default load, done
    assert measured["mlx_vlm_modules"] == [], measured["mlx_vlm_modules"]


def test_auto_keeps_weights_as_stored_when_float32_exceeds_the_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dense = estimate_resident_bytes(None, "float32")
    stored = estimate_resident_bytes(None, "quantized")
    budget = (dense + stored) // 2  # the model fits as stored, not as float32
    assert choose_auto_dtype(None, "auto", dense).note is None
    choice = choose_auto_dtype(None, "auto", budget)
    assert choice.dtype == "quantized"
    assert choice.note is not None and "float32 would take" in choice.note
    # Asked for explicitly, float32 is what the user gets.
    assert choose_auto_dtype(None, "float32", budget) == type(choice)("float32", None)

    from compat_serve.models.loader import load_model
    from compat_serve.models.weight_report import weights_status

    with caplog.at_level(logging.WARNING, logger="compat_serve"):
        loaded = load_model(None, dtype="auto", memory_budget=budget)
    assert loaded.dtype.startswith("quantized")
    status = weights_status(loaded)
    assert status["requested"] == "auto"
    assert status["auto_kept_as_stored"] == choice.note
    assert [r.getMessage() for r in caplog.records].count(f"embedded model: {choice.note}") == 1
