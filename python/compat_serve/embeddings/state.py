"""An embedding or reranker model as the registry holds it: its hosted engine and what
the routes need to know of it (name, kind, input limit). Built from the same serve
options as a chat model; the chat-only options (templates, KV, parsers) do not apply."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from compat_serve.embeddings.scheduler import EmbeddingEngine

if TYPE_CHECKING:
    from compat_serve.embeddings.model import EmbeddingModel
    from compat_serve.models.load_steps import LoadSteps

# What each kind of model serves, for the 400 a request of the wrong kind gets.
KIND_SERVES = {
    "chat": "chat and completions (/v1/chat/completions, /v1/messages, /api/chat, ...)",
    "embedding": "embeddings (/v1/embeddings, /api/embed, /api/embeddings)",
    "reranker": "rerank and score (/v1/rerank, /rerank, /v1/score)",
}

# What model lists show of each kind (/v1/models `capabilities`, Ollama's `capabilities`).
KIND_CAPABILITIES = {
    "chat": ["completion", "chat"],
    "embedding": ["embedding"],
    "reranker": ["rerank", "score"],
}


class EmbeddingOptions(Protocol):
    """The serve options an embedding model reads (the bootstrap's `ServeOptions`)."""

    @property
    def model(self) -> str | None: ...
    @property
    def dtype(self) -> str: ...
    @property
    def served_model_name(self) -> str | None: ...
    @property
    def api_key(self) -> str | None: ...
    @property
    def strict_model_names(self) -> bool: ...
    @property
    def max_request_bytes(self) -> int: ...


@dataclass
class EmbeddingState:
    engine: EmbeddingEngine
    served_model_name: str
    api_key: str | None = None
    strict_model_names: bool = False
    max_request_bytes: int = 32 * 1024 * 1024
    # Set on the first shutdown signal: nothing new is admitted.
    draining: bool = False

    @property
    def model(self) -> EmbeddingModel:
        return self.engine.model

    @property
    def kind(self) -> str:
        return self.engine.model.kind

    @property
    def context_length(self) -> int:
        """The most tokens one input may have."""
        return int(self.engine.model.max_tokens)


def embedding_state(options: EmbeddingOptions, model: EmbeddingModel) -> EmbeddingState:
    """The state of a loaded embedding model (its engine is started by the hub)."""
    return EmbeddingState(
        engine=EmbeddingEngine(model),
        served_model_name=options.served_model_name or model.name,
        api_key=options.api_key,
        strict_model_names=options.strict_model_names,
        max_request_bytes=options.max_request_bytes,
    )


def build_embedding_state(options: EmbeddingOptions) -> EmbeddingState:
    from compat_serve.embeddings.loader import load_embedding_model

    assert options.model is not None  # the embedded default model is a chat model
    return embedding_state(options, load_embedding_model(Path(options.model), dtype=options.dtype))


def embedding_state_steps(options: EmbeddingOptions) -> LoadSteps[EmbeddingState]:
    """`build_embedding_state` as load steps: MLX work on the host's thread in slices."""
    from compat_serve.embeddings.loader import load_embedding_model_steps

    assert options.model is not None
    model = yield from load_embedding_model_steps(options.model, dtype=options.dtype)
    return embedding_state(options, model)
