"""Reading a checkpoint's weights and the facts about its head that every family shares."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module

from compat_serve.embeddings.st_config import SentenceTransformersConfig
from compat_serve.models.errors import ModelLoadError


def read_weights(model_dir: Path) -> dict[str, mx.array]:
    files = sorted(glob.glob(str(model_dir / "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{model_dir}: no .safetensors weights")
    weights: dict[str, mx.array] = {}
    for file in files:
        loaded: Any = mx.load(file)
        weights.update(loaded)
    return weights


def max_tokens(model_limit: int, st: SentenceTransformersConfig) -> int:
    """The model's position limit, or sentence-transformers' `max_seq_length` if lower."""
    return min(model_limit, st.max_seq_length) if st.max_seq_length else model_limit


def head_labels(config: dict[str, Any], model_dir: Path) -> int:
    id2label = config.get("id2label")
    labels = len(id2label) if isinstance(id2label, dict) else int(config.get("num_labels", 2))
    if labels != 1:
        raise ModelLoadError(
            f"{model_dir}: a classification head with {labels} labels; rerankers "
            "need a single relevance logit"
        )
    return labels


def cross_encoder_activation(config: dict[str, Any]) -> str:
    """What sentence-transformers' CrossEncoder applies to a 1-label head's logit: the
    activation its config names (`sentence_transformers.activation_fn`, or the older
    `sbert_ce_default_activation_function`), else Sigmoid, its default for one label."""
    st = config.get("sentence_transformers")
    named = st.get("activation_fn") if isinstance(st, dict) else None
    named = named or config.get("sbert_ce_default_activation_function")
    if isinstance(named, str) and named.rsplit(".", 1)[-1] == "Identity":
        return "identity"
    return "sigmoid"


def cross_encoder_score(logits: mx.array, activation: str) -> mx.array:
    """A 1-label head's relevance scores from its logits `[n, 1]`, as float32 with the
    activation `cross_encoder_activation` named."""
    logit = logits[:, 0].astype(mx.float32)
    return mx.sigmoid(logit) if activation == "sigmoid" else logit


def load_strict(module: Module, weights: dict[str, mx.array], model_dir: Path) -> None:
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"{model_dir}: weights do not match the config: {exc}") from exc
