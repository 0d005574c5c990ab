"""Every GGUF tensor type compat-serve reads, against the `gguf` package's dequantizer
(gguf-py, an implementation independent of ours): random blocks of each type in a tiny file
written by its GGUFWriter.

- Dense loads (`keep_quantized=False`, the CPU default): the float32 values equal
  `gguf.quants.dequantize` bit for bit.
- Kept quantized (`--dtype quantized`, Metal/CUDA): MLX's `mx.dequantize` of the layout
  equals them exactly for the exact types; elsewhere within a bound derived from the
  layout (float16 rounding of a sub-block scale: 2^-11 of each term; a requantization:
  one step of MLX's new grid over the group, see docs/gguf.md).
- The memory estimate counts exactly what the reader keeps.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf.quants import Q4_K as GGUF_Q4_K
from gguf.quants import dequantize

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.gguf import read_gguf
from compat_serve.models.gguf_layout import LAYOUTS
from compat_serve.models.weight_estimate import estimate_weight_bytes
from tests.tiny_gguf_kquants import random_blocks

Q = gguf.GGMLQuantizationType
QUANTIZED = list(LAYOUTS)
ROWS, COLS = 8, 512
NAME = "blk.0.attn_q"
F16_EPS = 2.0**-11  # float16's relative rounding (round to nearest, 11-bit significand)


def _write(path: Path, name: str, raw: np.ndarray, qtype: Q | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    if qtype is None:
        writer.add_tensor(f"{name}.weight", raw)
    else:
        writer.add_tensor(f"{name}.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=QUANTIZED)
def quantized_file(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, np.ndarray, Path]:
    name: str = request.param
    raw = random_blocks(Q[name], ROWS, COLS, np.random.default_rng(1))
    path = _write(tmp_path_factory.mktemp(name) / f"{name}.gguf", NAME, raw, Q[name])
    return name, raw, path


def test_dense_values_equal_gguf_py_bit_for_bit(quantized_file: tuple[str, np.ndarray, Path]):
    name, raw, path = quantized_file
    weights, _ = read_gguf(str(path), keep_quantized=False)
    got = np.array(weights[f"{NAME}.weight"])
    expected = dequantize(raw, Q[name]).astype(np.float32)
    assert got.dtype == np.float32 and got.shape == (ROWS, COLS)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    assert estimate_weight_bytes(str(path), "float32") == sum(
        int(a.nbytes) for a in weights.values()
    )


def _kept_bound(name: str, raw: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Largest error each value may have in its MLX layout (0 for the exact types)."""
    layout = LAYOUTS[name]
    if layout.how == "exact":
        return np.zeros_like(expected)
    if name in ("Q4_K", "Q5_K"):  # v = (d sc) q - (dmin m): each term's f16 rounding
        blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[Q[name]][1])
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = GGUF_Q4_K.get_scale_min(blocks[:, 4:16])
        top = 2**layout.bits - 1
        per_group = F16_EPS * (np.abs(d * sc) * top + np.abs(dmin * m))
        return np.repeat(per_group.reshape(ROWS, -1), 32, axis=1)
    if name == "IQ4_XS":  # v = dl * k with dl rounded to f16: 2^-11 of |v|
        return F16_EPS * np.abs(expected)
    # Requantized by MLX (group 32): its affine rounding keeps zero exact, so an error up to
    # one step of the group's range, plus the float16 rounding of the scale and bias.
    groups = expected.reshape(ROWS, -1, 32)
    step = np.ptp(groups, axis=-1, keepdims=True) / (2**layout.bits - 1)
    bound = step + 2 * F16_EPS * np.abs(groups).max(axis=-1, keepdims=True)
    return np.broadcast_to(bound, groups.shape).reshape(ROWS, COLS)


def test_kept_quantized_layout(quantized_file: tuple[str, np.ndarray, Path]) -> None:
    name, raw, path = quantized_file
    layout = LAYOUTS[name]
    weights, _ = read_gguf(str(path), keep_quantized=True)
    packed = weights[f"{NAME}.weight"]
    scales = weights[f"{NAME}.scales"]
    biases = weights.get(f"{NAME}.biases")
    assert packed.dtype == mx.uint32 and packed.shape == (ROWS, COLS * layout.bits // 32)
    assert scales.shape == (ROWS, COLS // 32)
    affine = layout.mode == "affine"
    assert (biases is not None) == affine
    got = mx.dequantize(
        packed,
        scales.astype(mx.float32) if affine else scales,
        None if biases is None else biases.astype(mx.float32),
        group_size=32,
        bits=layout.bits,
        mode=layout.mode,
        dtype=mx.float32,
    )
    expected = dequantize(raw, Q[name]).astype(np.float32)
    error = np.abs(np.array(got) - expected)
    # f32 arithmetic in mx.dequantize (a fused multiply-add or not): one f32 rounding.
    f32_slack = 2.0**-23 * np.abs(expected)
    assert (error <= _kept_bound(name, raw, expected) + f32_slack).all(), float(error.max())
    if layout.how == "exact":
        assert error.max() <= f32_slack.max()
    assert estimate_weight_bytes(str(path), "quantized") == sum(
        int(a.nbytes) for a in weights.values()
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "BF16"])
def test_dense_types_as_stored(tmp_path: Path, dtype: object) -> None:
    values = np.random.default_rng(2).standard_normal((ROWS, COLS)).astype(np.float32)
    if dtype == "BF16":
        raw = gguf.quants.quantize(values, Q.BF16)
        path = _write(tmp_path / "bf16.gguf", NAME, raw, Q.BF16)
        expected = dequantize(raw, Q.BF16)
        want = mx.bfloat16
    else:
        stored = values.astype(dtype)
        path = _write(tmp_path / "dense.gguf", NAME, stored)
        expected = stored.astype(np.float32)
        want = mx.float32 if dtype == np.float32 else mx.float16
    weights, _ = read_gguf(str(path), keep_quantized=True)
    tensor = weights[f"{NAME}.weight"]
    assert tensor.dtype == want
    assert np.array_equal(np.array(tensor.astype(mx.float32)), expected)


def test_a_truncated_file_names_the_tensor(tmp_path: Path) -> None:
    raw = random_blocks(Q.Q5_0, ROWS, COLS, np.random.default_rng(3))
    path = _write(tmp_path / "cut.gguf", NAME, raw, Q.Q5_0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    for keep in (True, False):
        with pytest.raises(ModelLoadError) as err:
            read_gguf(str(path), keep_quantized=keep)
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith(f"cannot read GGUF {path}: tensor {NAME}.weight is truncated")
        assert "download the file again" in message


def test_gemma3_270m_q4_k_m_as_published_equals_gguf_py() -> None:
    """The file users have (#43): 81 Q5_0 tensors beside Q4_K/Q6_K/Q8_0/F32. Every tensor
    read dense equals gguf-py's dequantization bit for bit."""
    from tests.gemma_gguf import original_gemma_gguf

    path = str(original_gemma_gguf())
    weights, meta = read_gguf(path, keep_quantized=False)
    assert meta.architecture == "gemma3"
    reader = gguf.GGUFReader(path)
    types = {t.tensor_type.name for t in reader.tensors}
    assert {"Q5_0", "Q4_K", "Q6_K", "Q8_0"} <= types
    for tensor in reader.tensors:
        expected = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        got = np.array(weights.pop(tensor.name).astype(mx.float32))
        assert got.shape == tuple(reversed([int(d) for d in tensor.shape])), tensor.name
        assert np.array_equal(got.reshape(expected.shape).view(np.uint32), expected.view(np.uint32))
    assert not weights
