"""The model directory's config before the weights, and a sharded load after."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

log = logging.getLogger("compat_serve")


def model_dir(spec: str | None) -> Path:
    """The mlx-lm model directory --model names (a directory or a cached hub id); GGUF
    files and the embedded model have no mlx-lm `shard`, so they are refused."""
    from compat_serve.distributed.layout import LayoutError
    from compat_serve.models.hf_dir import download_hub_model, looks_like_hub_id

    if spec:
        path = Path(spec).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise LayoutError(f"{path}: not a model directory (no config.json)")
            return path
        if not path.exists() and looks_like_hub_id(spec):
            return download_hub_model(spec)
    raise LayoutError(
        "--distributed needs --model to name an mlx-lm model directory or hub id "
        "(GGUF files and the embedded model cannot be sharded)"
    )


def shard(model: Any, mode: str, group: mx.distributed.Group) -> None:
    """mlx-lm's own sharding: tensor parallel (`model.shard`) or a pipeline
    (`model.model.pipeline`: rank 0 runs the last layers, every rank gets the output)."""
    if mode == "tensor":
        model.shard(group)
    else:
        model.model.pipeline(group)


def load_sharded(path: Path, mode: str, group: mx.distributed.Group) -> LoadedModel:
    """This rank's shard of the model (only its weights are read). mlx-lm's modules stay
    as they are: the CPU fast paths of `load_model` would replace the sharded linears."""
    from compat_serve.models.hf_dir import load_hf_dir

    loaded = load_hf_dir(path, prepare=lambda model: shard(model, mode, group))
    loaded.extra["distributed"] = {
        "mode": mode,
        "rank": group.rank(),
        "world_size": group.size(),
    }
    log.info("rank %d of %d: %s shard loaded", group.rank(), group.size(), mode)
    return loaded
