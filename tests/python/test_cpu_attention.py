"""Prefill attention split over two CPU streams gives the stock kernel's result."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from compat_serve.models.cpu_attention import (
    MIN_SPLIT_ROWS,
    install_split_attention,
    split_attention,
)
from compat_serve.models.cpu_linear import kernel_available
from tests.tiny_models import tiny_llama

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

HEADS, KV_HEADS, DIM = 6, 2, 16


def qkv(rows: int, positions: int) -> tuple[mx.array, mx.array, mx.array]:
    mx.random.seed(rows * 7919 + positions)
    return (
        mx.random.normal((2, HEADS, rows, DIM)),
        mx.random.normal((2, KV_HEADS, positions, DIM)),
        mx.random.normal((2, KV_HEADS, positions, DIM)),
    )


@pytest.mark.parametrize("rows", [MIN_SPLIT_ROWS, MIN_SPLIT_ROWS + 1, 301])
@pytest.mark.parametrize("context", [0, 1, 700])
@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive", "none"])
def test_split_matches_the_stock_kernel(rows: int, context: int, mask_kind: str) -> None:
    queries, keys, values = qkv(rows, context + rows)
    allowed = mx.arange(context + rows)[None] <= mx.arange(context, context + rows)[:, None]
    mask: Any = {
        "causal": "causal",
        "bool": allowed,
        "additive": mx.where(allowed, 0.0, -1e9),
        "none": None,
    }[mask_kind]
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.25, mask=mask)
    got = split_attention(queries, keys, values, scale=0.25, mask=mask)
    assert got.shape == expected.shape
    assert mx.abs(got - expected).max().item() < 1e-5


def test_short_work_is_not_split() -> None:
    queries, keys, values = qkv(MIN_SPLIT_ROWS - 1, 500)
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.25)
    got = split_attention(queries, keys, values, scale=0.25)
    assert mx.array_equal(got, expected).item()


def test_installed_attention_keeps_a_chunked_prefill_exact() -> None:
    model = tiny_llama(vocab_size=512, seed=3)
    module = importlib.import_module("mlx_lm.models.llama")
    prompt = [(i * 37) % 500 for i in range(3 * MIN_SPLIT_ROWS)]

    def chunked_logits() -> mx.array:
        cache = make_prompt_cache(model)
        outs = [
            model(mx.array([prompt[i : i + 2 * MIN_SPLIT_ROWS]]), cache=cache)
            for i in range(0, len(prompt), 2 * MIN_SPLIT_ROWS)
        ]
        return mx.concatenate(outs, axis=1)

    stock = module.scaled_dot_product_attention
    try:
        if hasattr(stock, "_compat_split_attention"):  # loaded earlier in this process
            module.scaled_dot_product_attention = stock._compat_split_attention
        before = chunked_logits()
        assert install_split_attention(model)
        assert install_split_attention(model)  # idempotent
        wrapped = module.scaled_dot_product_attention
        assert getattr(wrapped, "_compat_split_attention", None) is not None
        after = chunked_logits()
    finally:
        module.scaled_dot_product_attention = stock
    assert mx.abs(after - before).max().item() < 1e-4


def test_a_model_without_the_shared_function_is_left_alone() -> None:
    class Plain:
        pass

    assert install_split_attention(Plain()) is False


def test_the_embedded_model_prefills_split(embedded_model: LoadedModel) -> None:
    # Without the kernels (`make test-cpu-fallback`) decode attention stays MLX's.
    kernel = "; decode on the attention kernel" if kernel_available() else ""
    assert embedded_model.extra["attention"] == "prefill rows split over 2 CPU streams" + kernel


def test_each_thread_gets_its_own_second_stream() -> None:
    import threading

    queries, keys, values = qkv(MIN_SPLIT_ROWS, 300)
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.25)
    mx.eval(queries, keys, values, expected)  # lazy arrays stay on their thread's stream
    mx.eval(split_attention(queries, keys, values, scale=0.25))  # this thread's stream
    results: list[Any] = []

    def other_thread() -> None:
        got = split_attention(queries, keys, values, scale=0.25)
        results.append(mx.abs(got - expected).max().item())

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert results and results[0] < 1e-5
