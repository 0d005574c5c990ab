"""Load an MLX/Hugging Face model directory (or a hub id) with mlx-lm.

Weights and architecture come from mlx-lm (`mlx_lm.utils.load_model`), the tokenizer from
`tokenizer.json` (see `hf_tokenizer.py`). The dtype rule of `weights.py` applies: on the CPU
backend quantized layers are dequantized and every float parameter becomes float32.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module

from compat_serve.models.context_length import context_length_from_config
from compat_serve.models.errors import ModelLoadError
from compat_serve.models.hf_tokenizer import load_hf_tokenizer, read_json
from compat_serve.models.hub import HUB_ALLOW_PATTERNS, download_hub_model, looks_like_hub_id
from compat_serve.models.load_steps import (
    WORKER,
    LoadSteps,
    evaluate_in_slices,
    host,
    run_inline,
)
from compat_serve.models.mtp_weights import without_mtp_classes
from compat_serve.models.types import LoadedModel
from compat_serve.models.weights import (
    cast_floating,
    dequantize_model,
    model_arrays,
    mx_dtype,
    resolve_dtype,
)

__all__ = [
    "HUB_ALLOW_PATTERNS",
    "download_hub_model",
    "load_hf_dir",
    "load_hf_dir_steps",
    "load_hub_model",
    "looks_like_hub_id",
]

logger = logging.getLogger(__name__)


def _dtype_name(model: Module, quantization: Any) -> str:
    if isinstance(quantization, dict) and "bits" in quantization:
        return f"quantized-{quantization['bits']}bit"
    counts: dict[str, int] = {}
    for v in model_arrays(model).values():
        if mx.issubdtype(v.dtype, mx.floating):
            name = str(v.dtype).removeprefix("mlx.core.")
            counts[name] = counts.get(name, 0) + int(v.size)
    return max(counts, key=lambda k: counts[k]) if counts else "unknown"


def load_hf_dir(
    path: str | Path,
    *,
    dtype: str | None = None,
    source: str | None = None,
    name: str | None = None,
    prepare: Callable[[Any], None] | None = None,
) -> LoadedModel:
    """Load a local MLX/HF-format model directory. `prepare` gets the lazily loaded
    model before any weight is read (distributed/loading.py shards it there)."""
    return run_inline(
        load_hf_dir_steps(path, dtype=dtype, source=source, name=name, prepare=prepare)
    )


def load_hf_dir_steps(
    path: str | Path,
    *,
    dtype: str | None = None,
    source: str | None = None,
    name: str | None = None,
    prepare: Callable[[Any], None] | None = None,
) -> LoadSteps[LoadedModel]:
    """`load_hf_dir` as load steps (models/load_steps.py): mlx-lm builds the model on
    lazily loaded safetensors in one host slice, the weights are evaluated a slice at a
    time, the tokenizer is read off the host. A vision-language model (mlx-vlm) loads in
    one host slice."""
    from mlx_lm.utils import _get_classes, load_model

    model_dir = Path(path)
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir}: not a model directory (no config.json)")
    config_json = read_config(model_dir)
    if isinstance(config_json.get("vision_config"), dict):
        yield host("vision-language model")
        from compat_serve.models.vlm import load_vlm_dir

        vlm = load_vlm_dir(
            model_dir,
            config_json,
            dtype=dtype,
            source=source or str(model_dir),
            name=name or model_dir.resolve().name,
        )
        if vlm is not None:
            return vlm
    plan = resolve_dtype(dtype)
    t0 = time.perf_counter()
    logger.info("loading model directory %s", model_dir)
    yield host("build the model")
    try:
        model, config = load_model(
            model_dir, lazy=True, get_model_classes=without_mtp_classes(_get_classes)
        )
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise ModelLoadError(f"cannot load {model_dir} with mlx-lm: {exc}") from exc
    quantization = config.get("quantization")
    if plan.dense is not None:
        target = mx_dtype(plan.dense)
        replaced = dequantize_model(model, target)
        cast_floating(model, target)
        phase = f"dequantizing {replaced} layers to {plan.dense}" if replaced else plan.dense
        dtype_name = plan.dense
    else:
        phase = "loading weights"
        dtype_name = _dtype_name(model, quantization)
    if prepare is not None:
        prepare(model)
    logger.info("%s (%s backend)", phase, plan.backend)
    yield from evaluate_in_slices(model, phase, log=logger)
    yield WORKER
    info = load_hf_tokenizer(model_dir, config)
    t_done = time.perf_counter()
    logger.info("model ready in %.2fs (%s)", t_done - t0, dtype_name)
    model_type = str(config.get("model_type", "unknown"))
    return LoadedModel(
        model=model,
        tokenizer=info.tokenizer,
        chat_template=info.chat_template,
        context_length=context_length_from_config(config, info.tokenizer_config),
        name=name or model_dir.resolve().name,
        source=source or str(model_dir),
        dtype=dtype_name,
        model_type=model_type,
        generation_config=read_json(model_dir / "generation_config.json"),
        extra={
            "format": "mlx-dir",
            "config": config,
            "backend": plan.backend,
            "quantization": quantization,
            "model_dir": str(model_dir),
            "load_seconds": {"total": t_done - t0},
        },
    )


def load_hub_model(repo_id: str, *, dtype: str | None = None) -> LoadedModel:
    return run_inline(load_hub_model_steps(repo_id, dtype=dtype))


def load_hub_model_steps(repo_id: str, *, dtype: str | None = None) -> LoadSteps[LoadedModel]:
    loaded = yield from load_hf_dir_steps(
        download_hub_model(repo_id),
        dtype=dtype,
        source=repo_id,
        name=repo_id.rsplit("/", maxsplit=1)[-1],
    )
    return loaded


def read_config(model_dir: Path) -> dict[str, Any]:
    return read_json(model_dir / "config.json")
