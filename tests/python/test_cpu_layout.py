"""Input-major weight storage (`models/cpu_layout.py`) changes where weights live, never
what the model computes: on real mlx-lm classes, tied and untied heads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
import pytest
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from compat_serve.models.cpu_layout import store_input_major
from tests.greedy_ties import assert_argmax_equal_up_to_tie
from tests.tiny_models import tiny_llama

if TYPE_CHECKING:
    pass

PROMPT = [[1, 17, 300, 42, 9, 1000, 5, 77]]


def logits(model: Any) -> mx.array:
    """Prefill then one decode step through a real KV cache."""
    cache = make_prompt_cache(model)
    first = model(mx.array(PROMPT), cache=cache)
    second = model(mx.array([[3]]), cache=cache)
    out = mx.concatenate([first, second], axis=1)
    mx.eval(out)
    return out


def weights(model: Any) -> dict[str, mx.array]:
    return dict(tree_flatten(model.parameters()))


@pytest.mark.parametrize("tied", [True, False])
def test_values_shapes_and_logits_are_unchanged(tied: bool) -> None:
    model = tiny_llama(tied=tied, seed=7)
    before_weights = weights(model)
    before = logits(model)
    relaid = store_input_major(model)
    linears = sum(type(m) is Linear for _, m in model.named_modules())
    # Each block has q/k/v/o and gate/up/down; an untied head is one more Linear, a
    # tied head is the embedding.
    assert linears == 2 * 7 + (0 if tied else 1)
    assert relaid == linears + (1 if tied else 0)
    after_weights = weights(model)
    assert after_weights.keys() == before_weights.keys()
    for name, value in before_weights.items():
        assert after_weights[name].shape == value.shape, name
        assert mx.array_equal(after_weights[name], value).item(), name
    after = logits(model)
    assert mx.abs(after - before).max().item() < 1e-5
    # Bound: two float orders; greedy tokens may part only on a near tie (F32_TIE).
    assert_argmax_equal_up_to_tie(before, after)


def test_an_untied_embedding_keeps_its_layout() -> None:
    model = tiny_llama(tied=False, seed=7)
    embedding = model.model.embed_tokens
    assert type(embedding) is Embedding
    original = embedding.weight
    store_input_major(model)
    assert embedding.weight is original  # the head is a Linear; lookups stay row reads


def test_relaying_twice_is_harmless() -> None:
    model = tiny_llama(tied=True, seed=7)
    before = logits(model)
    store_input_major(model)
    store_input_major(model)
    assert mx.abs(logits(model) - before).max().item() < 1e-5
