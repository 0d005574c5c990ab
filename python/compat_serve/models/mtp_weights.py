"""Where each family's checkpoint keeps its multi-token-prediction (MTP) weights, and
reading them from an MLX/HF directory.

mlx-lm drops these tensors when it loads a model (each family's `sanitize`); the engine
reads them again from the safetensors files when `--speculative mtp` asks for them
(engine/mtp_families.py). Names checked against vllm's `deepseek_mtp.py`,
`glm4_moe_mtp.py`, `mimo_mtp.py` and `qwen3_next_mtp.py`:

- DeepSeek-V3/R1 (`deepseek_v3`), GLM-4.5/4.6/4.7 (`glm4_moe`): `num_nextn_predict_layers`
  extra decoder layers after the last, `model.layers.{num_hidden_layers + i}.*`.
- MiMo (`mimo`): `model.mtp_layers.{i}.*`, `num_nextn_predict_layers` of them.
- Qwen3-Next (`qwen3_next`), Qwen3.5/3.6 (`qwen3_5`, `qwen3_5_moe`): `mtp.*`, layers under
  `mtp.layers.{i}`; vllm reads `mtp_num_hidden_layers` (Qwen3.5) or `num_nextn_predict_layers`
  (Qwen3-Next), 1 when the config names neither.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import mlx.core as mx

__all__ = [
    "MTP_MODEL_TYPES",
    "is_mtp_key",
    "mtp_layer_count",
    "mtp_prefix",
    "read_mtp_tensors",
    "text_config",
    "without_mtp_classes",
]

# mlx-lm model types whose checkpoints can carry MTP weights.
QWEN_MTP_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
MTP_MODEL_TYPES = ("deepseek_v3", "glm4_moe", "mimo", *QWEN_MTP_TYPES)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config (Qwen3.5 nests it under `text_config`)."""
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, dict) else config


def mtp_layer_count(config: dict[str, Any]) -> int:
    """How many MTP layers the config declares (0: none)."""
    text = text_config(config)
    if config.get("model_type") in QWEN_MTP_TYPES:
        keys = ("mtp_num_hidden_layers", "num_nextn_predict_layers")
        value = next((text[k] for k in keys if k in text), 1)
    else:
        value = text.get("num_nextn_predict_layers", 0)
    return value if isinstance(value, int) and value > 0 else 0


def mtp_prefix(config: dict[str, Any]) -> str | None:
    """The checkpoint prefix of the first MTP layer's tensors, or None for a model type
    without MTP weights."""
    model_type = config.get("model_type")
    if model_type in ("deepseek_v3", "glm4_moe"):
        return f"model.layers.{int(config['num_hidden_layers'])}."
    if model_type == "mimo":
        return "model.mtp_layers.0."
    if model_type in QWEN_MTP_TYPES:
        return "mtp."
    return None


def is_mtp_key(config: dict[str, Any], key: str) -> bool:
    """Whether `key` is one of the MTP tensors of any of the config's MTP layers."""
    model_type = config.get("model_type")
    if model_type in ("deepseek_v3", "glm4_moe"):
        parts = key.split(".", 3)
        return (
            len(parts) > 3
            and parts[:2] == ["model", "layers"]
            and parts[2].isdigit()
            and int(parts[2]) >= int(config["num_hidden_layers"])
        )
    if model_type == "mimo":
        return key.startswith("model.mtp_layers.")
    if model_type in QWEN_MTP_TYPES:
        return key.startswith("mtp.")
    return False


def read_mtp_tensors(model_dir: str | Path, config: dict[str, Any]) -> dict[str, mx.array]:
    """The first MTP layer's tensors (lazily loaded, keys without the prefix) from the
    directory's safetensors files, the files mlx-lm's `load_model` reads."""
    prefix = mtp_prefix(config)
    if prefix is None:
        return {}
    found: dict[str, mx.array] = {}
    for path in sorted(glob.glob(str(Path(model_dir) / "model*.safetensors"))):
        weights = mx.load(path)
        assert isinstance(weights, dict)
        for key, value in weights.items():
            if key.startswith(prefix):
                found[key.removeprefix(prefix)] = value
    return found


def without_mtp_classes(get_classes: Any) -> Any:
    """mlx-lm's `get_model_classes` with a model class whose `sanitize` first drops every MTP
    tensor (mlx-lm's DeepSeek-V3 drops only `model.layers.61`, the full-size model's
    index, so a checkpoint of another depth would fail to load)."""

    def classes(config: dict[str, Any]) -> tuple[type, type]:
        model_class, args_class = get_classes(config)
        if config.get("model_type") not in MTP_MODEL_TYPES or not hasattr(model_class, "sanitize"):
            return model_class, args_class
        keys_config = dict(config)

        def sanitize(self: Any, weights: dict[str, Any]) -> Any:
            kept = {k: v for k, v in weights.items() if not is_mtp_key(keys_config, k)}
            return model_class.sanitize(self, kept)

        made = type(model_class.__name__, (model_class,), {"sanitize": sanitize})
        made.__module__ = model_class.__module__
        made.__qualname__ = model_class.__qualname__
        return made, args_class

    return classes
