"""LoRA adapter files and per-row deltas (compat_serve/adapters) on tiny random llamas:
both formats read, a row with an adapter gives the logits of the model with that adapter
fused (by mlx-lm for its format, by hand for PEFT's), rows of one forward each get their
own adapter, and every way an adapter cannot be served is a one-line AdapterError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from compat_serve.adapters import AdapterBank, AdapterError, read_adapter
from tests.python.lora_files import (
    MLX_KEYS,
    PEFT_MODULES,
    RANK,
    fused_by_hand,
    mlx_lm_with_adapter,
    random_pairs,
    write_mlx_adapter,
    write_peft_adapter,
)
from tests.tiny_models import quantize_tiny, tiny_model

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

SEED = 7
IDS = [[1, 17, 230, 5, 99, 402, 12, 7, 64]]
TOLERANCE = 1e-4
MLX_SCALE = 2.0
PEFT_ALPHA = 16.0  # scale alpha / r = 2


def fresh(embedded_model: LoadedModel) -> Any:
    return tiny_model("llama", embedded_model, seed=SEED).model


@pytest.fixture(scope="module")
def adapters(
    tmp_path_factory: pytest.TempPathFactory, embedded_model: LoadedModel
) -> dict[str, Any]:
    """An mlx-lm adapter on the last layer only (num_layers 1) and a PEFT one on both."""
    root = tmp_path_factory.mktemp("adapters")
    model = fresh(embedded_model)
    mlx_pairs = random_pairs(model, MLX_KEYS, seed=1, layers=1)
    peft_pairs = random_pairs(model, PEFT_MODULES, seed=2)
    return {
        "mlx": write_mlx_adapter(root / "mlx", mlx_pairs, scale=MLX_SCALE, layers=1),
        "peft": write_peft_adapter(root / "peft", peft_pairs, alpha=PEFT_ALPHA),
        "peft_pairs": peft_pairs,
        "root": root,
    }


def logits(model: Any, ids: list[list[int]] = IDS) -> mx.array:
    out: mx.array = model(mx.array(ids))
    mx.eval(out)
    return out


def max_diff(a: mx.array, b: mx.array) -> float:
    return float(mx.abs(a - b).max().item())


def test_both_formats_read(adapters: dict[str, Any]) -> None:
    mlx = read_adapter(adapters["mlx"], "style")
    assert (mlx.files.name, mlx.files.format, mlx.files.rank) == ("style", "mlx-lm", RANK)
    assert mlx.files.scale == MLX_SCALE
    assert mlx.files.target_modules == tuple(sorted(MLX_KEYS))
    assert sorted(mlx.modules) == sorted(f"model.layers.1.{k}" for k in MLX_KEYS)
    peft = read_adapter(adapters["peft"] / "adapter_config.json")
    assert (peft.files.name, peft.files.format, peft.files.scale) == ("peft", "peft", 2.0)
    a, b = peft.modules["model.layers.0.self_attn.q_proj"]
    expected_a, expected_b = adapters["peft_pairs"]["model.layers.0.self_attn.q_proj"]
    # PEFT's [r, in] / [out, r] come back in mlx-lm's orientation.
    np.testing.assert_array_equal(a, expected_a)
    np.testing.assert_array_equal(b, expected_b)
    assert len(mlx.files.fingerprint) == 64 and mlx.files.fingerprint != peft.files.fingerprint


def test_rows_match_fused_models(embedded_model: LoadedModel, adapters: dict[str, Any]) -> None:
    """Each adapter alone matches its fused reference; a batch of [mlx, none, peft] rows
    gives each row its own result; the base model's output is unchanged throughout."""
    model = fresh(embedded_model)
    base = logits(model)
    bank = AdapterBank.install(model)
    assert mx.array_equal(logits(model), base)  # installed, no adapter: the same bits
    bank.add("mlx", read_adapter(adapters["mlx"]))
    bank.add("peft", read_adapter(adapters["peft"]))
    assert mx.array_equal(logits(model), base)  # added, not used: still the same bits
    mlx_ref = logits(mlx_lm_with_adapter(fresh(embedded_model), adapters["mlx"], fuse=True))
    scale = PEFT_ALPHA / RANK
    peft_ref = logits(fused_by_hand(fresh(embedded_model), adapters["peft_pairs"], scale))
    # The adapters really change the model (else every check below is vacuous).
    assert max_diff(mlx_ref, base) > 0.5 and max_diff(peft_ref, base) > 0.5
    with bank.use(["mlx"]):
        assert max_diff(logits(model), mlx_ref) < TOLERANCE
    with bank.use(["peft"]):
        assert max_diff(logits(model), peft_ref) < TOLERANCE
    with bank.use(["mlx", None, "peft"]):
        mixed = logits(model, IDS * 3)
    assert max_diff(mixed[0], mlx_ref[0]) < TOLERANCE
    assert max_diff(mixed[1], base[0]) < TOLERANCE  # a batch of 3: another float order
    assert max_diff(mixed[2], peft_ref[0]) < TOLERANCE
    bank.remove("mlx")
    assert bank.names() == ["peft"]
    with bank.use(["peft"]):
        assert max_diff(logits(model), peft_ref) < TOLERANCE


def test_quantized_base_stays_quantized(
    embedded_model: LoadedModel, adapters: dict[str, Any]
) -> None:
    """The users' path keeps QuantizedLinear weights: the delta is added beside them, as
    mlx-lm's own (unfused) LoRA layers over a quantized model compute it."""
    model = quantize_tiny(tiny_model("llama", embedded_model, seed=SEED)).model
    bank = AdapterBank.install(model)
    bank.add("mlx", read_adapter(adapters["mlx"]))
    with bank.use(["mlx"]):
        got = logits(model)
    assert type(model.layers[1].self_attn.q_proj).__mro__[1] is nn.QuantizedLinear
    reference_model = quantize_tiny(tiny_model("llama", embedded_model, seed=SEED)).model
    reference = logits(mlx_lm_with_adapter(reference_model, adapters["mlx"], fuse=False))
    assert max_diff(got, reference) < TOLERANCE
    assert max_diff(got, logits(model)) > 0.5


def test_bfloat16_peft_and_rslora(embedded_model: LoadedModel, tmp_path: Path) -> None:
    """PEFT files saved in bfloat16 read exactly; rsLoRA scales by alpha / sqrt(r)."""
    model = fresh(embedded_model)
    pairs = random_pairs(model, PEFT_MODULES, seed=5)
    folder = write_peft_adapter(
        tmp_path / "rs", pairs, alpha=4.0, extra={"use_rslora": True}, bfloat16=True
    )
    weights = read_adapter(folder)
    assert weights.files.scale == pytest.approx(4.0 / np.sqrt(RANK))
    a, _ = weights.modules["model.layers.0.self_attn.q_proj"]
    stored = mx.array(pairs["model.layers.0.self_attn.q_proj"][0]).astype(mx.bfloat16)
    np.testing.assert_array_equal(a, np.array(stored.astype(mx.float32)))


# ---- refusals -------------------------------------------------------------------------


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _one_line(exc: pytest.ExceptionInfo[AdapterError]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_unreadable_adapters_are_refused(tmp_path: Path, adapters: dict[str, Any]) -> None:
    with pytest.raises(AdapterError, match="no such adapter directory") as exc:
        read_adapter(tmp_path / "nowhere")
    _one_line(exc)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match=r"adapter_config.json: missing"):
        read_adapter(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not readable JSON"):
        read_adapter(tmp_path / "bad")
    (tmp_path / "bad" / "adapter_config.json").write_text('{"hello": 1}')
    with pytest.raises(AdapterError, match="neither an mlx-lm adapter"):
        read_adapter(tmp_path / "bad")
    nofile = tmp_path / "noweights"
    nofile.mkdir()
    (nofile / "adapter_config.json").write_text(
        (adapters["mlx"] / "adapter_config.json").read_text()
    )
    with pytest.raises(AdapterError, match=r"adapters.safetensors: missing") as exc:
        read_adapter(nofile)
    assert str(nofile) in _one_line(exc)
    (nofile / "adapters.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        read_adapter(nofile)


def test_dora_and_unsupported_kinds_are_refused(
    tmp_path: Path, embedded_model: LoadedModel
) -> None:
    model = fresh(embedded_model)
    mlx = write_mlx_adapter(
        tmp_path / "dora", random_pairs(model, MLX_KEYS, seed=1), scale=1.0, layers=2
    )
    _edit_config(mlx, fine_tune_type="dora")
    with pytest.raises(AdapterError, match="DoRA adapters are not supported") as exc:
        read_adapter(mlx)
    assert "adapter_config.json" in _one_line(exc)
    _edit_config(mlx, fine_tune_type="full")
    with pytest.raises(AdapterError, match="'full' is not a LoRA adapter"):
        read_adapter(mlx)
    peft = write_peft_adapter(
        tmp_path / "pdora", random_pairs(model, PEFT_MODULES, seed=2), alpha=8.0
    )
    for change, message in [
        ({"use_dora": True}, "DoRA adapters"),
        ({"peft_type": "IA3"}, "not LoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"bias": "all"}, "trained biases"),
        ({"target_modules": ["k_proj"]}, "target_modules"),
    ]:
        original = (peft / "adapter_config.json").read_text()
        _edit_config(peft, **change)
        with pytest.raises(AdapterError, match=message) as exc:
            read_adapter(peft)
        _one_line(exc)
        (peft / "adapter_config.json").write_text(original)


def test_rank_and_shape_mismatches_are_refused(tmp_path: Path, embedded_model: LoadedModel) -> None:
    model = fresh(embedded_model)
    folder = write_mlx_adapter(
        tmp_path / "rank", random_pairs(model, MLX_KEYS, seed=1, rank=4), scale=1.0, layers=2
    )
    with pytest.raises(AdapterError, match="do not have the config's rank 8"):
        read_adapter(folder)
    bank = AdapterBank.install(model)
    # An adapter trained on a wider model (hidden 128): its matrices do not fit.
    wide = tiny_model("llama", embedded_model, overrides={"hidden_size": 128}).model
    wide_folder = write_mlx_adapter(
        tmp_path / "wide", random_pairs(wide, MLX_KEYS, seed=1), scale=1.0, layers=2
    )
    with pytest.raises(AdapterError, match=r"do not fit the model's \d+ -> \d+ layer") as exc:
        bank.add("wide", read_adapter(wide_folder))
    assert "'wide'" in _one_line(exc)
    # Matrices for a layer the model does not have (a deeper model's).
    deep = random_pairs(model, MLX_KEYS, seed=1)
    deep["model.layers.5.self_attn.q_proj"] = deep.pop("model.layers.1.self_attn.q_proj")
    deep_folder = write_mlx_adapter(tmp_path / "deep", deep, scale=1.0, layers=2)
    with pytest.raises(AdapterError, match=r"layers.5.self_attn.q_proj is not a linear layer"):
        bank.add("deep", read_adapter(deep_folder))
    # A base model named by the config, on disk, of another architecture.
    other = tmp_path / "other-base"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 30}))
    named = write_mlx_adapter(
        tmp_path / "named", random_pairs(model, MLX_KEYS, seed=1), scale=1.0, layers=2
    )
    _edit_config(named, model=str(other))
    with pytest.raises(AdapterError, match="num_hidden_layers 30"):
        bank.add("named", read_adapter(named))
    assert bank.names() == []  # nothing half-added
