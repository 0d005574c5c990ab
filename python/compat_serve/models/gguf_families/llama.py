"""`general.architecture = llama`: Llama, Mistral (sliding window where set) and Mixtral
(the same architecture with `expert_count` > 0)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from compat_serve.models.gguf_families.common import (
    LLAMA_LAYER_NAMES,
    Family,
    Hparams,
    Weights,
    attention_config,
    drop_tied_head,
    linear_rope_scaling,
    unpermute_qk,
)

__all__ = ["LLAMA", "MIXTRAL"]

logger = logging.getLogger(__name__)


def llama_config(h: Hparams, weights: Mapping[str, mx.array]) -> dict[str, Any]:
    config = attention_config(h, weights, "llama")
    config.update(
        {
            "architectures": ["LlamaForCausalLM"],
            # Q/K rows are un-permuted to the HF layout (common.unpermute_rows).
            "rope_traditional": False,
            "attention_bias": "blk.0.attn_q.bias" in weights,
            "mlp_bias": "blk.0.ffn_gate.bias" in weights,
        }
    )
    if (head_dim := h.get_int("rope.dimension_count")) and not h.get_int("attention.key_length"):
        config["head_dim"] = head_dim
    if (scaling := linear_rope_scaling(h)) is not None:
        config["rope_scaling"] = scaling
    # Mistral 7B v0.1's 4096-token window: recorded, and run as full attention, as
    # llama.cpp's llama graph and mlx-lm (which remaps `mistral` to this class) both do;
    # mlx-lm's llama cannot make every layer sliding (it needs one full-attention layer).
    if window := h.get_int("attention.sliding_window"):
        config["sliding_window"] = window
        if window < config["max_position_embeddings"]:
            logger.info("%s: sliding window %d runs as full attention", h.path, window)
    return config


def mixtral_config(h: Hparams, weights: Mapping[str, mx.array]) -> dict[str, Any]:
    config = llama_config(h, weights)
    config.update(
        {
            "model_type": "mixtral",
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": h.need("expert_count"),
            "num_experts_per_tok": h.need("expert_used_count"),
        }
    )
    for key in ("attention_bias", "mlp_bias", "head_dim", "sliding_window"):
        config.pop(key, None)
    return config


def _fixup(weights: Weights, config: Mapping[str, Any]) -> Weights:
    return drop_tied_head(unpermute_qk(weights, config), config)


LLAMA = Family("llama", llama_config, LLAMA_LAYER_NAMES, _fixup, takes_rope_freqs=True)

MIXTRAL = Family(
    "llama",
    mixtral_config,
    {
        **{k: v for k, v in LLAMA_LAYER_NAMES.items() if not k.startswith("ffn_")},
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate_inp": "block_sparse_moe.gate",
        "ffn_gate_exps": "block_sparse_moe.switch_mlp.gate_proj",
        "ffn_up_exps": "block_sparse_moe.switch_mlp.up_proj",
        "ffn_down_exps": "block_sparse_moe.switch_mlp.down_proj",
    },
    _fixup,
    takes_rope_freqs=True,
)
