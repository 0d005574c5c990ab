"""The skinny decode kernel (`models/cpu_linear.py`, `compat_serve._native.matmul_nt`):
same numbers as MLX, a row's bits independent of the batch, routing by row count, and
clear errors on bad operands. Real mlx-lm classes throughout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx.nn.layers.linear import Linear
from mlx_lm.models.cache import make_prompt_cache

from compat_serve._native import matmul_kernel, matmul_nt, swiglu_mlp
from compat_serve.models import cpu_linear
from compat_serve.models.cpu_layout import store_input_major
from compat_serve.models.cpu_linear import (
    MAX_KERNEL_ROWS,
    SkinnyEmbedding,
    SkinnyLinear,
    install_skinny_linears,
    kernel_available,
    kernels_disabled,
)
from tests.greedy_ties import assert_argmax_equal_up_to_tie
from tests.tiny_models import tiny_llama

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

SHORT = list(range(3, 11))  # 8 tokens: the prefill takes the kernel too
LONG = [(7 * i + 3) % 1000 for i in range(40)]  # 40 tokens: the prefill stays on MLX


def logits(model: Any, prompt: list[int]) -> mx.array:
    """Prefill then two decode steps through a real KV cache."""
    cache = make_prompt_cache(model)
    out = [model(mx.array([prompt]), cache=cache)]
    for token in (3, 9):
        out.append(model(mx.array([[token]]), cache=cache))
    result = mx.concatenate(out, axis=1)
    mx.eval(result)
    return result


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "long"])
def test_logits_match_stock_mlx(tied: bool, prompt: list[int]) -> None:
    model = tiny_llama(tied=tied, seed=11)
    before = logits(model, prompt)
    routed = install_skinny_linears(model)
    # q/k/v/o/gate/up/down per block, the embedding and, when untied, the head.
    assert routed == 2 * 7 + (1 if tied else 2)
    assert type(model.model.layers[0].mlp).__qualname__ == "SkinnySwiGLU[MLP]"
    after = logits(model, prompt)
    assert mx.abs(after - before).max().item() < 1e-4
    # Bound: two float orders; greedy tokens may part only on a near tie (F32_TIE).
    assert_argmax_equal_up_to_tie(before, after)


def test_products_are_routed_by_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    rows_seen: list[int] = []
    real = cpu_linear.matmul_nt

    def counting(x: mx.array, w: mx.array, out: np.ndarray) -> None:
        rows_seen.append(x.size // x.shape[-1])
        real(x, w, out)

    monkeypatch.setattr(cpu_linear, "matmul_nt", counting)
    layer = nn.Linear(64, 32)
    install_skinny_linears(layer)
    assert type(layer) is SkinnyLinear
    for rows in (1, MAX_KERNEL_ROWS, MAX_KERNEL_ROWS + 1):
        x = mx.random.normal((rows, 64))
        expected = x @ layer.weight.T + layer.bias
        assert mx.allclose(layer(x), expected, atol=1e-5).item()
    assert rows_seen == [1, MAX_KERNEL_ROWS]


def test_a_row_gets_the_same_bits_alone_and_in_a_batch() -> None:
    layer = nn.Linear(576, 1536, bias=False)
    install_skinny_linears(layer)
    x = mx.random.normal((8, 1, 576))
    batched = layer(x)
    for row in range(8):
        assert mx.array_equal(layer(x[row : row + 1]), batched[row : row + 1]).item(), row


def test_fused_swiglu_matches_the_stock_block() -> None:
    model = tiny_llama(seed=3)
    mlp = model.model.layers[1].mlp
    x = mx.random.normal((5, 1, 64))
    expected = mlp(x)
    install_skinny_linears(model)
    assert mx.abs(mlp(x) - expected).max().item() < 1e-5
    big = mx.random.normal((1, MAX_KERNEL_ROWS + 4, 64))  # falls back to the stock block
    assert type(mlp).__mro__[1].__call__(mlp, big).shape == mlp(big).shape


def test_a_biased_swiglu_block_is_not_fused() -> None:
    from mlx_lm.models import llama

    mlp = tiny_llama(mlp_bias=True).model.layers[0].mlp
    install_skinny_linears(mlp)
    assert type(mlp) is llama.MLP
    assert type(mlp.gate_proj) is SkinnyLinear  # its projections still take the kernel


def test_layers_the_kernel_cannot_serve_keep_mlx() -> None:
    quantized = nn.QuantizedLinear(64, 64)
    half = nn.Linear(64, 64)
    half.set_dtype(mx.float16)
    relaid = nn.Linear(64, 64)
    store_input_major(relaid)  # a transposed view: not row-major [out, in]
    container = nn.Sequential(quantized, half, relaid)
    assert install_skinny_linears(container) == 0
    assert [type(layer) for layer in container.layers] == [nn.QuantizedLinear, Linear, Linear]


def test_installing_twice_is_harmless() -> None:
    model = tiny_llama(seed=5)
    before = logits(model, SHORT)
    install_skinny_linears(model)
    assert install_skinny_linears(model) == 0
    assert type(model.model.embed_tokens) is SkinnyEmbedding
    assert type(model.model.layers[0].mlp).__qualname__ == "SkinnySwiGLU[MLP]"
    assert mx.abs(logits(model, SHORT) - before).max().item() < 1e-4


def test_an_untied_embedding_is_never_used_as_a_head() -> None:
    model = tiny_llama(tied=False, seed=5)
    install_skinny_linears(model)
    assert type(model.lm_head) is SkinnyLinear
    lookups = model.model.embed_tokens(mx.array([[1, 2, 3]]))
    assert mx.array_equal(lookups[0, 1], model.model.embed_tokens.weight[2]).item()


@pytest.mark.parametrize(
    ("x", "w", "out", "message"),
    [
        (np.zeros((2, 3), np.float32), np.zeros((4, 5), np.float32), np.zeros((2, 4), np.float32),
         "w is [4, 5], expected 4 x 3"),
        (np.zeros((2, 3), np.float32), np.zeros((4, 3), np.float32), np.zeros((2, 5), np.float32),
         "out is [2, 5], expected 2 x 4"),
        (np.zeros((2, 3), np.float64), np.zeros((4, 3), np.float32), np.zeros((2, 4), np.float32),
         "x must be a float32 buffer"),
        (np.zeros((3, 2), np.float32).T, np.zeros((4, 3), np.float32), np.zeros((2, 4), np.float32),
         "x must be C-contiguous"),
    ],
)  # fmt: skip
def test_bad_operands_raise_clear_errors(x: Any, w: Any, out: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        matmul_nt(x, w, out)


def test_a_read_only_output_is_refused() -> None:
    out = np.zeros((1, 2), np.float32)
    out.setflags(write=False)
    with pytest.raises(ValueError, match="out must be writable"):
        matmul_nt(np.ones((1, 3), np.float32), np.ones((2, 3), np.float32), out)


def test_swiglu_mlp_checks_every_weight() -> None:
    x, out = np.ones((1, 4), np.float32), np.zeros((1, 4), np.float32)
    gate = np.ones((6, 4), np.float32)
    with pytest.raises(ValueError, match="w_down"):
        swiglu_mlp(x, gate, gate, np.ones((6, 4), np.float32), out)


def test_the_embedded_model_decodes_on_the_kernel(embedded_model: LoadedModel) -> None:
    # 30 blocks x 7 projections + the tied embedding/head.
    expected = (
        "row-major, decode on the skinny kernel (211)"
        if kernel_available()
        else "input-major (211 dense weights)"
    )
    assert embedded_model.extra["weight_layout"] == expected
    # The kernel path loads exactly where the AVX-512 kernel runs and is not turned off
    # (CPUs differ: an EPYC without AVX-512 runs the input-major fallback here, as
    # `make test-cpu-fallback` does on an AVX-512 CPU with COMPAT_SERVE_CPU_KERNELS=off).
    assert kernel_available() == (matmul_kernel() != "scalar" and not kernels_disabled())
