"""config.json layouts that mlx-vlm's own config classes cannot read, rewritten into the
layout they can.

transformers 5 saves the Qwen-VL family differently from Qwen's releases and
mlx-community's conversions (which mlx-vlm's classes follow): the language model's
settings only in `text_config` (Qwen2-VL, Qwen2.5-VL: mlx-vlm reads them from the top
level), `rope_parameters` in place of `rope_scaling` and `rope_theta`, and a vision
`model_type` of `<type>_vision`. mlx-vlm fails on each (a TypeError or "Unsupported model
type"). Its loader reads config.json from the directory itself, so such a directory is
loaded through a shadow directory: links to every file, and a rewritten config.json.
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["mlx_vlm_config", "mlx_vlm_readable_dir"]

_QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
_FLAT = ("qwen2_vl", "qwen2_5_vl")  # mlx-vlm reads their text settings at the top level


def mlx_vlm_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """`config` rewritten into the layout mlx-vlm reads, or None when it needs none."""
    model_type = config.get("model_type")
    if model_type not in _QWEN_VL:
        return None
    out = copy.deepcopy(config)
    changed = False
    vision = out.get("vision_config")
    if isinstance(vision, dict) and vision.get("model_type") == f"{model_type}_vision":
        vision["model_type"] = model_type
        changed = True
    text = out.get("text_config")
    if isinstance(text, dict) and isinstance(text.get("rope_parameters"), dict):
        _rope_from_parameters(text)
        changed = True
    if (
        model_type in _FLAT
        and isinstance(text, dict)
        and "hidden_size" in text
        and "hidden_size" not in out
    ):
        out = {**text, **{k: v for k, v in out.items() if k != "text_config"}}
        out["model_type"] = model_type
        changed = True
    return out if changed else None


def _rope_from_parameters(text: dict[str, Any]) -> None:
    """transformers 5's `rope_parameters` as `rope_theta` and `rope_scaling`."""
    rope = dict(text.pop("rope_parameters"))
    if "rope_theta" in rope:
        text.setdefault("rope_theta", rope.pop("rope_theta"))
    if "mrope_section" in rope and not text.get("rope_scaling"):
        kind = rope.pop("type", None) or rope.pop("rope_type", "default")
        rope.pop("rope_type", None)
        text["rope_scaling"] = {**rope, "type": kind if kind in ("mrope", "default") else "default"}


@contextmanager
def mlx_vlm_readable_dir(model_dir: Path, config: dict[str, Any]) -> Iterator[Path]:
    """`model_dir`, or while the context lasts a shadow of it whose config.json mlx-vlm
    can read (the weights are read through links: load them before the context ends)."""
    flat = mlx_vlm_config(config)
    if flat is None:
        yield model_dir
        return
    with tempfile.TemporaryDirectory(prefix="compat-vlm-") as tmp:
        shadow = Path(tmp)
        for entry in model_dir.iterdir():
            if entry.name != "config.json":
                (shadow / entry.name).symlink_to(entry.resolve())
        (shadow / "config.json").write_text(json.dumps(flat))
        yield shadow
