"""Encoder checkpoints (BERT, XLM-RoBERTa, ModernBERT) as `EmbeddingModel`s: embedding
models pooled per their sentence-transformers config, and cross-encoder rerankers
(`*ForSequenceClassification` with one label)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module

from compat_serve.embeddings.checkpoint import (
    cross_encoder_activation,
    cross_encoder_score,
    head_labels,
    load_strict,
    max_tokens,
    read_weights,
)
from compat_serve.embeddings.encoders import (
    BertForSequenceClassification,
    BertModel,
    EncoderConfig,
    XLMRobertaForSequenceClassification,
    sanitize_encoder_weights,
)
from compat_serve.embeddings.model import EmbeddingModel
from compat_serve.embeddings.modernbert import (
    ModernBertConfig,
    ModernBertForSequenceClassification,
    ModernBertModel,
)
from compat_serve.embeddings.st_config import SentenceTransformersConfig
from compat_serve.embeddings.text_tokens import TextTokens
from compat_serve.models.errors import ModelLoadError

# Prefixes the task heads of HF checkpoints put before the encoder's own names.
_ENCODER_PREFIXES = ("bert.", "roberta.", "model.")
_HEAD_PREFIXES = ("cls.", "lm_head.", "head.", "decoder.", "classifier.")


def strip_encoder_prefix(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The encoder's own parameters: task-head prefixes removed, task heads dropped."""
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        for prefix in _ENCODER_PREFIXES:
            if name.startswith(prefix):
                out[name[len(prefix) :]] = value
                break
        else:
            if not name.startswith(_HEAD_PREFIXES):
                out[name] = value
    return out


def encoder_model(
    model_dir: Path,
    config: dict[str, Any],
    kind: str,
    st: SentenceTransformersConfig,
    tokens: TextTokens,
) -> EmbeddingModel:
    if isinstance(config.get("quantization"), dict):
        raise ModelLoadError(f"{model_dir}: quantized encoder checkpoints are not supported")
    model_type = str(config["model_type"])
    weights = sanitize_encoder_weights(read_weights(model_dir))
    embedder: Module
    reranker: Module
    if model_type == "modernbert":
        mcfg = ModernBertConfig.from_dict(config)
        limit, width, pad, vocab = (
            mcfg.max_position_embeddings,
            mcfg.hidden_size,
            mcfg.pad_token_id,
            mcfg.vocab_size,
        )
        if kind == "reranker":
            reranker = ModernBertForSequenceClassification(mcfg, head_labels(config, model_dir))
        else:
            embedder = ModernBertModel(mcfg)
    else:
        # BERT pairs take token type 1 after the first [SEP]; a single text is all type 0.
        pair = model_type == "bert" and kind == "reranker"
        sep = tokens.token_id("[SEP]") if pair else None
        cfg = EncoderConfig.from_dict(config, sep)
        limit, width, pad, vocab = cfg.max_tokens, cfg.hidden_size, cfg.pad_token_id, cfg.vocab_size
        if kind == "reranker":
            labels = head_labels(config, model_dir)
            reranker = (
                BertForSequenceClassification(cfg, labels)
                if model_type == "bert"
                else XLMRobertaForSequenceClassification(cfg, labels)
            )
        else:
            own = strip_encoder_prefix(weights)
            embedder = BertModel(cfg, pooler="pooler.dense.weight" in own)
    common: dict[str, Any] = {
        "name": model_dir.resolve().name,
        "max_tokens": max_tokens(limit, st),
        "dimensions": width,
        "tokens": tokens,
        "pad_id": pad,
        "vocab_size": vocab,
        "source": str(model_dir),
    }
    if kind == "reranker":
        load_strict(reranker, weights, model_dir)
        activation = cross_encoder_activation(config)
        head: Any = reranker

        def score(ids: mx.array, mask: mx.array, lengths: mx.array) -> mx.array:
            del lengths
            return cross_encoder_score(head(ids, mask), activation)

        return EmbeddingModel(
            kind="reranker",
            module=reranker,
            score_forward=score,
            pair_prompt=lambda tok, query, document: tok.encode_pair(query, document),
            info={"activation": activation},
            **common,
        )
    load_strict(embedder, strip_encoder_prefix(weights), model_dir)
    forward: Any = embedder
    return EmbeddingModel(
        kind="embedding",
        module=embedder,
        hidden_forward=forward,
        # Without a pooling config: mean, sentence-transformers' default for a bare
        # Hugging Face encoder.
        pooling=st.pooling or "mean",
        normalize=st.normalize,
        query_prompt=st.prompt(query=True),
        document_prompt=st.prompt(query=False),
        **common,
    )
