"""Tiny randomly initialised models of real mlx-lm classes, for architectures the
embedded model does not cover (hybrid attention + recurrent state).

They reuse the embedded model's real tokenizer and chat template (the vocabulary sizes
match), so the whole engine runs on them exactly as on a downloaded model.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

# Config overrides per mlx-lm model type: a few layers, hidden size 64, both kinds of
# layer present (attention with a KV cache, and a layer with non-trimmable state).
HYBRID_CONFIGS: dict[str, dict[str, Any]] = {
    # LFM2: short-convolution layers (ArraysCache) interleaved with attention (KVCache).
    "lfm2": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "block_ff_dim": 128,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    },
    # Qwen3-Next: gated delta-net linear attention (ArraysCache) + full attention.
    "qwen3_next": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "max_position_embeddings": 4096,
        "full_attention_interval": 2,
    },
}


def tiny_model(model_type: str, like: LoadedModel, *, seed: int = 0) -> LoadedModel:
    """A randomly initialised `model_type` model with `like`'s tokenizer and template."""
    import mlx.core as mx

    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = {
        "model_type": model_type,
        "vocab_size": like.tokenizer.vocab_size,
        **HYBRID_CONFIGS[model_type],
    }
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return dataclasses.replace(
        like,
        model=model,
        context_length=4096,
        name=f"tiny-{model_type}",
        source="random-init",
        dtype="float32",
        model_type=model_type,
        extra={},
    )


def tiny_llama(
    *,
    tied: bool = True,
    vocab_size: int = 1024,
    seed: int = 0,
    mlp_bias: bool = False,
    attention_bias: bool = False,
    rope_traditional: bool = False,
) -> Any:
    """A bare randomly initialised mlx-lm llama module (2 blocks, hidden size 64), for
    tests of model-level code that need no tokenizer."""
    import mlx.core as mx

    module = importlib.import_module("mlx_lm.models.llama")
    args = module.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        tie_word_embeddings=tied,
        mlp_bias=mlp_bias,
        attention_bias=attention_bias,
        rope_traditional=rope_traditional,
    )
    mx.random.seed(seed)
    model = module.Model(args)
    mx.eval(model.parameters())
    return model
