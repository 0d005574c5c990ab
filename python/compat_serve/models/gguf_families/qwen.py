"""`qwen2`, `qwen3` and `qwen3moe`. llama.cpp's Qwen converters keep Q/K rows in the HF
order (no permutation: llama.cpp runs these with the NEOX rope), so tensors map by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from compat_serve.models.gguf_families.common import (
    LLAMA_LAYER_NAMES,
    Family,
    Hparams,
    attention_config,
    drop_tied_head,
    linear_rope_scaling,
)

__all__ = ["QWEN2", "QWEN3", "QWEN3MOE"]

_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}


def _qwen(
    h: Hparams, weights: Mapping[str, mx.array], model_type: str, arch: str
) -> dict[str, Any]:
    config = attention_config(h, weights, model_type)
    config["architectures"] = [arch]
    if (scaling := linear_rope_scaling(h)) is not None:
        config["rope_scaling"] = scaling
    return config


def qwen2_config(h: Hparams, weights: Mapping[str, mx.array]) -> dict[str, Any]:
    config = _qwen(h, weights, "qwen2", "Qwen2ForCausalLM")
    config["rope_traditional"] = False
    del config["head_dim"]  # mlx-lm's qwen2 derives it (hidden / heads)
    return config


def qwen3_config(h: Hparams, weights: Mapping[str, mx.array]) -> dict[str, Any]:
    return _qwen(h, weights, "qwen3", "Qwen3ForCausalLM")


def qwen3moe_config(h: Hparams, weights: Mapping[str, mx.array]) -> dict[str, Any]:
    config = _qwen(h, weights, "qwen3_moe", "Qwen3MoeForCausalLM")
    moe = h.need("expert_feed_forward_length")
    config.update(
        {
            "intermediate_size": config["intermediate_size"] or moe,
            "moe_intermediate_size": moe,
            "num_experts": h.need("expert_count"),
            "num_experts_per_tok": h.need("expert_used_count"),
            # llama.cpp's qwen3moe graph always renormalises the top-k weights.
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    )
    return config


QWEN2 = Family("qwen2", qwen2_config, LLAMA_LAYER_NAMES, drop_tied_head)
QWEN3 = Family("qwen3", qwen3_config, {**LLAMA_LAYER_NAMES, **_QK_NORMS}, drop_tied_head)
QWEN3MOE = Family(
    "qwen3moe",
    qwen3moe_config,
    {
        **{
            k: v
            for k, v in LLAMA_LAYER_NAMES.items()
            if k not in ("ffn_gate", "ffn_up", "ffn_down")
        },
        **_QK_NORMS,
        **_EXPERTS,
    },
    drop_tied_head,
)
