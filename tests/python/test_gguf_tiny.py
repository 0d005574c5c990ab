"""Tiny llama GGUFs written with `mx.save_gguf` in llama.cpp's layout (permuted Q/K rows,
llama.cpp tensor names, `rope_freqs`, untied output), loaded back and compared with the
mlx-lm model they were made from."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.gguf import _permute_rows, load_gguf
from compat_serve.models.gguf_tokenizer import bytes_to_unicode
from compat_serve.models.weights import model_arrays

HEADS, KV_HEADS, HIDDEN, LAYERS = 4, 2, 64, 2
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EXTRA = ["Ġt", "he", "Ġthe"]
MERGES = ["Ġ t", "h e", "Ġt he"]
LLAMA3_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def vocab_tokens() -> list[str]:
    return [*CONTROL, *bytes_to_unicode().values(), *EXTRA]


def reference_model(rope_scaling: dict[str, Any] | None) -> Any:
    from mlx_lm.models.llama import Model, ModelArgs

    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": 128,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5,
        "vocab_size": len(vocab_tokens()),
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    mx.random.seed(7)
    model = Model(ModelArgs.from_dict(config))  # type: ignore[no-untyped-call]
    # Non-trivial norms, so a mix-up between the two per-layer norms would show.
    model.update(
        {
            "model": {
                "norm": {"weight": mx.random.uniform(0.5, 1.5, (HIDDEN,))},
                "layers": [
                    {
                        "input_layernorm": {"weight": mx.random.uniform(0.5, 1.5, (HIDDEN,))},
                        "post_attention_layernorm": {
                            "weight": mx.random.uniform(0.5, 1.5, (HIDDEN,))
                        },
                    }
                    for _ in range(LAYERS)
                ],
            }
        }
    )
    mx.eval(model.parameters())
    return model


def llama3_rope_factors(dims: int, base: float) -> list[float]:
    """What llama.cpp's converter writes as `rope_freqs.weight` for LLAMA3_SCALING."""
    s = LLAMA3_SCALING
    original = s["original_max_position_embeddings"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for i in range(0, dims, 2):
        wavelen = 2 * math.pi * base ** (i / dims)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(s["factor"])
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return out


def write_gguf(model: Any, path: Path, *, rope_freqs: bool) -> None:
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    tensors: dict[str, mx.array] = {}
    for name, value in model_arrays(model).items():
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = value
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = value
        elif name == "lm_head.weight":
            tensors["output.weight"] = value
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            heads = {"self_attn.q_proj": HEADS, "self_attn.k_proj": KV_HEADS}.get(module)
            stored = value if heads is None else _permute_rows(value, heads)
            tensors[f"blk.{layer}.{names[module]}.weight"] = stored
    if rope_freqs:
        tensors["rope_freqs.weight"] = mx.array(llama3_rope_factors(HIDDEN // HEADS, 10000.0))
    tokens = vocab_tokens()

    def u32(v: int) -> mx.array:
        return mx.array(v, dtype=mx.uint32)

    metadata: dict[str, Any] = {
        "general.architecture": "llama",
        "llama.block_count": u32(LAYERS),
        "llama.context_length": u32(2048),
        "llama.embedding_length": u32(HIDDEN),
        "llama.feed_forward_length": u32(128),
        "llama.attention.head_count": u32(HEADS),
        "llama.attention.head_count_kv": u32(KV_HEADS),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        "llama.rope.dimension_count": u32(HIDDEN // HEADS),
        "llama.vocab_size": u32(len(tokens)),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.token_type": mx.array(
            [3 if t in CONTROL else 1 for t in tokens], dtype=mx.int32
        ),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>"
        "{% endfor %}",
    }
    mx.save_gguf(str(path), tensors, metadata)


@pytest.mark.parametrize("rope_freqs", [False, True], ids=["plain", "rope_freqs"])
def test_tiny_gguf_matches_source_model(tmp_path: Path, rope_freqs: bool) -> None:
    reference = reference_model(LLAMA3_SCALING if rope_freqs else None)
    path = tmp_path / "tiny.F32.gguf"
    write_gguf(reference, path, rope_freqs=rope_freqs)

    loaded = load_gguf(str(path))
    assert loaded.name == "tiny"
    assert loaded.dtype == "float32"
    assert loaded.context_length == 2048
    assert loaded.extra["config"]["tie_word_embeddings"] is False
    assert loaded.extra["quantization"] is None
    tok = loaded.tokenizer
    ids = tok.encode("<|im_start|> the 42<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.id_to_token(ids[1]) == "Ġthe"
    assert tok.eos_token_ids == {2}

    # Positions past the rope's original context make the Llama 3 factors matter.
    x = mx.array([[*ids, *range(3, 200)]])
    expected = reference(x)
    got = loaded.model(x)
    assert mx.allclose(got, expected, atol=1e-4), float(mx.abs(got - expected).max())


def test_tiny_gguf_convert_round_trip(tmp_path: Path) -> None:
    import mlx_lm

    from compat_serve.models.convert import convert_gguf

    reference = reference_model(None)
    path = tmp_path / "tiny.gguf"
    write_gguf(reference, path, rope_freqs=False)
    out = convert_gguf(str(path), str(tmp_path / "out"), dtype="float32")
    model = mlx_lm.load(str(out))[0]
    x = mx.array([list(range(3, 60))])
    assert mx.allclose(model(x), reference(x), atol=1e-4)

    with_freqs = tmp_path / "freqs.gguf"
    write_gguf(reference_model(LLAMA3_SCALING), with_freqs, rope_freqs=True)
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        convert_gguf(str(with_freqs), str(tmp_path / "out2"))
    with pytest.raises(ModelLoadError, match="not empty"):
        convert_gguf(str(path), str(out))
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        convert_gguf(str(path), str(tmp_path / "out3"), dtype="int3")


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    mx.save_gguf(str(path), {"x.weight": mx.ones((2, 2))}, {"general.architecture": "mamba"})
    with pytest.raises(ModelLoadError, match="architecture 'mamba' is not supported"):
        load_gguf(str(path))
