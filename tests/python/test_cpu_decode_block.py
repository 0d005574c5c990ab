"""Fused decode steps of llama blocks (`models/cpu_decode_block.py`, `_native.DecodeBlock`):
the same logits as the stock block, single and left-padded batched caches, both RoPE
layouts; the stock block for everything the fused path does not take; clear errors on bad
operands. Real mlx-lm classes throughout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from compat_serve._native import DecodeBlock
from compat_serve.engine.batch import merge_caches
from compat_serve.models.cpu_decode_block import install_fused_decode_blocks
from compat_serve.models.cpu_linear import install_skinny_linears
from tests.greedy_ties import assert_argmax_equal_up_to_tie
from tests.tiny_models import tiny_llama

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

PROMPTS = ([5, 9, 11], [7, 3, 2, 8, 30, 31, 4, 17, 2, 90])


def decode_logits(model: Any, prompts: tuple[list[int], ...], steps: int = 3) -> mx.array:
    """Prefill each prompt on its own cache, batch the caches (left padding) and run
    `steps` decode steps; the logits of every step, `[rows, steps, vocab]`."""
    caches = []
    for prompt in prompts:
        cache = make_prompt_cache(model)
        model(mx.array([prompt]), cache=cache)
        caches.append(cache)
    cache = caches[0] if len(caches) == 1 else merge_caches(caches)
    tokens = mx.array([[prompt[0]] for prompt in prompts])  # a row's inputs are its own
    out = []
    for step in range(steps):
        logits = model(tokens + step, cache=cache)
        out.append(logits)
    result = mx.concatenate(out, axis=1)
    mx.eval(result)
    return result


def fused_and_stock(**llama_args: Any) -> tuple[Any, Any]:
    stock, fused = tiny_llama(**llama_args), tiny_llama(**llama_args)
    for model in (stock, fused):
        install_skinny_linears(model)
    assert install_fused_decode_blocks(fused) == 2
    return stock, fused


@pytest.mark.parametrize("rope_traditional", [False, True])
@pytest.mark.parametrize("prompts", [PROMPTS[1:], PROMPTS], ids=["single", "batched"])
def test_decode_steps_match_the_stock_block(
    rope_traditional: bool, prompts: tuple[list[int], ...]
) -> None:
    stock, fused = fused_and_stock(seed=5, rope_traditional=rope_traditional)
    expected = decode_logits(stock, prompts)
    got = decode_logits(fused, prompts)
    assert got.shape == expected.shape
    assert mx.abs(got - expected).max().item() < 1e-4
    # Bound: two float orders; greedy tokens may part only on a near tie (F32_TIE).
    assert_argmax_equal_up_to_tie(expected, got)


def test_steps_of_few_positions_take_the_fused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    _, fused = fused_and_stock(seed=6)
    seen: list[int] = []
    real = llama.TransformerBlock.__call__

    def counting(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        seen.append(x.shape[1])
        result: mx.array = real(self, x, mask, cache)
        return result

    monkeypatch.setattr(llama.TransformerBlock, "__call__", counting)
    decode_logits(fused, PROMPTS, steps=2)
    # No decode step and no prefill of up to MAX_KERNEL_ROWS positions ran the stock block.
    assert seen == []
    cache = make_prompt_cache(fused)
    fused(mx.array([[4]]), cache=None)  # no cache: stock
    fused(mx.array([[4]] * 17), cache=cache)  # more rows than the kernel takes
    fused(mx.array([list(range(17))]), cache=make_prompt_cache(fused))  # more positions
    assert seen == [1, 1, 1, 1, 17, 17]


def few_at_once_and_stepwise(
    model: Any, prompts: tuple[list[int], ...], new: list[int]
) -> tuple[mx.array, mx.array]:
    """Logits of `new` fed to every row in one step, and one position a step, after the
    prompts (left-padded batch when several)."""

    def cache_after_prompts() -> Any:
        caches = []
        for prompt in prompts:
            cache = make_prompt_cache(model)
            model(mx.array([prompt]), cache=cache)
            caches.append(cache)
        return caches[0] if len(caches) == 1 else merge_caches(caches)

    rows = len(prompts)
    at_once = model(mx.array([new] * rows), cache=cache_after_prompts())
    cache = cache_after_prompts()
    steps = [model(mx.array([[token]] * rows), cache=cache) for token in new]
    stepwise = mx.concatenate(steps, axis=1)
    mx.eval(at_once, stepwise)
    return at_once, stepwise


def test_a_verify_of_few_positions_equals_that_many_decode_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A speculative verify feeds a row its last token and its drafts in one step: on the
    fused path each position is a row of the same two Rust calls, so one row's logits are
    the decode steps' bit for bit; a batch (left padding: the attention kernel once per
    position, with that position's row of the mask) agrees within two float orders. (Over
    8-bit KV: test_mtp.py's q8 test, on the embedded model.)"""
    _, fused = fused_and_stock(seed=9)
    new = [40, 41, 42]
    at_once, stepwise = few_at_once_and_stepwise(fused, PROMPTS[1:], new)
    assert mx.array_equal(at_once, stepwise)
    import compat_serve.models.cpu_decode_block as fused_block

    def no_mlx_attention(*args: Any, **kwargs: Any) -> mx.array:
        raise AssertionError("a batch of few positions left the attention kernel")

    monkeypatch.setattr(fused_block, "scaled_dot_product_attention", no_mlx_attention)
    at_once, stepwise = few_at_once_and_stepwise(fused, PROMPTS, new)
    assert at_once.shape == stepwise.shape == (len(PROMPTS), len(new), 1024)
    assert mx.abs(at_once - stepwise).max().item() < 1e-4
    assert_argmax_equal_up_to_tie(stepwise, at_once)


def test_a_row_gets_the_same_bits_alone_and_in_a_batch() -> None:
    _, fused = fused_and_stock(seed=7)
    batched = decode_logits(fused, PROMPTS)
    alone = decode_logits(fused, PROMPTS[1:])
    assert mx.array_equal(batched[1], alone[0])


def test_blocks_the_fused_path_cannot_serve_stay_stock() -> None:
    biased = tiny_llama(attention_bias=True)
    install_skinny_linears(biased)
    assert install_fused_decode_blocks(biased) == 0
    quantized = tiny_llama()
    nn.quantize(quantized, group_size=32, bits=4)
    install_skinny_linears(quantized)
    assert install_fused_decode_blocks(quantized) == 0
    no_kernel = tiny_llama()  # projections not on the skinny kernel
    assert install_fused_decode_blocks(no_kernel) == 0
    assert all(type(layer) is llama.TransformerBlock for layer in no_kernel.model.layers)


def test_installing_twice_is_harmless() -> None:
    stock, fused = fused_and_stock(seed=8)
    assert install_fused_decode_blocks(fused) == 0
    assert mx.abs(decode_logits(fused, PROMPTS) - decode_logits(stock, PROMPTS)).max() < 1e-4


def ones(*shape: int) -> np.ndarray:
    return np.ones(shape, np.float32)


def block_operands() -> dict[str, Any]:
    """A block of hidden size 8: 2 query heads of 4 sharing one key/value head."""
    return {
        "norms": (ones(8), 1e-5, ones(8), 1e-5),
        "attention": (ones(8, 8), ones(4, 8), ones(4, 8), ones(8, 8)),
        "mlp": (ones(12, 8), ones(12, 8), ones(8, 12)),
        "head_dim": 4,
        "rope": (4, 10_000.0, 1.0, False),
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"head_dim": 3}, "not whole heads of 3"),
        ({"rope": (5, 10_000.0, 1.0, False)}, "RoPE over 5 of 4"),
        ({"mlp": (ones(12, 8),) * 3}, "down_proj"),
        ({"norms": (ones(7), 1e-5, ones(8), 1e-5)}, "post-attention norm is"),
        ({"attention": (ones(8, 8), ones(4, 8), ones(8, 8), ones(8, 8))}, "v_proj is"),
        ({"attention": (ones(12, 8), ones(8, 8), ones(8, 8), ones(8, 12))}, "3 query heads"),
        ({"attention": (ones(8, 8), ones(4, 8), ones(4, 8), ones(8, 4))}, "o_proj is"),
    ],
)
def test_bad_weights_are_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecodeBlock(**{**block_operands(), **change})


def test_bad_step_operands_raise_clear_errors() -> None:
    block = DecodeBlock(**block_operands())
    x = np.ones((2, 1, 8), np.float32)
    q = np.zeros((2, 2, 1, 4), np.float32)
    kv = np.zeros((2, 1, 1, 4), np.float32)
    with pytest.raises(ValueError, match="x is"):
        block.project(x, [0], (q, kv, kv.copy()))
    with pytest.raises(ValueError, match="keys is"):
        block.project(x, [0, 1], (q, np.zeros((2, 2, 1, 4), np.float32), kv))
    block.project(x, [0, 1], (q, kv, kv.copy()))
    out = np.zeros_like(x)
    cached = np.zeros((2, 1, 5, 4), np.float32)
    with pytest.raises(ValueError, match="mask is"):
        block.finish(x, q, cached, cached, np.ones((2, 1, 1, 4), np.uint8), 0.5, out)
    with pytest.raises(ValueError, match="do not fit"):
        block.finish(x, q, cached[:1], cached[:1], None, 0.5, out)
    block.finish(x, q, cached, cached, np.ones((2, 1, 1, 5), np.uint8), 0.5, out)
    assert np.isfinite(out).all()


def test_the_embedded_model_decodes_fused(embedded_model: LoadedModel) -> None:
    from compat_serve.models.cpu_linear import kernel_available

    layers = embedded_model.model.model.layers
    if not kernel_available():  # a CPU without AVX-512 keeps mlx-lm's stock blocks
        assert "decode_blocks" not in embedded_model.extra
        assert all(type(layer) is llama.TransformerBlock for layer in layers)
        return
    assert embedded_model.extra["decode_blocks"] == "30 blocks fused (norms, RoPE in Rust)"
    assert all(type(layer) is not llama.TransformerBlock for layer in layers)
