"""MLX/HF model directories (models/hf_dir.py, hf_tokenizer.py) and `load_model` dispatch,
on tiny randomly initialised mlx-lm llama models written to a temp dir."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import pytest
from mlx.nn.layers.quantized import QuantizedLinear, quantize
from mlx.utils import tree_flatten

from compat_serve.models.context_length import context_length_from_config
from compat_serve.models.errors import ModelLoadError
from compat_serve.models.hf_dir import looks_like_hub_id
from compat_serve.models.loader import load_model
from compat_serve.models.weights import model_arrays
from tests.greedy_ties import assert_argmax_equal_up_to_tie

if TYPE_CHECKING:
    from compat_serve.models.tokenizer import Tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
}


def write_tiny_dir(
    out: Path,
    tokenizer: Tokenizer,
    *,
    quantized: bool = False,
    dtype: mx.Dtype = mx.float32,
    template_in: str = "tokenizer_config",
    generation_eos: Any = None,
) -> Any:
    """Write config.json + model.safetensors + tokenizer files; return the source model."""
    from mlx_lm.models.llama import Model, ModelArgs

    out.mkdir(parents=True)
    mx.random.seed(3)
    model: Any = Model(ModelArgs.from_dict(CONFIG))  # type: ignore[no-untyped-call]
    model.set_dtype(dtype)
    config = dict(CONFIG)
    if quantized:
        quantize(model, group_size=32, bits=4)
        config["quantization"] = {"group_size": 32, "bits": 4}
    mx.eval(model.parameters())
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    tokenizer.backend.save(str(out / "tokenizer.json"))
    tok_config: dict[str, Any] = {
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|endoftext|>",
        "model_max_length": 2048,
    }
    if template_in == "tokenizer_config":
        tok_config["chat_template"] = CHATML
    elif template_in == "tokenizer_config_list":
        tok_config["chat_template"] = [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": CHATML},
        ]
    elif template_in == "jinja":
        tok_config["chat_template"] = "stale"
        (out / "chat_template.jinja").write_text(CHATML)
    elif template_in == "json":
        (out / "chat_template.json").write_text(json.dumps({"chat_template": CHATML}))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    if generation_eos is not None:
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return model


def test_dense_dir_loads_with_equal_logits(tmp_path: Path, gguf_tokenizer: Tokenizer) -> None:
    source = write_tiny_dir(tmp_path / "m", gguf_tokenizer, generation_eos=[0, 2])
    loaded = load_model(str(tmp_path / "m"))
    assert loaded.model_type == "llama"
    assert loaded.dtype == "float32"
    assert loaded.name == "m"
    assert loaded.source == str(tmp_path / "m")
    assert loaded.context_length == 1024
    assert loaded.chat_template == CHATML
    tok = loaded.tokenizer
    assert tok.bos_token == "<|im_start|>" and tok.bos_token_id == 1
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    # eos + generation_config ids + <|im_end|> (the template ends turns with it)
    assert tok.eos_token_ids == {0, 2}
    assert tok.encode("<|im_start|>user") == gguf_tokenizer.encode("<|im_start|>user")
    x = mx.array([[1, 4093, 198, 28120, 2]])
    # Same weights; products of <= 16 rows run on the CPU kernel (another summation order).
    got, expected = loaded.model(x), source(x)
    assert mx.abs(got - expected).max().item() < 1e-4
    # Bound: two float orders; greedy tokens may part only on a near tie (F32_TIE).
    assert_argmax_equal_up_to_tie(expected, got)


def test_end_of_turn_token_from_template(tmp_path: Path, gguf_tokenizer: Tokenizer) -> None:
    write_tiny_dir(tmp_path / "m", gguf_tokenizer)  # no generation_config
    tok = load_model(str(tmp_path / "m")).tokenizer
    assert tok.eos_token_ids == {0, 2}  # <|endoftext|> (eos) + <|im_end|> (template)
    assert tok.with_chat_template("{{ messages }}").eos_token_ids == {0}


def test_quantized_dir_is_dequantized_on_cpu(tmp_path: Path, gguf_tokenizer: Tokenizer) -> None:
    source = write_tiny_dir(tmp_path / "q", gguf_tokenizer, quantized=True)
    loaded = load_model(str(tmp_path / "q"))
    assert loaded.dtype == "float32"
    model: Any = loaded.model
    assert not isinstance(model.model.layers[0].mlp.up_proj, QuantizedLinear)
    assert {v.dtype for v in model_arrays(model).values()} == {mx.float32}
    x = mx.array([[1, 4093, 198, 28120, 2]])
    diff = float(mx.abs(model(x) - source(x)).max())
    assert diff < 1e-3, diff

    kept = load_model(str(tmp_path / "q"), dtype="quantized")
    assert kept.dtype == "quantized-4bit"
    kept_model: Any = kept.model
    assert isinstance(kept_model.model.layers[0].mlp.up_proj, QuantizedLinear)


def test_bfloat16_dir_becomes_float32_on_cpu(tmp_path: Path, gguf_tokenizer: Tokenizer) -> None:
    write_tiny_dir(tmp_path / "b", gguf_tokenizer, dtype=mx.bfloat16)
    loaded = load_model(str(tmp_path / "b"))
    assert loaded.dtype == "float32"
    assert {v.dtype for v in model_arrays(loaded.model).values()} == {mx.float32}
    kept = load_model(str(tmp_path / "b"), dtype="bfloat16")
    assert kept.dtype == "bfloat16"


@pytest.mark.parametrize("where", ["tokenizer_config_list", "jinja", "json"])
def test_chat_template_sources(tmp_path: Path, gguf_tokenizer: Tokenizer, where: str) -> None:
    from compat_serve.models.hf_tokenizer import load_hf_tokenizer

    write_tiny_dir(tmp_path / "m", gguf_tokenizer, template_in=where)
    assert load_hf_tokenizer(tmp_path / "m").chat_template == CHATML


def test_chat_template_override(tmp_path: Path, gguf_tokenizer: Tokenizer) -> None:
    write_tiny_dir(tmp_path / "m", gguf_tokenizer)
    template = tmp_path / "llama3.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}")
    loaded = load_model(str(tmp_path / "m"), chat_template_path=str(template))
    assert loaded.chat_template == template.read_text()
    assert loaded.extra["chat_template_source"] == str(template)
    as_json = tmp_path / "t.json"
    as_json.write_text(json.dumps({"chat_template": "X"}))
    assert load_model(str(tmp_path / "m"), chat_template_path=str(as_json)).chat_template == "X"
    with pytest.raises(ModelLoadError, match="cannot read chat template"):
        load_model(str(tmp_path / "m"), chat_template_path=str(tmp_path / "missing.jinja"))


def test_dispatch_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelLoadError, match="not a model directory"):
        load_model(str(tmp_path))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf file"):
        load_model(str(other))
    with pytest.raises(ModelLoadError, match="not a Hugging Face hub id"):
        load_model(str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model(str(tmp_path / "missing.gguf"), dtype="int3")


def test_missing_tokenizer_json(tmp_path: Path, gguf_tokenizer: Tokenizer) -> None:
    write_tiny_dir(tmp_path / "m", gguf_tokenizer)
    (tmp_path / "m" / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        load_model(str(tmp_path / "m"))


def test_hub_id_shape(tmp_path: Path) -> None:
    assert looks_like_hub_id("mlx-community/SmolLM2-135M-Instruct-4bit")
    assert looks_like_hub_id("Qwen/Qwen3-0.6B")
    assert not looks_like_hub_id("just-a-name")
    assert not looks_like_hub_id("a/b/c")
    assert not looks_like_hub_id("./local/dir")
    assert not looks_like_hub_id(str(tmp_path))


def test_context_length_fallbacks() -> None:
    assert context_length_from_config({"max_position_embeddings": 32768}) == 32768
    assert context_length_from_config({"text_config": {"max_position_embeddings": 77}}) == 77
    assert context_length_from_config({}, {"model_max_length": 2048}) == 2048
    assert context_length_from_config({}, {"model_max_length": 10**30}) == 4096
