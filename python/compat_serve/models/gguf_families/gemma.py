"""`gemma2` and `gemma3` (text). llama.cpp's converter adds 1 to every Gemma RMSNorm weight
(its norm multiplies by `w`, Gemma's by `1 + w`); mlx-lm's Gemma norms use `1 + w`, so the
loader subtracts it again. No Q/K permutation; the embedding is tied; mlx-lm's classes scale
the embedding by sqrt(hidden) themselves, as llama.cpp's graph does."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.gguf_families.common import (
    LLAMA_LAYER_NAMES,
    Family,
    Hparams,
    Weights,
    attention_config,
    drop_tied_head,
    linear_rope_scaling,
)

__all__ = ["GEMMA2", "GEMMA3"]

# llama.cpp's model size by block count, for its query scale: the 27B models scale by
# hidden/heads, the others by head_dim (llama-model.cpp, `f_attention_scale`).
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}
_DEFAULT_SWA_PATTERN = 6  # llama.cpp hard-codes Gemma 3's five local : one global layers
_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's `rope_freq_base_train_swa` for Gemma 3


def _query_scalar(h: Hparams, config: Mapping[str, Any]) -> int:
    """An int, as Hugging Face's Gemma configs (transformers validates the type)."""
    if config["num_hidden_layers"] == _LAYERS_27B[h.arch]:
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    return int(config["head_dim"])


def gemma2_config(h: Hparams, weights: Mapping[str, mx.array]) -> dict[str, Any]:
    config = attention_config(h, weights, "gemma2")
    config.update(
        {
            "architectures": ["Gemma2ForCausalLM"],
            "rope_traditional": False,
            "attn_logit_softcapping": h.get_float("attn_logit_softcapping", 50.0),
            "final_logit_softcapping": h.get_float("final_logit_softcapping", 30.0),
            "query_pre_attn_scalar": _query_scalar(h, config),
        }
    )
    # mlx-lm's gemma2 class attends globally on every layer: equal to the 4096-token
    # windows of Gemma 2's local layers up to that length.
    if window := h.get_int("attention.sliding_window"):
        config["sliding_window"] = window
    return config


def _swa_pattern(h: Hparams) -> int:
    raw = h.meta.get(f"{h.arch}.attention.sliding_window_pattern")
    if raw is None:
        return _DEFAULT_SWA_PATTERN
    if isinstance(raw, list):  # per layer: True = sliding
        period = next((i + 1 for i, sliding in enumerate(raw) if not sliding), len(raw) + 1)
        if any(bool(s) != ((i + 1) % period != 0) for i, s in enumerate(raw)):
            raise ModelLoadError(f"{h.path}: irregular sliding-window layer pattern {raw}")
        return period
    return int(raw)


def gemma3_config(h: Hparams, weights: Mapping[str, mx.array]) -> dict[str, Any]:
    config = attention_config(h, weights, "gemma3_text")
    config.update(
        {
            "architectures": ["Gemma3ForCausalLM"],
            "query_pre_attn_scalar": _query_scalar(h, config),
            "sliding_window": h.get_int("attention.sliding_window", 512),
            "sliding_window_pattern": _swa_pattern(h),
            # Ollama's own converter names the two bases `rope.global/local.freq_base`.
            "rope_theta": h.get_float("rope.freq_base")
            or h.get_float("rope.global.freq_base", 1_000_000.0),
            "rope_local_base_freq": h.get_float("rope.local.freq_base", _LOCAL_ROPE_BASE),
        }
    )
    if (scaling := linear_rope_scaling(h)) is not None:
        config["rope_scaling"] = scaling  # global layers only, as in llama.cpp
    return config


def undo_norm_shift(weights: Weights, config: Mapping[str, Any]) -> Weights:
    """Every RMSNorm weight back to Gemma's `1 + w` form (llama.cpp stored `w + 1`)."""
    for name in list(weights):
        if name.endswith("norm.weight"):
            weights[name] = weights[name] - 1
    return drop_tied_head(weights, config)


_GEMMA_LAYER_NAMES = {
    **LLAMA_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

GEMMA2 = Family("gemma2", gemma2_config, _GEMMA_LAYER_NAMES, undo_norm_shift)
GEMMA3 = Family(
    "gemma3",
    gemma3_config,
    {**_GEMMA_LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    undo_norm_shift,
)
