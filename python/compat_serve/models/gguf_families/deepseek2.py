"""`deepseek2` (DeepSeek-V2/V2.5/V3/R1, Kimi K2 and the like): multi-head latent attention,
shared experts, leading dense layers.

MLA weights: `attn_q` or the low-rank `attn_q_a`/`attn_q_a_norm`/`attn_q_b`, `attn_kv_a_mqa`,
`attn_kv_a_norm`, then `attn_kv_b` (older converters) or the split `attn_k_b` (per head,
transposed) and `attn_v_b` that llama.cpp writes since its MLA rework. mlx-lm's deepseek_v3
class holds exactly that split (`embed_q` = k_b, `unembed_out` = v_b), so those map as they
are, quantized or not. Sigmoid-gated files (V3, `exp_probs_b` present) load as mlx-lm's
deepseek_v3, softmax-gated ones (V2) as deepseek_v2, which wants the joined `kv_b_proj`.
llama.cpp runs these with the adjacent-pair rope and mlx-lm with `traditional=True`: no
permutation to undo."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from compat_serve.models.gguf_families.common import (
    DEEPSEEK_MOE_NAMES,
    Family,
    Hparams,
    Weights,
    attention_config,
    drop_tied_head,
)

__all__ = ["DEEPSEEK2"]

logger = logging.getLogger(__name__)

_GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def deepseek2_config(h: Hparams, weights: Mapping[str, mx.array]) -> dict[str, Any]:
    base = attention_config(h, weights, "deepseek_v3")
    rope_dims = h.need("rope.dimension_count")
    # Since llama.cpp's MLA rework `key_length`/`value_length` describe the absorbed MQA
    # cache and the per-head sizes moved to `*_mla`.
    key_length = h.get_int("attention.key_length_mla") or h.need("attention.key_length")
    v_head_dim = h.get_int("attention.value_length_mla") or h.need("attention.value_length")
    sigmoid = h.get_int("expert_gating_func") == _GATING_SIGMOID or any(
        name.endswith("exp_probs_b.bias") for name in weights
    )
    heads = base["num_attention_heads"]
    config: dict[str, Any] = {
        "model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        **{
            k: base[k]
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "intermediate_size",
                "vocab_size",
                "rms_norm_eps",
                "rope_theta",
                "max_position_embeddings",
                "tie_word_embeddings",
            )
        },
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": h.get_int("attention.q_lora_rank") or None,
        "kv_lora_rank": h.need("attention.kv_lora_rank"),
        "qk_rope_head_dim": rope_dims,
        "qk_nope_head_dim": key_length - rope_dims,
        "v_head_dim": v_head_dim,
        "moe_intermediate_size": h.get_int("expert_feed_forward_length", 0),
        "n_routed_experts": h.get_int("expert_count") or None,
        "num_experts_per_tok": h.get_int("expert_used_count") or None,
        "n_shared_experts": h.get_int("expert_shared_count") or None,
        "first_k_dense_replace": h.get_int("leading_dense_block_count", 0),
        "routed_scaling_factor": h.get_float("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(h.meta.get_bool(f"{h.arch}.expert_weights_norm", False)),
        "n_group": h.get_int("expert_group_count") or 1,
        "topk_group": h.get_int("expert_group_used_count") or 1,
        "moe_layer_freq": 1,
        "attention_bias": False,
    }
    if sigmoid:
        config["topk_method"] = "noaux_tc"
        config["scoring_func"] = "sigmoid"
    else:
        config["topk_method"] = "group_limited_greedy" if config["n_group"] > 1 else "greedy"
    for key in ("bos_token_id", "eos_token_id"):
        if key in base:
            config[key] = base[key]
    if h.get_str("rope.scaling.type") != "yarn":
        # mlx-lm's deepseek_v2 class always builds a yarn rope: factor 1 is the plain one.
        if not sigmoid:
            config["rope_scaling"] = {"type": "yarn", "factor": 1.0, "mscale": 0.0}
    else:
        # llama.cpp stores 0.1 * mscale_all_dim as the yarn log multiplier.
        mscale = (h.get_float("rope.scaling.yarn_log_multiplier") or 0.0) / 0.1
        config["rope_scaling"] = {
            "type": "yarn",
            "factor": h.get_float("rope.scaling.factor", 1.0),
            "original_max_position_embeddings": h.get_int(
                "rope.scaling.original_context_length", config["max_position_embeddings"]
            ),
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": mscale,
            "mscale_all_dim": mscale,
        }
    return config


def _dense(weights: Weights, prefix: str, in_dims: int) -> mx.array:
    """`prefix`'s weight dense (float32), dequantizing a packed one."""
    w = weights.pop(f"{prefix}.weight")
    scales = weights.pop(f"{prefix}.scales", None)
    if scales is None:
        return w.astype(mx.float32)
    biases = weights.pop(f"{prefix}.biases", None)
    bits = int(w.shape[-1]) * 32 // in_dims
    group = in_dims // int(scales.shape[-1])
    # float32 scales, so the product is not rounded to the file's float16
    return mx.dequantize(
        w,
        scales.astype(mx.float32),
        None if biases is None else biases.astype(mx.float32),
        group_size=group,
        bits=bits,
    )


def fixup(weights: Weights, config: Mapping[str, Any]) -> Weights:
    heads = int(config["num_attention_heads"])
    rank = int(config["kv_lora_rank"])
    nope, v_dim = int(config["qk_nope_head_dim"]), int(config["v_head_dim"])
    v3 = config["model_type"] == "deepseek_v3"
    for name in list(weights):
        if name.endswith(".e_score_correction.bias"):
            weights[name.replace(".e_score_correction.bias", ".e_score_correction_bias")] = (
                weights.pop(name)
            )
    for layer in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{layer}.self_attn"
        split = f"{p}.embed_q.weight" in weights
        joined = f"{p}.kv_b_proj.weight" in weights
        if v3 and split:
            for suffix in ("weight", "scales", "biases"):
                weights.pop(f"{p}.kv_b_proj.{suffix}", None)
        elif v3 and joined:  # as mlx-lm's own sanitize: split per head, k part transposed
            kv_b = _dense(weights, f"{p}.kv_b_proj", rank).reshape(heads, nope + v_dim, rank)
            weights[f"{p}.embed_q.weight"] = mx.contiguous(kv_b[:, :nope, :].swapaxes(1, 2))
            weights[f"{p}.unembed_out.weight"] = mx.contiguous(kv_b[:, nope:, :])
        elif not v3 and split:
            k_b = _dense(weights, f"{p}.embed_q", nope)  # (heads, rank, nope)
            v_b = _dense(weights, f"{p}.unembed_out", rank)  # (heads, v, rank)
            for suffix in ("weight", "scales", "biases"):
                weights.pop(f"{p}.kv_b_proj.{suffix}", None)
            kv_b = mx.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)
            weights[f"{p}.kv_b_proj.weight"] = kv_b.reshape(heads * (nope + v_dim), rank)
    return drop_tied_head(weights, config)


DEEPSEEK2 = Family(
    "deepseek2",
    deepseek2_config,
    {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
        "attn_k_b": "self_attn.embed_q",
        "attn_v_b": "self_attn.unembed_out",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        **DEEPSEEK_MOE_NAMES,
    },
    fixup,
)
