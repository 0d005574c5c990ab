"""Decoder embedding models and yes/no rerankers on mlx-lm's own model classes.

- Embedding (Qwen3-Embedding, any mlx-lm architecture with a pooling config): the hidden
  states before the LM head (`model.model(ids)`), pooled. Right padding under the causal
  mask leaves every real token's state untouched by the padding, so last-token pooling
  reads position `length - 1` and needs no left padding.
- Reranker (Qwen3-Reranker): its documented prompt; score = p("yes") of the softmax over
  the "yes" and "no" logits at the last position. Its sequence-classification conversion
  (`Qwen3ForSequenceClassification`, a one-row `score` head = the "yes" row minus the "no"
  row, what vLLM and sentence-transformers load) gets the same prompt and the sigmoid of
  that head: the same p("yes").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.linear import Linear

from compat_serve.embeddings.checkpoint import (
    cross_encoder_activation,
    cross_encoder_score,
    head_labels,
    max_tokens,
    read_weights,
)
from compat_serve.embeddings.detect import architectures
from compat_serve.embeddings.model import EmbeddingModel
from compat_serve.embeddings.pooling import last_positions
from compat_serve.embeddings.st_config import SentenceTransformersConfig
from compat_serve.embeddings.text_tokens import TextTokens
from compat_serve.models.errors import ModelLoadError

# Qwen3-Reranker's model card (Qwen/Qwen3-Reranker-0.6B, "Usage"): the system turn, the
# default instruction, and the empty thinking block the assistant turn opens with.
QWEN3_RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n"
)
QWEN3_RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANK_INSTRUCTION = (
    "Given a web search query, retrieve relevant passages that answer the query"
)


def qwen3_rerank_pair(tokens: TextTokens, query: str, document: str) -> list[int]:
    body = f"<Instruct>: {QWEN3_RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    return tokens.encode(QWEN3_RERANK_PREFIX + body + QWEN3_RERANK_SUFFIX, special=False)


def build_decoder(model_dir: Path, *, keep_head: bool) -> tuple[Module, dict[str, Any]]:
    """The mlx-lm model of the directory (lazy weights) and its config, loaded by mlx-lm's
    own `load_model` (so every quantization format it reads works here too). Checkpoints
    saved without the `model.` prefix (Qwen3-Embedding's `Qwen3Model`) get it; without
    `keep_head` the LM head (and any `score` head) is removed and not required: an untied
    embedding checkpoint ships none."""
    from mlx_lm.utils import _get_classes, load_model

    def classes(config: dict[str, Any]) -> tuple[type, type]:
        model_class, args_class = _get_classes(config)
        return backbone_class(model_class, keep_head=keep_head), args_class

    try:
        model, config = load_model(model_dir, lazy=True, get_model_classes=classes)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise ModelLoadError(f"{model_dir}: cannot load with mlx-lm: {exc}") from exc
    return model, config


def backbone_class(model_class: Any, *, keep_head: bool) -> type:
    class Backbone(model_class):  # type: ignore[misc]
        def __init__(self, args: Any) -> None:
            super().__init__(args)
            if not keep_head and "lm_head" in self:
                del self["lm_head"]

        def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
            if not any(name.startswith("model.") for name in weights):
                weights = {f"model.{name}": value for name, value in weights.items()}
            if not keep_head:
                weights = {k: v for k, v in weights.items() if k.startswith("model.")}
            parent = getattr(super(), "sanitize", None)
            return parent(weights) if parent is not None else weights

    Backbone.__name__ = model_class.__name__
    return Backbone


def decoder_hidden(model: Any) -> Any:
    """Hidden states before the LM head; the mask is not needed (causal, right padding)."""

    def forward(ids: mx.array, mask: mx.array) -> mx.array:
        del mask
        hidden: mx.array = model.model(ids)
        return hidden

    return forward


def yes_no_scorer(model: Any, yes_id: int, no_id: int) -> Any:
    """p(yes) from the two logits at each row's last real token."""

    def forward(ids: mx.array, mask: mx.array, lengths: mx.array) -> mx.array:
        del mask
        last = last_positions(model.model(ids), lengths)
        if getattr(model, "lm_head", None) is not None and "lm_head" in model:
            logits = model.lm_head(last)
        else:
            logits = model.model.embed_tokens.as_linear(last)
        logits = logits.astype(mx.float32)
        return mx.sigmoid(logits[:, yes_id] - logits[:, no_id])

    return forward


class ScoreHead(Module):
    """A decoder and its sequence-classification `score` row(s), read at the last token."""

    def __init__(self, backbone: Module, weight: mx.array) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.backbone = backbone
        self.score = Linear(int(weight.shape[1]), int(weight.shape[0]), bias=False)
        self.score.weight = weight

    def __call__(self, ids: mx.array, lengths: mx.array) -> mx.array:
        backbone: Any = self.backbone
        last = last_positions(backbone.model(ids), lengths)
        logits: mx.array = self.score(last)
        return logits


def decoder_model(
    model_dir: Path,
    config_json: dict[str, Any],
    kind: str,
    st: SentenceTransformersConfig,
    tokens: TextTokens,
) -> EmbeddingModel:
    """A decoder directory (any mlx-lm architecture) as an embedding model or reranker."""
    sequence_head = any(a.endswith("ForSequenceClassification") for a in architectures(config_json))
    model, config = build_decoder(model_dir, keep_head=kind == "reranker" and not sequence_head)
    common: dict[str, Any] = {
        "name": model_dir.resolve().name,
        "max_tokens": max_tokens(int(config.get("max_position_embeddings") or 32768), st),
        "dimensions": int(config["hidden_size"]),
        "tokens": tokens,
        "pad_id": 0,  # any id: padding sits after each row's tokens under the causal mask
        "vocab_size": int(config["vocab_size"]),
        "source": str(model_dir),
    }
    if kind == "reranker" and sequence_head:
        head_labels(config, model_dir)
        weight = read_weights(model_dir).get("score.weight")
        if weight is None:
            raise ModelLoadError(
                f"{model_dir}: a sequence-classification model without score.weight"
            )
        scorer = ScoreHead(model, weight)
        activation = cross_encoder_activation(config)

        def score(ids: mx.array, mask: mx.array, lengths: mx.array) -> mx.array:
            del mask
            return cross_encoder_score(scorer(ids, lengths), activation)

        return EmbeddingModel(
            kind="reranker",
            module=scorer,
            score_forward=score,
            pair_prompt=qwen3_rerank_pair,
            info={"activation": activation},
            **common,
        )
    if kind == "reranker":
        yes, no = tokens.token_id("yes"), tokens.token_id("no")
        if yes is None or no is None:
            raise ModelLoadError(f"{model_dir}: a yes/no reranker needs 'yes' and 'no' tokens")
        return EmbeddingModel(
            kind="reranker",
            module=model,
            score_forward=yes_no_scorer(model, yes, no),
            pair_prompt=qwen3_rerank_pair,
            **common,
        )
    backbone: Any = model
    return EmbeddingModel(
        kind="embedding",
        module=backbone.model,
        hidden_forward=decoder_hidden(model),
        # Without a pooling config: the last token (Qwen3-Embedding and its kin; a mean
        # over a causal model is rarely what it was trained for).
        pooling=st.pooling or "lasttoken",
        normalize=st.normalize,
        query_prompt=st.prompt(query=True),
        document_prompt=st.prompt(query=False),
        **common,
    )
