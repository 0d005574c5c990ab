"""The reference for quantized KV: mlx-lm's own caches, and the short prompts greedy
agreement is measured on. Shared by tests/python/test_kv_quant_engine.py and
benches/kv_quant.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from compat_serve.engine.kv_quant import KVFormat
    from compat_serve.models.types import LoadedModel

SHORT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "List three colors:",
    "2 + 2 =",
]


def mlx_lm_greedy(
    model: LoadedModel, kv_format: KVFormat, prompt: tuple[int, ...], steps: int
) -> list[int]:
    """Greedy tokens through mlx-lm's own caches (`KVCache`, or `QuantizedKVCache` of
    the format), one sequence, no engine."""
    return mlx_lm_greedy_logits(model, kv_format, prompt, steps)[0]


def mlx_lm_greedy_logits(
    model: LoadedModel, kv_format: KVFormat, prompt: tuple[int, ...], steps: int
) -> tuple[list[int], list[Any]]:
    """`mlx_lm_greedy`'s tokens and the logits each was chosen from (the reference's own
    margins, for tests/greedy_ties.py: a quantized cache read in another shape gives
    other logits, so they are kept rather than recomputed)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    def layer_cache() -> Any:
        if kv_format.bits is None:
            return KVCache()
        return QuantizedKVCache(kv_format.group_size, kv_format.bits)

    cache = [layer_cache() for _ in model.model.layers]
    inputs, tokens, logits = mx.array([prompt]), [], []
    for _ in range(steps):
        logits.append(model.model(inputs, cache=cache)[0, -1].astype(mx.float32))
        tokens.append(int(mx.argmax(logits[-1]).item()))
        inputs = mx.array([[tokens[-1]]])
    return tokens, logits
