"""Load an embedding or reranker model directory into an `EmbeddingModel`.

Files are read on any thread (`WORKER` steps); building the modules on the lazily loaded
safetensors and evaluating the weights run as host steps (models/load_steps.py), so a
server of several models keeps MLX on its engine thread.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from mlx.nn.layers.base import Module
from mlx.nn.layers.quantized import QuantizedEmbedding, QuantizedLinear

from compat_serve.embeddings.decoders import decoder_model
from compat_serve.embeddings.detect import ENCODER_TYPES, kind_from_config
from compat_serve.embeddings.encoder_load import encoder_model
from compat_serve.embeddings.model import EmbeddingModel
from compat_serve.embeddings.st_config import read_json, read_sentence_transformers
from compat_serve.embeddings.text_tokens import TextTokens
from compat_serve.models.errors import ModelLoadError
from compat_serve.models.load_steps import WORKER, LoadSteps, evaluate_in_slices, host, run_inline

__all__ = ["load_embedding_model", "load_embedding_model_steps"]

logger = logging.getLogger(__name__)


def load_embedding_model(path: Path, *, dtype: str | None = None) -> EmbeddingModel:
    """An embedding or reranker model directory, loaded on this thread."""
    return run_inline(load_embedding_model_steps(path, dtype=dtype))


def load_embedding_model_steps(
    path: Path | str, *, dtype: str | None = None
) -> LoadSteps[EmbeddingModel]:
    """`load_embedding_model` as load steps. `dtype`: None/"auto" (float32 on the CPU,
    as stored on a GPU), "float32", "float16", "bfloat16", or "quantized" (as stored)."""
    from compat_serve.models.weights import resolve_dtype

    model_dir = Path(path).expanduser()
    plan = resolve_dtype(dtype, warn=False)
    yield WORKER
    config = read_json(model_dir / "config.json")
    if config is None:
        raise ModelLoadError(f"{model_dir}: not a model directory (no config.json)")
    kind = kind_from_config(model_dir, config)
    if kind == "chat":
        raise ModelLoadError(
            f"{model_dir} is a chat model (no pooling config, not a reranker): "
            "load it as a chat model"
        )
    st = read_sentence_transformers(model_dir)
    tokens = TextTokens.from_dir(model_dir)
    t0 = time.perf_counter()
    yield host("build the embedding model")
    model_type = str(config.get("model_type", ""))
    if model_type in ENCODER_TYPES:
        loaded = encoder_model(model_dir, config, kind, st, tokens)
    else:
        loaded = decoder_model(model_dir, config, kind, st, tokens)
    if plan.dense is not None:
        from compat_serve.models.weights import cast_floating, dequantize_model, mx_dtype

        if has_quantized_layers(loaded.module):  # (dequantize_model imports mlx-lm: ~3 s)
            dequantize_model(loaded.module, mx_dtype(plan.dense))
        cast_floating(loaded.module, mx_dtype(plan.dense))
        loaded.dtype = plan.dense
    yield from evaluate_in_slices(loaded.module, f"{loaded.name} weights", log=logger)
    logger.info("%s model %s ready in %.2fs", kind, loaded.name, time.perf_counter() - t0)
    return loaded


def has_quantized_layers(module: Module) -> bool:
    untyped: Any = module
    return any(
        isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for _, m in untyped.named_modules()
    )
