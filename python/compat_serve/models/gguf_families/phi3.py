"""`phi3` (Phi-3, Phi-3.5, Phi-4, Phi-4-mini): fused `attn_qkv` and `ffn_up` (gate then up
rows, as Hugging Face's `gate_up_proj`) map onto mlx-lm's phi3 `qkv_proj`/`gate_up_proj` as
they are; llama.cpp keeps the rows in HF order (no permutation). LongRoPE factors come as
`rope_factors_long`/`rope_factors_short` tensors and go back into `rope_scaling`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from compat_serve.models.gguf_families.common import (
    Family,
    Hparams,
    attention_config,
    drop_tied_head,
)

__all__ = ["PHI3"]


def _floats(a: mx.array) -> list[float]:
    values: Any = a.astype(mx.float32).tolist()
    return [float(x) for x in values]


def phi3_config(h: Hparams, weights: Mapping[str, mx.array]) -> dict[str, Any]:
    config = attention_config(h, weights, "phi3")
    config["architectures"] = ["Phi3ForCausalLM"]
    head_dim = config.pop("head_dim")
    rope_dims = h.get_int("rope.dimension_count") or head_dim
    config["partial_rotary_factor"] = rope_dims / head_dim
    config["rope_traditional"] = False
    long, short = weights.get("rope_factors_long.weight"), weights.get("rope_factors_short.weight")
    if long is not None and short is not None:
        config["rope_scaling"] = {
            "type": "longrope",
            "long_factor": _floats(long),
            "short_factor": _floats(short),
        }
        original = h.get_int("rope.scaling.original_context_length")
        if original:
            config["original_max_position_embeddings"] = original
    return config


PHI3 = Family(
    "phi3",
    phi3_config,
    {
        "attn_norm": "input_layernorm",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
    },
    drop_tied_head,
)
