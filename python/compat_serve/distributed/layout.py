"""Checks a distributed layout from config.json alone, before any weight is read."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

MODES = ("tensor", "pipeline")


class LayoutError(ValueError):
    """A layout that cannot work; the message is the one line the ranks print."""


def _family(model_type: str) -> Any:
    try:
        return importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError:
        raise LayoutError(f"mlx-lm has no model family {model_type!r}") from None


def _can_pipeline(module: Any) -> bool:
    """Whether the family's inner model has mlx-lm's `pipeline(group)` (PipelineMixin)."""
    return any(
        inspect.isclass(value)
        and value.__module__ == module.__name__
        and hasattr(value, "pipeline")
        for value in vars(module).values()
    )


def check_layout(config: dict[str, Any], mode: str, world_size: int) -> None:
    """Raise LayoutError naming the cause when `config` cannot be split `mode`-wise over
    `world_size` ranks."""
    if mode not in MODES:
        raise LayoutError(f"--distributed must be tensor or pipeline, not {mode!r}")
    if world_size < 2:
        raise LayoutError(f"--distributed {mode} needs at least 2 ranks, the group has 1")
    if isinstance(config.get("vision_config"), dict):
        raise LayoutError("--distributed does not run vision-language models yet")
    model_type = str(config.get("model_type", ""))
    text = config.get("text_config")
    merged = {**(text if isinstance(text, dict) else {}), **config}
    # The counts first: they need no import of mlx-lm (a second's work).
    if mode == "tensor":
        heads = merged.get("num_attention_heads")
        kv_heads = merged.get("num_key_value_heads", heads)
        for count, what in ((heads, "attention heads"), (kv_heads, "KV heads")):
            if isinstance(count, int) and count % world_size:
                raise LayoutError(
                    f"{count} {what} cannot be split over {world_size} ranks (tensor parallel)"
                )
        if not hasattr(_family(model_type).Model, "shard"):
            raise LayoutError(f"mlx-lm cannot shard {model_type} models tensor-parallel")
        return
    layers = merged.get("num_hidden_layers")
    if isinstance(layers, int) and layers < world_size:
        raise LayoutError(f"{layers} layers cannot be split over {world_size} pipeline ranks")
    if not _can_pipeline(_family(model_type)):
        raise LayoutError(f"mlx-lm cannot split {model_type} models into a pipeline")
