"""`--dtype` (serve flag, ServeOptions, `dtype:` in a --models file) and the kernel switch
`COMPAT_SERVE_CPU_KERNELS=off`: which weight plan and which modules a load ends up with,
and clear errors for bad values. Tiny quantized model directories keep it cheap; the
embedded model on the users' path is tests/python/test_users_path.py (its own lane)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from compat_serve.bootstrap import ServeOptions, build_state, check_serve_options
from compat_serve.models import cpu_linear
from compat_serve.models.loader import load_model
from compat_serve.models.weight_report import weights_status
from compat_serve.models.weights import DTYPE_CHOICES
from compat_serve.registry.entries import ModelEntry
from compat_serve.serve_flags import DTYPE_CHOICES as CLI_DTYPES
from compat_serve.serve_flags import build_serve_parser
from compat_serve.serve_models import ModelFlags, build_hub, entry_options
from tests.conftest import RunningServer
from tests.tiny_models import write_model_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel


@pytest.fixture(scope="module")
def quantized_dir(embedded_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama as `mlx_lm.convert -q` writes it (4-bit, group 32)."""
    out = tmp_path_factory.mktemp("dtype") / "tiny-q4"
    write_model_dir(out, "llama", embedded_model, bits=4)
    return out


def test_the_flag_offers_the_loader_choices_and_refuses_others(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert set(CLI_DTYPES) == set(DTYPE_CHOICES)
    parser = build_serve_parser()
    assert parser.parse_args([]).dtype == "auto"
    assert parser.parse_args(["--dtype", "quantized"]).dtype == "quantized"
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--dtype", "int4"])
    assert exited.value.code == 2
    assert "argument --dtype: invalid choice: 'int4'" in capsys.readouterr().err


def test_a_bad_dtype_option_fails_before_any_load() -> None:
    with pytest.raises(ValueError, match=r"--dtype must be one of auto, .*, not 'fp8'"):
        check_serve_options(ServeOptions(dtype="fp8"))


def test_a_models_file_entry_sets_its_dtype_and_a_bad_one_names_file_and_line(
    quantized_dir: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models.yaml"
    models.write_text(
        f"models:\n  - id: a\n    path: {quantized_dir}\n    dtype: quantized\n"
        f"  - id: b\n    path: {quantized_dir}\n"
    )
    hub = build_hub(ServeOptions(dtype="float16"), ModelFlags(models_file=str(models)))
    a, b = (hub.slots[name].entry for name in ("a", "b"))
    assert entry_options(ServeOptions(dtype="float16"), a).dtype == "quantized"
    assert entry_options(ServeOptions(dtype="float16"), b).dtype == "float16"  # the flag's
    models.write_text(f"models:\n  - id: a\n    path: {quantized_dir}\n    dtype: fp8\n")
    with pytest.raises(ValueError, match=rf"{models}:2: model 'a': --dtype must be one of"):
        build_hub(ServeOptions(), ModelFlags(models_file=str(models)))


def test_models_dir_entries_take_the_command_lines_dtype(quantized_dir: Path) -> None:
    entry = ModelEntry("tiny", str(quantized_dir), origin="--models-dir x")
    assert entry_options(ServeOptions(dtype="quantized"), entry).dtype == "quantized"


def test_quantized_keeps_the_weights_and_stock_modules(quantized_dir: Path) -> None:
    from mlx.nn.layers.quantized import QuantizedLinear

    loaded = load_model(str(quantized_dir), dtype="quantized")
    assert weights_status(loaded) == {
        "dtype": "quantized-4bit",
        "requested": "quantized",
        "auto_kept_as_stored": None,
        "modules": "stock mlx-lm",
        "fast_paths": {},
    }
    untyped = loaded.model
    linears = [m for _, m in untyped.named_modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 2 * 7 + 1  # every projection and the untied LM head
    assert all(
        type(m).__module__.startswith(("mlx.", "mlx_lm.")) for _, m in untyped.named_modules()
    )


def test_auto_on_the_cpu_dequantizes_and_installs_the_fast_paths(quantized_dir: Path) -> None:
    loaded = load_model(str(quantized_dir))
    status = weights_status(loaded)
    assert (status["dtype"], status["requested"], status["modules"]) == (
        "float32",
        "auto",
        "CPU fast paths",
    )
    assert "weight_layout" in status["fast_paths"]


def test_the_kernel_switch_loads_the_fallback_layout(
    quantized_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    has_simd = cpu_linear.matmul_kernel() != "scalar"
    assert cpu_linear.kernel_available() == has_simd
    for value in ("off", "OFF", "0", "false", "no"):
        monkeypatch.setenv(cpu_linear.CPU_KERNELS_ENV, value)
        assert not cpu_linear.kernel_available()
    loaded = load_model(str(quantized_dir), dtype="float32")
    assert loaded.extra["weight_layout"] == "input-major (15 dense weights)"
    assert "decode_blocks" not in loaded.extra
    monkeypatch.setenv(cpu_linear.CPU_KERNELS_ENV, "on")
    assert cpu_linear.kernel_available() == has_simd


def test_serve_options_load_with_their_dtype(quantized_dir: Path) -> None:
    state = build_state(ServeOptions(model=str(quantized_dir), dtype="quantized", kv_memory="32MB"))
    assert weights_status(state.engine.model)["modules"] == "stock mlx-lm"
    assert state.engine.model.dtype == "quantized-4bit"


def test_status_reports_the_default_plan(server: RunningServer) -> None:
    weights = httpx.get(f"{server.base_url}/v1/status", timeout=10).json()["weights"]
    assert (weights["dtype"], weights["requested"], weights["modules"]) == (
        "float32",
        "auto",
        "CPU fast paths",
    )
    assert set(weights["fast_paths"]) <= {"weight_layout", "decode_blocks", "attention"}
    assert "weight_layout" in weights["fast_paths"]


def test_distributed_serving_refuses_a_dtype_it_would_not_apply(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from compat_serve.cli import main

    with caplog.at_level(logging.ERROR, logger="compat_serve"):
        assert main(["--distributed", "tensor", "--dtype", "quantized", "--port", "1"]) == 2
    assert "--dtype is not applied with --distributed: drop --dtype quantized" in caplog.text
