"""Decode attention on the Rust kernel (`models/cpu_decode_attention.py`): same numbers as
MLX's attention on strided cache views, grouped heads and left-padding masks; stock MLX
for every case the kernel does not take; clear errors on bad operands."""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from compat_serve._native import attention_decode
from compat_serve.engine.batch import merge_caches
from compat_serve.models import cpu_attention
from compat_serve.models.cpu_attention import install_split_attention
from compat_serve.models.cpu_decode_attention import decode_attention
from tests.tiny_models import tiny_llama


def operands(batch: int, positions: int, capacity: int) -> tuple[mx.array, ...]:
    """Queries and strided key/value views of a cache allocated for `capacity` positions."""
    mx.random.seed(batch * 100 + positions)
    queries = mx.random.normal((batch, 6, 1, 16))
    keys = mx.random.normal((batch, 2, capacity, 16))[:, :, :positions]
    values = mx.random.normal((batch, 2, capacity, 16))[:, :, :positions]
    return queries, keys, values


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding"])
def test_matches_mlx_attention(batch: int, mask_kind: str) -> None:
    queries, keys, values = operands(batch, 21, 64)
    mask: Any = {"none": None, "causal": "causal"}.get(mask_kind)
    if mask_kind == "padding":  # row b is left-padded by 4*b positions
        mask = mx.arange(21)[None, None, None, :] >= (4 * mx.arange(batch))[:, None, None, None]
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.3, mask=mask)
    got = decode_attention(queries, keys, values, scale=0.3, mask=mask, sinks=None)
    assert got is not None
    assert got.shape == expected.shape
    assert mx.abs(got - expected).max().item() < 1e-5


def test_cases_the_kernel_does_not_take_return_none() -> None:
    queries, keys, values = operands(2, 8, 8)
    two_rows = mx.concatenate([queries, queries], axis=2)
    assert decode_attention(two_rows, keys, values, scale=1.0, mask=None, sinks=None) is None
    half = [a.astype(mx.float16) for a in (queries, keys, values)]
    assert decode_attention(*half, scale=1.0, mask=None, sinks=None) is None
    sinks = mx.zeros((6,))
    assert decode_attention(queries, keys, values, scale=1.0, mask=None, sinks=sinks) is None
    additive = mx.zeros((2, 1, 1, 8))
    assert decode_attention(queries, keys, values, scale=1.0, mask=additive, sinks=None) is None


def test_a_batched_decode_step_matches_stock_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two prompts of different lengths merged into one left-padded batch: the kernel
    takes the decode step and the logits match MLX's attention."""
    model = tiny_llama(vocab_size=512, seed=9)
    module = importlib.import_module("mlx_lm.models.llama")
    stock = getattr(module.scaled_dot_product_attention, "_compat_split_attention", None)
    monkeypatch.setattr(
        module, "scaled_dot_product_attention", stock or module.scaled_dot_product_attention
    )
    calls: list[bool] = []
    real = cpu_attention.decode_attention

    def counting(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_attention, "decode_attention", counting)

    def step_logits() -> mx.array:
        caches = []
        for prompt in ([5, 9, 11], [7, 3, 2, 8, 30, 31, 4]):
            cache = make_prompt_cache(model)
            model(mx.array([prompt]), cache=cache)
            caches.append(cache)
        batch = merge_caches(caches)
        logits: mx.array = model(mx.array([[1], [2]]), cache=batch)
        mx.eval(logits)
        return logits

    before = step_logits()
    assert install_split_attention(model, decode_kernel=True)
    after = step_logits()
    assert calls.count(True) == 2  # one decode step, two layers
    assert mx.abs(after - before).max().item() < 1e-4


def test_bad_operands_raise_clear_errors() -> None:
    q = np.zeros((1, 4, 1, 8), np.float32)
    kv = np.zeros((1, 2, 5, 8), np.float32)
    out = np.zeros_like(q)
    with pytest.raises(ValueError, match="keys must be 4-D"):
        attention_decode(q, kv[0], kv, None, 1.0, out)
    with pytest.raises(ValueError, match=r"values .* do not match keys"):
        attention_decode(q, kv, kv[:, :, :4], None, 1.0, out)
    with pytest.raises(ValueError, match="mask is"):
        attention_decode(q, kv, kv, np.ones((1, 1, 1, 4), np.uint8), 1.0, out)
    with pytest.raises(ValueError, match="4 query heads cannot share 3"):
        attention_decode(
            q,
            np.zeros((1, 3, 5, 8), np.float32),
            np.zeros((1, 3, 5, 8), np.float32),
            None,
            1.0,
            out,
        )
    with pytest.raises(ValueError, match="out is"):
        attention_decode(q, kv, kv, None, 1.0, np.zeros((1, 4, 1, 7), np.float32))
