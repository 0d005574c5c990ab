"""What every GGUF family shares: typed hyper-parameters, the rename machinery, the
attention config most families start from, and llama.cpp's Q/K row permutation."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.gguf_metadata import GGUFMetadata

__all__ = [
    "Family",
    "Hparams",
    "attention_config",
    "permute_rows",
    "rename_tensors",
    "unpermute_rows",
]

logger = logging.getLogger(__name__)

Weights = dict[str, mx.array]
# mx.load names: `.weight` (dense or packed), `.scales`/`.biases` (quantization), `.bias`.
# llama.cpp's MTP tensors carry one more dot: `blk.N.nextn.eh_proj.weight`.
_TENSOR_RE = re.compile(r"^(?:blk\.(\d+)\.)?((?:nextn\.)?[a-z_]+)\.(weight|scales|biases|bias)$")
_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Ollama's single-file multimodal GGUFs (Gemma 3, Mistral 3...) carry the vision tower
# (`v.`), its projector (`mm.`) and audio (`a.`) beside the text model.
_OTHER_TOWERS = ("v.", "mm.", "a.")
# Tensors llama.cpp keeps for its own rope; the family's config already says the same.
ROPE_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")


class Hparams:
    """`{arch}.*` metadata of one GGUF, typed."""

    def __init__(self, meta: GGUFMetadata) -> None:
        self.meta = meta
        self.arch = meta.architecture
        self.path = meta.path

    def get_int(self, key: str, default: int | None = None) -> int | None:
        return self.meta.get_int(f"{self.arch}.{key}", default)

    def need(self, key: str) -> int:
        return self.meta.require_int(f"{self.arch}.{key}")

    def get_float(self, key: str, default: float | None = None) -> float | None:
        return self.meta.get_float(f"{self.arch}.{key}", default)

    def get_str(self, key: str) -> str | None:
        return self.meta.get_str(f"{self.arch}.{key}")

    def per_layer(self, key: str, default: int) -> int:
        """A value llama.cpp may store per layer; one value is all mlx-lm's classes take."""
        values = self.meta.get_int_list(f"{self.arch}.{key}")
        if not values:
            return default
        if len(set(values)) != 1:
            raise ModelLoadError(f"{self.path}: per-layer {self.arch}.{key} is not supported")
        return values[0]


@dataclass(frozen=True)
class Family:
    """One GGUF architecture: its config, its per-layer tensor names, its fix-ups.

    `layer_names` maps llama.cpp's per-layer base names (`attn_q`) to mlx-lm's module paths
    under `model.layers.N.`; `fixup` runs on the renamed weights (un-permute rows, undo
    +1 norms, split or join tensors) with the config `config` built. The config sees the
    tensors under llama.cpp's names (some settings live in tensors: Phi-3's LongRoPE).
    """

    architecture: str
    config: Callable[[Hparams, Mapping[str, mx.array]], dict[str, Any]]
    layer_names: Mapping[str, str]
    fixup: Callable[[Weights, Mapping[str, Any]], Weights] = field(default=lambda w, _c: w)
    top_names: Mapping[str, str] = field(default_factory=lambda: dict(_TOP_LEVEL))
    # Llama 3.1-style per-frequency rope factors (`rope_freqs`), applied by models/gguf.py.
    takes_rope_freqs: bool = False


def attention_config(
    h: Hparams, weights: Mapping[str, mx.array], model_type: str
) -> dict[str, Any]:
    """The keys a llama-like config shares, from `{arch}.*` metadata."""
    hidden = h.need("embedding_length")
    heads = h.per_layer("attention.head_count", 0)
    if heads <= 0:
        raise ModelLoadError(f"{h.path}: GGUF metadata has no {h.arch}.attention.head_count")
    embed = weights.get("token_embd.weight")
    tokens = h.meta.get_str_list("tokenizer.ggml.tokens") or []
    vocab = h.get_int("vocab_size") or (int(embed.shape[0]) if embed is not None else len(tokens))
    config: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": h.need("block_count"),
        "intermediate_size": h.per_layer("feed_forward_length", 0),
        "num_attention_heads": heads,
        "num_key_value_heads": h.per_layer("attention.head_count_kv", heads),
        "head_dim": h.get_int("attention.key_length") or hidden // heads,
        "rms_norm_eps": h.get_float("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": h.get_float("rope.freq_base", 10000.0),
        "max_position_embeddings": h.get_int("context_length", 4096),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in weights,
    }
    for key, name in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
    ):
        if (tid := h.meta.get_int(key)) is not None:
            config[name] = tid
    return config


def linear_rope_scaling(h: Hparams) -> dict[str, Any] | None:
    """`rope_scaling` for linear scaling; other kinds are logged as not reproduced."""
    kind = h.get_str("rope.scaling.type")
    factor = h.get_float("rope.scaling.factor")
    if kind == "linear" and factor and factor != 1.0:
        return {"type": "linear", "factor": factor}
    if kind not in (None, "none", "linear"):
        logger.warning(
            "%s: rope scaling %r is not reproduced; quality may drop past %s tokens",
            h.path,
            kind,
            h.get_int("rope.scaling.original_context_length"),
        )
    return None


def rename_tensors(
    family: Family, weights: Mapping[str, mx.array]
) -> tuple[Weights, dict[str, mx.array]]:
    """llama.cpp names -> mlx-lm names; returns (renamed, rope tensors by base name)."""
    out: Weights = {}
    rope: dict[str, mx.array] = {}
    skipped = [name for name in weights if name.startswith(_OTHER_TOWERS)]
    if skipped:
        logger.info("ignoring %d vision/audio tensors (text model only)", len(skipped))
    for name, tensor in weights.items():
        if name.startswith(_OTHER_TOWERS):
            continue
        m = _TENSOR_RE.match(name)
        if m is None:
            raise ModelLoadError(f"unexpected tensor {name!r} in a {family.architecture} GGUF")
        layer, base, suffix = m.group(1), m.group(2), m.group(3)
        if layer is None and base in ROPE_TENSORS:
            rope[base] = tensor
            continue
        if layer is None:
            target = family.top_names.get(base)
        else:
            mapped = family.layer_names.get(base)
            target = None if mapped is None else f"model.layers.{layer}.{mapped}"
        if target is None:
            raise ModelLoadError(
                f"unsupported tensor {name!r} in a {family.architecture} GGUF "
                "(written by a newer llama.cpp than this loader knows?)"
            )
        out[f"{target}.{suffix}"] = tensor
    return out, rope


def unpermute_rows(x: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's per-head Q/K row permutation (works on packed rows, scales, biases).

    llama.cpp's converter reorders the rows of `attn_q`/`attn_k` inside every head
    (`reshape(n_head, 2, head_dim/2, ...).swapaxes(1, 2)`) so its rope can rotate adjacent
    pairs. Undoing it is a pure row permutation (exact, and valid for quantized rows since
    quantization groups run along the input dimension) and gives the Hugging Face layout, so
    the stock mlx-lm class runs with the stock rope."""
    rows = int(x.shape[0])
    if rows % (2 * n_head):
        raise ModelLoadError(f"cannot un-permute {rows} rows into {n_head} heads")
    rest = tuple(int(d) for d in x.shape[1:])
    return x.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(x.shape)


def permute_rows(x: mx.array, n_head: int) -> mx.array:
    """llama.cpp's permutation (`convert_hf_to_gguf.py`; the inverse of `unpermute_rows`)."""
    rows = int(x.shape[0])
    rest = tuple(int(d) for d in x.shape[1:])
    return x.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(x.shape)


def unpermute_qk(weights: Weights, config: Mapping[str, Any]) -> Weights:
    """Un-permute every q_proj/k_proj tensor (weight, scales, biases, bias)."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config["num_key_value_heads"])
    for name in list(weights):
        if ".self_attn.q_proj." in name:
            weights[name] = unpermute_rows(weights[name], heads)
        elif ".self_attn.k_proj." in name:
            weights[name] = unpermute_rows(weights[name], kv_heads)
    return weights


def drop_tied_head(weights: Weights, config: Mapping[str, Any]) -> Weights:
    if config.get("tie_word_embeddings"):
        for suffix in ("weight", "scales", "biases"):
            weights.pop(f"lm_head.{suffix}", None)
    return weights


# The llama layout most families extend.
LLAMA_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# DeepSeek-style mixture of experts (mlx-lm's `switch_mlp` and `shared_experts`, a gate
# with a score-correction bias), as deepseek2 and glm4moe files name its tensors.
DEEPSEEK_MOE_NAMES: dict[str, str] = {
    "ffn_gate_inp": "mlp.gate",
    "exp_probs_b": "mlp.gate.e_score_correction",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
