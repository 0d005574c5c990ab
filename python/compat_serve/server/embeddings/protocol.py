"""Request bodies of the embedding and rerank endpoints. Lenient like the other APIs'
(unknown fields are ignored); the shapes a field may take are checked by the routes so
that each 400 names the field (server/embeddings/inputs.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OpenAIEmbeddingRequest(_Body):
    """OpenAI `POST /v1/embeddings`."""

    model: str | None = None
    # A string, a list of strings, a list of token ids, or a list of such lists.
    input: Any = None
    encoding_format: str = "float"
    dimensions: Any = None
    user: str | None = None
    # Not OpenAI's: Cohere's `input_type` / Jina's `task`; a query gets the model's query
    # prompt (Qwen3-Embedding's instruction).
    input_type: Any = None
    task: Any = None


class OllamaEmbedRequest(_Body):
    """Ollama `POST /api/embed`."""

    model: str = ""
    input: Any = None
    truncate: bool = True
    dimensions: Any = None
    keep_alive: Any = None
    # Runtime options (num_ctx, ...): nothing to set for an embedding forward.
    options: dict[str, Any] | None = None


class OllamaEmbeddingsRequest(_Body):
    """Ollama's legacy `POST /api/embeddings` (one `prompt`, one `embedding`)."""

    model: str = ""
    prompt: Any = None
    keep_alive: Any = None
    options: dict[str, Any] | None = None


class RerankRequest(_Body):
    """Cohere/Jina/vLLM/llama-server `POST /v1/rerank` and `POST /rerank`."""

    model: str | None = None
    query: Any = None
    # Strings, or objects with a `text` (Jina, Cohere v1's structured documents).
    documents: Any = None
    top_n: Any = None
    return_documents: bool = False


class ScoreRequest(_Body):
    """vLLM `POST /v1/score`: `text_1` against each of `text_2` (1xN), or pairwise (NxN)."""

    model: str | None = None
    text_1: Any = None
    text_2: Any = None
    truncate_prompt_tokens: Any = None
