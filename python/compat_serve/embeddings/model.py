"""`EmbeddingModel`: one loaded embedding or reranker model, whatever its family.

The family-specific parts are two functions the loader picks: the batched forward to
hidden states (embedding models) or to relevance scores (rerankers), and the pair prompt.
Everything here takes right-padded batches with the mask inside, so a row's result does
not depend on the other rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx
from mlx.nn.layers.base import Module

from compat_serve.embeddings.pooling import l2_normalize, pad_batch, pool
from compat_serve.embeddings.st_config import PoolingMode
from compat_serve.embeddings.text_tokens import TextTokens

EmbeddingKind = Literal["embedding", "reranker"]

# (ids [n, L] int32, mask [n, L] bool) -> hidden states [n, L, H]
HiddenForward = Callable[[mx.array, mx.array], mx.array]
# (ids, mask, lengths [n]) -> scores [n] float32
ScoreForward = Callable[[mx.array, mx.array, mx.array], mx.array]
# (tokenizer, query, document) -> the pair's token ids
PairPrompt = Callable[[TextTokens, str, str], list[int]]


@dataclass
class EmbeddingModel:
    """One loaded embedding or reranker model.

    `max_tokens`: the longest input (in tokens, special tokens and prompt included) the
    model takes; nothing here truncates. `dimensions`: the embedding width (for a
    reranker, its hidden width).
    """

    kind: EmbeddingKind
    name: str
    max_tokens: int
    dimensions: int
    tokens: TextTokens
    module: Module
    pad_id: int
    vocab_size: int
    pooling: PoolingMode | None = None
    normalize: bool = False
    query_prompt: str = ""
    document_prompt: str = ""
    hidden_forward: HiddenForward | None = None
    score_forward: ScoreForward | None = None
    pair_prompt: PairPrompt | None = None
    dtype: str = "float32"
    source: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    def tokenize(self, text: str, *, query: bool = False) -> list[int]:
        """`text` with the model's prompt (the query instruction when `query`, else the
        document prompt, usually none) and special tokens."""
        prompt = self.query_prompt if query else self.document_prompt
        return self.tokens.encode(prompt + text)

    def pair_tokens(self, query: str, document: str) -> list[int]:
        """Rerankers: the query-document pair in the model's own prompt."""
        if self.pair_prompt is None:
            raise TypeError(f"{self.name} is an embedding model, not a reranker")
        return self.pair_prompt(self.tokens, query, document)

    def check_batch(self, batch: list[list[int]]) -> None:
        """ValueError (the caller's 400) for an input the model cannot take."""
        for i, row in enumerate(batch):
            if len(row) > self.max_tokens:
                raise ValueError(
                    f"input {i} has {len(row)} tokens; {self.name} takes at most {self.max_tokens}"
                )
            bad = [t for t in row if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"input {i}: token id {bad[0]} is outside the vocabulary "
                    f"(0..{self.vocab_size - 1})"
                )

    def embed(self, batch: list[list[int]]) -> mx.array:
        """[n, dimensions] float32: pooled (and L2-normalized where the model's
        sentence-transformers modules list Normalize)."""
        if self.hidden_forward is None or self.pooling is None:
            raise TypeError(f"{self.name} is a reranker, not an embedding model")
        self.check_batch(batch)
        ids, mask, lengths = pad_batch(batch, self.pad_id)
        pooled = pool(self.hidden_forward(ids, mask), mask, lengths, self.pooling)
        return l2_normalize(pooled) if self.normalize else pooled

    def score(self, batch: list[list[int]]) -> mx.array:
        """Rerankers: [n] float32 relevance scores of `pair_tokens` rows."""
        if self.score_forward is None:
            raise TypeError(f"{self.name} is an embedding model, not a reranker")
        self.check_batch(batch)
        ids, mask, lengths = pad_batch(batch, self.pad_id)
        return self.score_forward(ids, mask, lengths).astype(mx.float32)

    def weight_bytes(self) -> int:
        from compat_serve.models.weights import model_arrays

        return sum(int(a.nbytes) for a in model_arrays(self.module).values())
