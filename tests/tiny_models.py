"""Tiny randomly initialised models of real mlx-lm classes, for the architectures people
serve that the embedded model (llama) does not cover: sliding windows, sinks, MoE, MLA,
hybrid attention + recurrent state.

They reuse the embedded model's real tokenizer and chat template (the vocabulary sizes
match), so the whole engine runs on them exactly as on a downloaded model.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

# Config overrides per mlx-lm model type: hidden size 64, two to four layers, and every
# kind of layer the family has (sliding-window + full attention, MoE + dense MLP, MLA,
# recurrent state + attention), so each cache type and kernel path runs. Untied LM heads
# where the family allows: a random model with tied embeddings repeats its input token,
# and a constant output hides a cache that serves the wrong positions.
_ATTENTION: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
}
# Shorter than the family tests' prompts, so rotating caches wrap.
SLIDING_WINDOW = 24

FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        **_ATTENTION,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    # Qwen3: RMS norms on q and k.
    "qwen3": {
        **_ATTENTION,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    # Qwen3-MoE: every layer a sparse MoE block (SwitchGLU, top-2 of 4 experts).
    "qwen3_moe": {
        **_ATTENTION,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    # Gemma 3: a sliding-window layer (RotatingKVCache) then a global one.
    "gemma3_text": {
        **_ATTENTION,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "query_pre_attn_scalar": 16,
        "sliding_window": SLIDING_WINDOW,
        "sliding_window_pattern": 2,
    },
    # gpt-oss: sliding + full attention with per-head sinks, MoE on every layer.
    "gpt_oss": {
        **_ATTENTION,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    # GLM-4.5: a dense first layer, then MoE with a shared expert and grouped routing.
    "glm4_moe": {
        **_ATTENTION,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 1.0,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "use_qk_norm": True,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "partial_rotary_factor": 0.5,
    },
    # DeepSeek-V3: multi-head latent attention (low-rank q and kv), dense then MoE.
    "deepseek_v3": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 4096,
    },
    # Ministral 3: sliding + full attention, llama-4 attention scaling.
    "ministral3": {
        **_ATTENTION,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-5,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 4096,
        },
    },
    # Nemotron-H: Mamba-2 layers (ArraysCache), an attention layer, an MLP-only layer.
    "nemotron_h": {
        **_ATTENTION,
        "intermediate_size": 128,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "hybrid_override_pattern": ["M", "*", "M", "-"],
    },
    # Qwen3.5: gated delta-net layers + full attention (multimodal RoPE sections).
    "qwen3_5": {
        **_ATTENTION,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "rope_parameters": {
            "type": "default",
            "mrope_section": [2, 1, 1],
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    },
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
    # Qwen3-Next: gated delta-net linear attention (ArraysCache) + full attention, MoE.
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

# The families with a layer whose state cannot be trimmed next to attention layers.
HYBRID_CONFIGS: dict[str, dict[str, Any]] = {
    name: FAMILY_CONFIGS[name] for name in ("lfm2", "qwen3_next")
}


def family_config(model_type: str, vocab_size: int) -> dict[str, Any]:
    """The full config.json of a tiny `model_type` model."""
    return {"model_type": model_type, "vocab_size": vocab_size, **FAMILY_CONFIGS[model_type]}


def tiny_model(
    model_type: str, like: LoadedModel, *, seed: int = 0, overrides: dict[str, Any] | None = None
) -> LoadedModel:
    """A randomly initialised `model_type` model with `like`'s tokenizer and template;
    `overrides` change its config (e.g. a head dim quantized KV groups divide)."""
    import mlx.core as mx

    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = {**family_config(model_type, like.tokenizer.vocab_size), **(overrides or {})}
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


def quantize_tiny(loaded: LoadedModel, *, bits: int = 4, group_size: int = 32) -> LoadedModel:
    """`loaded` with every linear layer and the embedding quantized in place by
    `mlx.nn.quantize` (as `mlx_lm.convert -q` does), reported as the users' path."""
    import mlx.core as mx
    from mlx import nn

    nn.quantize(loaded.model, group_size=group_size, bits=bits)
    mx.eval(loaded.model.parameters())
    return dataclasses.replace(
        loaded,
        dtype=f"quantized-{bits}bit",
        extra={**loaded.extra, "dtype_requested": "quantized"},
    )


def write_model_dir(
    out: Path,
    model_type: str,
    like: LoadedModel,
    *,
    seed: int = 0,
    bits: int | None = None,
    mode: str = "affine",
    generation_config: dict[str, Any] | None = None,
) -> Any:
    """Write a tiny `model_type` model as a user's download looks: config.json, safetensors
    (mlx-lm's `save_model`), `like`'s tokenizer.json and chat template, optionally
    quantized the way `mlx_lm.convert -q` does (`quantize_model`: the model's own quant
    predicate, a `quantization` entry in config.json). `mode` "affine" quantizes every
    layer to `bits`; another mode ("mxfp4", as gpt-oss ships) quantizes the experts in it
    and the rest to 8-bit affine, with per-layer entries in config.json. Returns the
    source model."""
    import mlx.core as mx
    from mlx_lm.utils import quantize_model, save_config, save_model

    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = family_config(model_type, like.tokenizer.vocab_size)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    if bits is not None:
        if mode == "affine":
            model, config = quantize_model(model, config, group_size=32, bits=bits)
        else:  # as mlx-community's "MXFP4-Q8" checkpoints: experts in `mode`, the rest 8-bit
            experts = {"group_size": 16 if mode == "nvfp4" else 32, "bits": bits, "mode": mode}

            def predicate(path: str, _module: Any) -> bool | dict[str, Any]:
                return dict(experts) if "experts" in path else True

            model, config = quantize_model(
                model, config, group_size=32, bits=8, quant_predicate=predicate
            )
    out.mkdir(parents=True)
    save_model(out, model)
    save_config(config, out / "config.json")
    tokenizer = like.tokenizer
    tokenizer.backend.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "chat_template": like.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (out / "generation_config.json").write_text(json.dumps(generation_config))
    return model


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
