"""Random rank-8 LoRA adapters for tiny models, written as mlx-lm and PEFT directories,
and the references they are checked against: mlx-lm's own loading and fusing for its
format (`mlx_lm.tuner.utils.load_adapters`, each layer's `fuse`, as `mlx_lm.fuse` does),
and `W + scale * B @ A` by hand in numpy for PEFT's."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_unflatten

RANK = 8
# Relative to a decoder layer; mlx-lm's config names them so ("keys").
MLX_KEYS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
# PEFT names modules by their last component.
PEFT_TARGETS = ("q_proj", "o_proj", "up_proj")
PEFT_MODULES = ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj")

Pairs = dict[str, tuple[np.ndarray, np.ndarray]]  # module path → (a [in, r], b [r, out])


def layer_dims(model: Any, relative: str) -> tuple[int, int]:
    """(in, out) of a decoder layer's linear (float or quantized)."""
    module = model.layers[0]
    for part in relative.split("."):
        module = getattr(module, part)
    out_dims, packed = module.weight.shape
    bits = getattr(module, "bits", None)
    return (packed * 32 // bits if bits else packed), out_dims


def random_pairs(
    model: Any, modules: Sequence[str], seed: int, rank: int = RANK, layers: int | None = None
) -> Pairs:
    """Random `(a, b)` for `modules` of the last `layers` decoder layers (all: None), big
    enough to change the model's greedy tokens."""
    rng = np.random.default_rng(seed)
    count = len(model.layers)
    first = 0 if layers is None else count - layers
    pairs: Pairs = {}
    for index in range(first, count):
        for relative in modules:
            in_dims, out_dims = layer_dims(model, relative)
            a = rng.standard_normal((in_dims, rank)).astype(np.float32) / np.sqrt(in_dims)
            b = rng.standard_normal((rank, out_dims)).astype(np.float32) * 0.3
            pairs[f"model.layers.{index}.{relative}"] = (a, b)
    return pairs


def _save(path: Path, tensors: dict[str, np.ndarray]) -> None:
    mx.save_safetensors(str(path), {key: mx.array(value) for key, value in tensors.items()})


def write_mlx_adapter(
    folder: Path, pairs: Pairs, *, scale: float, layers: int, keys: Sequence[str] = MLX_KEYS
) -> Path:
    """An `mlx_lm.lora` output directory (`adapter_config.json`, `adapters.safetensors`)."""
    folder.mkdir(parents=True)
    config = {
        "fine_tune_type": "lora",
        "num_layers": layers,
        "lora_parameters": {"rank": RANK, "scale": scale, "dropout": 0.0, "keys": list(keys)},
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = {}
    for module, (a, b) in pairs.items():
        tensors[f"{module}.lora_a"] = a
        tensors[f"{module}.lora_b"] = b
    _save(folder / "adapters.safetensors", tensors)
    return folder


def write_peft_adapter(
    folder: Path,
    pairs: Pairs,
    *,
    alpha: float,
    targets: Sequence[str] = PEFT_TARGETS,
    extra: dict[str, Any] | None = None,
    bfloat16: bool = False,
) -> Path:
    """A PEFT `save_pretrained` directory (`adapter_config.json`,
    `adapter_model.safetensors`, matrices in PEFT's orientation)."""
    folder.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
        "base_model_name_or_path": None,
        **(extra or {}),
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = {}
    for module, (a, b) in pairs.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(a.T)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(b.T)
    dtype = mx.bfloat16 if bfloat16 else mx.float32  # PEFT often saves the model's dtype
    stored = {key: mx.array(value).astype(dtype) for key, value in tensors.items()}
    mx.save_safetensors(str(folder / "adapter_model.safetensors"), stored)
    return folder


def mlx_lm_with_adapter(model: Any, folder: Path, *, fuse: bool) -> Any:
    """`model` (a fresh copy: it is changed) with mlx-lm's own LoRA layers loaded from
    `folder`, fused into the weights as `mlx_lm.fuse` does when `fuse`."""
    from mlx_lm.tuner.utils import load_adapters

    load_adapters(model, str(folder))
    if fuse:
        fused = [
            (n, m.fuse(dequantize=True)) for n, m in model.named_modules() if hasattr(m, "fuse")
        ]
        model.update_modules(tree_unflatten(fused))
    mx.eval(model.parameters())
    return model


def fused_by_hand(model: Any, pairs: Pairs, scale: float) -> Any:
    """`model` (a fresh float copy: it is changed) with `W + scale * (a @ b).T` per pair."""
    weights = []
    params = dict(_flat(model.parameters()))
    for module, (a, b) in pairs.items():
        w = np.array(params[f"{module}.weight"])
        weights.append((f"{module}.weight", mx.array(w + scale * (a @ b).T)))
    model.load_weights(weights, strict=False)
    mx.eval(model.parameters())
    return model


def _flat(tree: Any) -> list[tuple[str, Any]]:
    from mlx.utils import tree_flatten

    flat: list[tuple[str, Any]] = tree_flatten(tree)  # type: ignore[assignment]
    return flat
