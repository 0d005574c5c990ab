"""`convert_gguf` on the embedded GGUF: the directories load in mlx-lm and answer "Paris"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import pytest
from mlx.nn.layers.quantized import QuantizedEmbedding, QuantizedLinear

from tests.greedy_ties import assert_argmax_equal_up_to_tie
from tests.python.conftest import CHATML_FRANCE, greedy

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def float32_dir_in_mlx_lm(converted_dirs: dict[str, Path]) -> tuple[Any, Any]:
    """The float32 directory as mlx-lm loads it (model, tokenizer), once for the module."""
    import mlx_lm

    loaded: Any = mlx_lm.load(str(converted_dirs["float32"]))
    return loaded[0], loaded[1]


def test_directory_contents(converted_dirs: dict[str, Path]) -> None:
    for dtype, out in converted_dirs.items():
        names = {p.name for p in out.iterdir()}
        assert names == {
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "chat_template.jinja",
        }, dtype
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == "llama"
        assert config["rope_traditional"] is False
        tok_config = json.loads((out / "tokenizer_config.json").read_text())
        assert tok_config["eos_token"] == "<|im_end|>"
        assert tok_config["bos_token"] == "<|im_start|>"
        assert tok_config["chat_template"] == (out / "chat_template.jinja").read_text()
        assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    quantized = json.loads((converted_dirs["quantized"] / "config.json").read_text())
    assert quantized["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
    }
    assert "quantization" not in json.loads((converted_dirs["float32"] / "config.json").read_text())


def test_mlx_lm_loads_float32_dir_and_answers_paris(float32_dir_in_mlx_lm: tuple[Any, Any]) -> None:
    import mlx_lm

    model, tokenizer = float32_dir_in_mlx_lm
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert prompt == CHATML_FRANCE
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=7, verbose=False)
    assert "Paris" in answer, answer
    q_proj = model.model.layers[0].self_attn.q_proj
    assert not isinstance(q_proj, QuantizedLinear)
    assert q_proj.weight.dtype == mx.float32


def test_mlx_lm_loads_quantized_dir(
    converted_dirs: dict[str, Path], embedded_model: LoadedModel
) -> None:
    """Per-layer quantization (8-bit embedding, 4-bit linears) survives; same predictions.

    MLX's CPU quantized kernel is slow, so a short input stands in for a full generation
    (the same weights answer "Paris" through our loader: test_quantized_dir_through_our_loader).
    """
    import mlx_lm

    loaded: Any = mlx_lm.load(str(converted_dirs["quantized"]))
    model, tokenizer = loaded[0], loaded[1]
    embed = model.model.embed_tokens
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(embed, QuantizedEmbedding) and embed.bits == 8
    assert isinstance(q_proj, QuantizedLinear) and (q_proj.bits, q_proj.group_size) == (4, 32)
    assert tokenizer.eos_token_ids == {2}
    ids = embedded_model.tokenizer.encode("The capital of France is")
    assert tokenizer.encode("The capital of France is", add_special_tokens=False) == ids
    x = mx.array([ids])
    direct: Any = embedded_model.model
    ref, got = direct(x), model(x)
    # Bound: the same Q4/Q8 values in two float orders (dense f32 vs MLX's quantized
    # kernel): a greedy token may differ only on a near tie (F32_TIE, tests/greedy_ties.py).
    assert_argmax_equal_up_to_tie(ref, got)
    assert float(mx.abs(ref - got).max()) < 0.1


def test_float32_dir_logits_equal_direct_gguf_load(
    float32_dir_in_mlx_lm: tuple[Any, Any], embedded_model: LoadedModel
) -> None:
    model, tokenizer = float32_dir_in_mlx_lm
    ids = embedded_model.tokenizer.encode(CHATML_FRANCE)
    assert tokenizer.encode(CHATML_FRANCE, add_special_tokens=False) == ids
    x = mx.array([ids])
    direct: Any = embedded_model.model
    diff = float(mx.abs(model(x) - direct(x)).max())
    assert diff <= 1e-4, diff


def test_quantized_dir_through_our_loader_equals_gguf(
    converted_dirs: dict[str, Path], embedded_model: LoadedModel
) -> None:
    """Our HF-dir loader dequantizes the quantized dir on the CPU: same f32 weights as the GGUF."""
    from compat_serve.models.loader import load_model

    loaded = load_model(str(converted_dirs["quantized"]))
    assert loaded.dtype == "float32"
    assert loaded.model_type == "llama"
    assert loaded.context_length == 8192
    assert loaded.chat_template == embedded_model.chat_template
    assert loaded.tokenizer.eos_token_ids == {2}
    x = mx.array([embedded_model.tokenizer.encode(CHATML_FRANCE)])
    ours: Any = loaded.model
    direct: Any = embedded_model.model
    assert mx.array_equal(ours(x), direct(x))
    assert "Paris" in greedy(loaded, CHATML_FRANCE, max_tokens=7)
