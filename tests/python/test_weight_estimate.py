"""The size a model's weights will take once loaded, read from its files' headers
(models/weight_estimate.py), against what MLX and our loaders really make of the files."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import pytest

from compat_serve.models.device_memory import weights_nbytes
from compat_serve.models.embedded import embedded_model_path
from compat_serve.models.errors import ModelLoadError
from compat_serve.models.hf_dir import load_hf_dir
from compat_serve.models.weight_estimate import estimate_weight_bytes
from tests.tiny_models import write_model_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel


def test_the_embedded_gguf_kept_as_stored_is_what_mlx_loads() -> None:
    arrays = mx.load(str(embedded_model_path()))
    assert isinstance(arrays, dict)
    stored = sum(int(a.nbytes) for a in arrays.values())
    assert estimate_weight_bytes(None, "quantized") == stored
    # On a GPU, `auto` keeps weights as stored.
    assert estimate_weight_bytes(None, "auto", backend="metal") == stored
    assert estimate_weight_bytes(None, "auto", backend="cuda") == stored


@pytest.mark.model
def test_the_embedded_gguf_on_the_cpu_is_the_loaded_float32_model(
    embedded_model: LoadedModel,
) -> None:
    assert embedded_model.dtype == "float32"
    loaded = weights_nbytes(embedded_model.model)
    assert estimate_weight_bytes(None, "auto", backend="cpu") == loaded
    assert estimate_weight_bytes(None, "float32", backend="metal") == loaded
    # Every weight of this model is floating point: half the bytes in 16 bits.
    assert estimate_weight_bytes(None, "float16") * 2 == loaded
    assert estimate_weight_bytes(None, "bfloat16") * 2 == loaded
    # Six times its file: the size that admission once took for the whole model.
    assert loaded > 5 * embedded_model_path().stat().st_size


@pytest.mark.model
@pytest.mark.parametrize(
    ("bits", "dtype"), [(None, "float16"), (4, "quantized"), (4, "float32"), (8, "quantized")]
)
def test_a_model_directory_estimate_is_what_the_loader_makes(
    tmp_path: Path, embedded_model: LoadedModel, bits: int | None, dtype: str
) -> None:
    model_dir = tmp_path / "tiny"
    write_model_dir(model_dir, "qwen3", embedded_model, bits=bits)
    loaded = load_hf_dir(model_dir, dtype=dtype)
    assert estimate_weight_bytes(str(model_dir), dtype) == weights_nbytes(loaded.model)


def test_files_the_estimate_cannot_read_are_a_load_error(tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF but not really")
    with pytest.raises(ModelLoadError, match="GGUF"):
        estimate_weight_bytes(str(fake))
    not_gguf = tmp_path / "other.gguf"
    not_gguf.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        estimate_weight_bytes(str(not_gguf))
    empty_dir = tmp_path / "dir"
    empty_dir.mkdir()
    with pytest.raises(ModelLoadError, match="safetensors headers"):
        estimate_weight_bytes(str(empty_dir))
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        estimate_weight_bytes(None, "float8")
