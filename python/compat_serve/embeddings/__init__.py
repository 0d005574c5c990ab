"""Embedding and reranker models (#37): detection from a model directory, loading, batched
padding-aware forwards with the model's own pooling, prompts and scores.

The server side (endpoints, engine scheduling, registry) lives beside this package and
sees only `EmbeddingModel`.
"""

from compat_serve.embeddings.detect import ModelKind, model_kind
from compat_serve.embeddings.loader import load_embedding_model, load_embedding_model_steps
from compat_serve.embeddings.model import EmbeddingKind, EmbeddingModel

__all__ = [
    "EmbeddingKind",
    "EmbeddingModel",
    "ModelKind",
    "load_embedding_model",
    "load_embedding_model_steps",
    "model_kind",
]
