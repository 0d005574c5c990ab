"""`glm4moe` (GLM-4.5, 4.6, 4.7 and their Air variants): mlx-lm's glm4_moe class.

llama.cpp's converter (`Glm4MoeModel`) keeps the model's MTP layer: `block_count` is
`num_hidden_layers + nextn_predict_layers`, and the last block holds a whole decoder layer
plus the `nextn.*` tensors (`eh_proj`, `enorm`, `hnorm`, `shared_head_norm`, and the
optional copies `embed_tokens`, `shared_head_head`). Those are renamed here to the
Hugging Face names of that layer (`model.layers.N.eh_proj`...), which the main model never
loads (models/gguf.py sets them aside; engine/mtp_families.py builds the head from them).

Q/K rows stay in HF order (llama.cpp runs GLM-4.5 with the NEOX rope over
`rope.dimension_count` dimensions, mlx-lm with `traditional=False` over
`head_dim * partial_rotary_factor`); experts are stacked [expert, out, in] as mlx-lm's
`switch_mlp` holds them; the router's correction bias is `exp_probs_b.bias`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.gguf_families.common import (
    DEEPSEEK_MOE_NAMES,
    LLAMA_LAYER_NAMES,
    Family,
    Hparams,
    Weights,
    attention_config,
)

__all__ = ["GLM4MOE", "NEXTN_NAMES"]

logger = logging.getLogger(__name__)

# llama.cpp's `blk.N.nextn.*` -> the Hugging Face names of the MTP layer's own tensors.
NEXTN_NAMES: dict[str, str] = {
    "nextn.eh_proj": "eh_proj",
    "nextn.enorm": "enorm",
    "nextn.hnorm": "hnorm",
    "nextn.shared_head_norm": "shared_head.norm",
    "nextn.shared_head_head": "shared_head.head",
    "nextn.embed_tokens": "embed_tokens",
}


def glm4moe_config(h: Hparams, weights: Mapping[str, mx.array]) -> dict[str, Any]:
    base = attention_config(h, weights, "glm4_moe")
    nextn = h.get_int("nextn_predict_layers", 0) or 0
    layers = int(base["num_hidden_layers"]) - nextn
    if layers <= 0:
        raise ModelLoadError(
            f"{h.path}: {h.arch}.block_count {base['num_hidden_layers']} leaves no layer "
            f"before its {nextn} nextn layers"
        )
    head_dim = int(base["head_dim"])
    rope_dims = h.get_int("rope.dimension_count") or head_dim // 2
    if (kind := h.get_str("rope.scaling.type")) not in (None, "none"):
        logger.warning("%s: rope scaling %r is not reproduced (mlx-lm's glm4_moe)", h.path, kind)
    shared = h.get_int("expert_shared_count")
    return {
        **base,
        "architectures": ["Glm4MoeForCausalLM"],
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": nextn,
        "partial_rotary_factor": rope_dims / head_dim,
        "moe_intermediate_size": h.need("expert_feed_forward_length"),
        "n_routed_experts": h.need("expert_count"),
        "num_experts_per_tok": h.need("expert_used_count"),
        "n_shared_experts": shared or None,
        "first_k_dense_replace": h.get_int("leading_dense_block_count", 0),
        "routed_scaling_factor": h.get_float("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(h.meta.get_bool(f"{h.arch}.expert_weights_norm", False)),
        "n_group": h.get_int("expert_group_count") or 1,
        "topk_group": h.get_int("expert_group_used_count") or 1,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in weights,
        "attention_bias": "blk.0.attn_q.bias" in weights,
        "rope_scaling": None,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        # mlx-lm's glm4_moe always has its own head: a file without `output` reuses the
        # embedding, as llama.cpp does (TENSOR_DUPLICATED).
        "tie_word_embeddings": False,
    }


def fixup(weights: Weights, config: Mapping[str, Any]) -> Weights:
    for name in list(weights):
        if name.endswith(".e_score_correction.bias"):
            new = name.replace(".e_score_correction.bias", ".e_score_correction_bias")
            weights[new] = weights.pop(name)
    if "lm_head.weight" not in weights:
        for suffix in ("weight", "scales", "biases"):
            if (embed := weights.get(f"model.embed_tokens.{suffix}")) is not None:
                weights[f"lm_head.{suffix}"] = embed
    return weights


GLM4MOE = Family(
    "glm4moe",
    glm4moe_config,
    {
        **LLAMA_LAYER_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        **DEEPSEEK_MOE_NAMES,
        **NEXTN_NAMES,
    },
    fixup,
)
