"""GGUF models compute their activations in float32, as llama.cpp does, on both weight paths.

A GGUF's norms are float32, and llama.cpp runs every activation in float32 whatever the
weights' type. Kept quantized (`--dtype quantized`, Metal, CUDA), the token embedding is an
MLX quantized embedding with float16 scales (or a float16 table where the file stores F16):
its output, and so the whole residual stream after it, would be float16. Gemma 3's residual
stream loses its greedy tokens to that (its logits moved by 2.3 from the dense load's on a
six-token prompt; with float32 activations 0.12, the weights' own rounding). The embedding's
output is cast to float32; every later layer then computes in float32 (the quantized matmuls
and norms take their input's type).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.quantized import QuantizedEmbedding


class _Float32Embedding(Embedding):
    def __call__(self, x: mx.array) -> mx.array:
        out: mx.array = super().__call__(x)  # type: ignore[no-untyped-call]
        return out.astype(mx.float32)


class _Float32QuantizedEmbedding(QuantizedEmbedding):
    def __call__(self, x: mx.array) -> mx.array:
        out: mx.array = super().__call__(x)  # type: ignore[no-untyped-call]
        return out.astype(mx.float32)


_FLOAT32_OUTPUT: dict[type, type] = {
    Embedding: _Float32Embedding,
    QuantizedEmbedding: _Float32QuantizedEmbedding,
}


def _output_dtype(embedding: Any) -> Any:
    """What a lookup returns: the table's type, or a quantized table's scales' type."""
    return (
        embedding.scales if isinstance(embedding, QuantizedEmbedding) else embedding.weight
    ).dtype


def embeddings_output_float32(model: Module) -> int:
    """Make every token embedding of `model` whose lookups are not float32 return float32 (in
    place, after its weights are loaded); the count changed. A float32 table (the dense CPU
    load) keeps its exact class, which the CPU layout (models/cpu_layout.py) looks for."""
    changed = 0
    untyped: Any = model
    for _, module in untyped.named_modules():
        cast = _FLOAT32_OUTPUT.get(type(module))
        if cast is not None and _output_dtype(module) != mx.float32:
            module.__class__ = cast
            changed += 1
    return changed
