"""Tiny random models of mlx-lm classes written twice: as an mlx-lm safetensors directory (the
reference) and as a GGUF laid out the way llama.cpp's `convert_hf_to_gguf.py` writes that
family, with the `gguf` package (its `TensorNameMap` names, its quantizers).

What the converter does, mirrored here per family (and undone by models/gguf_families/):
llama and Mixtral permute the Q/K rows per head; Gemma adds 1 to every RMSNorm weight;
experts are stacked (`ffn_*_exps`, [expert, out, in]); DeepSeek's `kv_b_proj` is written as
`attn_k_b` (per head, transposed) and `attn_v_b` (newer llama.cpp, with the MLA head sizes in
`key_length_mla`/`value_length_mla` and one KV head) or whole (older). llama-quantize keeps
1-D tensors, the MoE router and rows its block size does not divide in F32.

Quantized files: the reference directory holds the weights the `gguf` package dequantizes
from that quantization (quantize -> dequantize along the same rows), so a loader that reads
the file right gives the directory's logits up to float rounding.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
from gguf.quants import dequantize, quantize

from tests.tiny_models import FAMILY_CONFIGS, SLIDING_WINDOW

Q = gguf.GGMLQuantizationType
_ATTENTION = {
    "hidden_size": 64,
    "rms_norm_eps": 1e-5,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class GGUFCase:
    """One family: the mlx-lm class and config, and how llama.cpp writes it."""

    model_type: str
    config: dict[str, Any]
    arch: gguf.MODEL_ARCH
    hparams: Callable[[gguf.GGUFWriter, dict[str, Any]], None]
    options: dict[str, Any] = field(default_factory=dict)


def attention_hparams(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c.get("num_key_value_heads") or c["num_attention_heads"])
    w.add_layer_norm_rms_eps(c.get("rms_norm_eps", 1e-6))
    if c.get("ollama"):  # Ollama's own Gemma 3 converter: two named bases
        w.add_float32(f"{w.arch}.rope.global.freq_base", c["rope_theta"])
        w.add_float32(f"{w.arch}.rope.local.freq_base", c["rope_local_base_freq"])
    else:
        w.add_rope_freq_base(c.get("rope_theta", 10000.0))
    if c.get("head_dim"):
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])


def _llama(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    attention_hparams(w, c)
    w.add_rope_dimension_count(c["hidden_size"] // c["num_attention_heads"])
    if c.get("sliding_window"):
        w.add_sliding_window(c["sliding_window"])
    if "num_local_experts" in c:
        w.add_expert_count(c["num_local_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])


def _qwen3moe(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    attention_hparams(w, c)
    w.add_expert_count(c["num_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])


def _phi3(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    attention_hparams(w, c)
    w.add_rope_dimension_count(c["hidden_size"] // c["num_attention_heads"])
    w.add_rope_scaling_orig_ctx_len(c["original_max_position_embeddings"])


def _gemma(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    attention_hparams(w, c)
    if "attn_logit_softcapping" in c:  # gemma2
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
        w.add_sliding_window(4096)
    else:  # gemma3: llama.cpp hard-codes a pattern of 6; a 2-layer model states its own
        w.add_sliding_window(c["sliding_window"])
        n = c["num_hidden_layers"]
        w.add_sliding_window_pattern([(i + 1) % c["sliding_window_pattern"] != 0 for i in range(n)])


def _deepseek2(
    w: gguf.GGUFWriter, c: dict[str, Any], *, split_kv_b: bool, sigmoid: bool = True
) -> None:
    attention_hparams(w, {**c, "rms_norm_eps": c.get("rms_norm_eps", 1e-6)})
    rope, nope, v = c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
    if split_kv_b:  # llama.cpp's MLA layout: the absorbed cache as one KV head
        w.add_head_count_kv(1)
        w.add_key_length(c["kv_lora_rank"] + rope)
        w.add_value_length(c["kv_lora_rank"])
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
    else:
        w.add_key_length(nope + rope)
        w.add_value_length(v)
    w.add_rope_dimension_count(rope)
    w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(c["kv_lora_rank"])
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_shared_count(c["n_shared_experts"])
    if scaling := c.get("rope_scaling"):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])
    w.add_expert_weights_scale(1.0)
    w.add_expert_weights_norm(sigmoid)  # V3 renormalises its top-k, V2 does not
    func = gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX
    w.add_expert_gating_func(func)


def glm4moe_hparams(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    """`Glm4MoeModel.set_gguf_parameters` (and its base class's keys): `block_count` counts
    the MTP layers, `nextn_predict_layers` written when the config has the key."""
    nextn = c.get("num_nextn_predict_layers")
    attention_hparams(w, {**c, "num_hidden_layers": c["num_hidden_layers"] + (nextn or 0)})
    w.add_rope_dimension_count(int(c["head_dim"] * c.get("partial_rotary_factor", 0.5)))
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    w.add_expert_weights_norm(c["norm_topk_prob"])
    if nextn is not None:
        w.add_nextn_predict_layers(nextn)


# The head_dim-less families get hidden/heads = 16; gemma2's query scale is head_dim's, as
# llama.cpp uses for every size but 27B.
CASES: dict[str, GGUFCase] = {
    "qwen2": GGUFCase(
        "qwen2", {**_ATTENTION, "rms_norm_eps": 1e-6}, gguf.MODEL_ARCH.QWEN2, attention_hparams
    ),
    "qwen3": GGUFCase("qwen3", FAMILY_CONFIGS["qwen3"], gguf.MODEL_ARCH.QWEN3, attention_hparams),
    "mistral": GGUFCase(
        "llama",
        # mlx-lm (like llama.cpp's llama graph) runs Mistral's window as full attention.
        {**_ATTENTION, "sliding_window": SLIDING_WINDOW},
        gguf.MODEL_ARCH.LLAMA,
        _llama,
    ),
    "phi3": GGUFCase(
        "phi3",
        {**_ATTENTION, "rms_norm_eps": 1e-5, "original_max_position_embeddings": 4096},
        gguf.MODEL_ARCH.PHI3,
        _phi3,
    ),
    # Phi-3-128k's LongRoPE: per-frequency factors as `rope_factors_long/short` tensors.
    "phi3-longrope": GGUFCase(
        "phi3",
        {
            **_ATTENTION,
            "rms_norm_eps": 1e-5,
            "original_max_position_embeddings": 1024,
            "rope_scaling": {
                "type": "longrope",
                "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0],
                "short_factor": [1.0, 1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0],
            },
        },
        gguf.MODEL_ARCH.PHI3,
        _phi3,
    ),
    "gemma2": GGUFCase(
        "gemma2",
        {
            **_ATTENTION,
            "head_dim": 16,
            "rms_norm_eps": 1e-6,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 16,
        },
        gguf.MODEL_ARCH.GEMMA2,
        _gemma,
    ),
    "gemma3": GGUFCase(
        "gemma3_text", FAMILY_CONFIGS["gemma3_text"], gguf.MODEL_ARCH.GEMMA3, _gemma
    ),
    "qwen3moe": GGUFCase(
        "qwen3_moe", FAMILY_CONFIGS["qwen3_moe"], gguf.MODEL_ARCH.QWEN3MOE, _qwen3moe
    ),
    "mixtral": GGUFCase(
        "mixtral",
        {**_ATTENTION, "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
        gguf.MODEL_ARCH.LLAMA,
        _llama,
    ),
    "deepseek2": GGUFCase(
        "deepseek_v3",
        FAMILY_CONFIGS["deepseek_v3"],
        gguf.MODEL_ARCH.DEEPSEEK2,
        lambda w, c: _deepseek2(w, c, split_kv_b=True),
        {"split_kv_b": True},
    ),
    # DeepSeek-V2 (softmax router, no correction bias): mlx-lm's deepseek_v2 class, joined
    # kv_b_proj; written the newer converter's way (k_b/v_b).
    "deepseek2-v2": GGUFCase(
        "deepseek_v2",
        {
            **FAMILY_CONFIGS["deepseek_v3"],
            # V2's YaRN (DeepSeek-V2-Lite's values, a shorter original context)
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 1024,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
        },
        gguf.MODEL_ARCH.DEEPSEEK2,
        lambda w, c: _deepseek2(w, c, split_kv_b=True, sigmoid=False),
        {"split_kv_b": True},
    ),
    # GLM-4.5 with q/k norms and no q/k/v biases (the tiny family config); GLM-4.5's own
    # attention (biases, no norms) is tests/tiny_gguf_nextn.py's, with its MTP layer.
    "glm4moe": GGUFCase(
        "glm4_moe", FAMILY_CONFIGS["glm4_moe"], gguf.MODEL_ARCH.GLM4_MOE, glm4moe_hparams
    ),
    "deepseek2-kv_b": GGUFCase(
        "deepseek_v3",
        FAMILY_CONFIGS["deepseek_v3"],
        gguf.MODEL_ARCH.DEEPSEEK2,
        lambda w, c: _deepseek2(w, c, split_kv_b=False),
        {"split_kv_b": False},
    ),
}

QUANT_TYPES = {
    "F32": Q.F32,
    "F16": Q.F16,
    "BF16": Q.BF16,
    "Q8_0": Q.Q8_0,
    "Q4_0": Q.Q4_0,
    "Q4_1": Q.Q4_1,
}


def random_model(case: GGUFCase, vocab_size: int, seed: int = 0) -> tuple[Any, dict[str, Any]]:
    """The mlx-lm model of `case`, with every 1-D parameter (norms, biases, the router's
    correction bias) random too, so a mix-up between two of them shows in the logits."""
    module = importlib.import_module(f"mlx_lm.models.{case.model_type}")
    config = {"model_type": case.model_type, "vocab_size": vocab_size, **case.config}
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    from mlx.utils import tree_flatten, tree_unflatten

    flat = tree_flatten(model.parameters())
    model.update(
        tree_unflatten(
            [(k, mx.random.uniform(0.5, 1.5, v.shape) if v.ndim == 1 else v) for k, v in flat]
        )
    )
    mx.eval(model.parameters())
    # The class's defaults too: the GGUF's metadata states every value the model runs with.
    return model, {**dataclasses.asdict(model.args), **config}


def quantizable(gguf_name: str, array: np.ndarray, qtype: Q) -> bool:
    """llama-quantize's rule: 2-D+ weights whose rows its block size divides, not the router."""
    if qtype in (Q.F32,) or array.ndim < 2 or not gguf_name.endswith(".weight"):
        return False
    if "ffn_gate_inp" in gguf_name:
        return False
    return qtype == Q.F16 or array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0


def _hf_name(case: GGUFCase, name: str) -> str:
    """mlx-lm's name as the converter sees it: stacked experts under their merged names."""
    if case.model_type == "mixtral":
        for mlx, hf in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3")):
            name = name.replace(f"switch_mlp.{mlx}", f"experts.{hf}")
    name = name.replace("switch_mlp.", "experts.")
    return name.replace(".e_score_correction_bias", ".e_score_correction.bias")


def _converted(
    case: GGUFCase, gguf_name: str, value: np.ndarray, config: dict[str, Any]
) -> np.ndarray:
    """One tensor as the family's converter stores it."""
    if case.arch == gguf.MODEL_ARCH.LLAMA and gguf_name.endswith(
        ("attn_q.weight", "attn_k.weight")
    ):
        heads = config["num_attention_heads"]
        if gguf_name.endswith("attn_k.weight"):
            heads = config["num_key_value_heads"]
        rows, rest = value.shape[0], value.shape[1:]
        permuted = value.reshape(heads, 2, rows // heads // 2, *rest).swapaxes(1, 2)
        return permuted.reshape(value.shape)
    gemma = case.arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3)
    if gemma and gguf_name.endswith("norm.weight"):
        return value + 1
    return value


def _gguf_tensors(
    case: GGUFCase, weights: dict[str, np.ndarray], config: dict[str, Any]
) -> dict[str, np.ndarray]:
    """mlx-lm names -> llama.cpp's names and layout (the converter's transforms)."""
    names = gguf.get_tensor_name_map(case.arch, config["num_hidden_layers"])
    out: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        if ".embed_q." in name or ".unembed_out." in name:
            continue  # written below from the pair
        hf = _hf_name(case, name)
        gguf_name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"no llama.cpp name for {hf}"
        out[gguf_name] = _converted(case, gguf_name, value, config)
    if case.arch == gguf.MODEL_ARCH.DEEPSEEK2:
        for layer in range(config["num_hidden_layers"]):
            p = f"model.layers.{layer}.self_attn"
            if f"{p}.embed_q.weight" not in weights:
                continue
            k_b, v_b = weights[f"{p}.embed_q.weight"], weights[f"{p}.unembed_out.weight"]
            if case.options["split_kv_b"]:
                out[f"blk.{layer}.attn_k_b.weight"] = k_b
                out[f"blk.{layer}.attn_v_b.weight"] = v_b
            else:
                kv_b = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)
                out[f"blk.{layer}.attn_kv_b.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
    return out


def _mla_split(weights: dict[str, np.ndarray], config: dict[str, Any]) -> dict[str, np.ndarray]:
    """deepseek_v2's joined kv_b_proj as deepseek_v3's embed_q/unembed_out (per head, the
    k part transposed), so one writer serves both classes."""
    heads, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
    out: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        if not name.endswith(".kv_b_proj.weight"):
            out[name] = value
            continue
        p = name.removesuffix(".kv_b_proj.weight")
        kv_b = value.reshape(heads, -1, value.shape[-1])
        out[f"{p}.embed_q.weight"] = np.ascontiguousarray(kv_b[:, :nope].swapaxes(1, 2))
        out[f"{p}.unembed_out.weight"] = np.ascontiguousarray(kv_b[:, nope:])
    return out


def _mla_join(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of `_mla_split`."""
    out = {k: v for k, v in weights.items() if ".embed_q." not in k and ".unembed_out." not in k}
    for name, k_b in weights.items():
        if name.endswith(".embed_q.weight"):
            p = name.removesuffix(".embed_q.weight")
            v_b = weights[f"{p}.unembed_out.weight"]
            kv_b = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)
            out[f"{p}.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
    return out


def _round_trip(value: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F16:
        return value.astype(np.float16).astype(np.float32)
    return dequantize(quantize(value.astype(np.float32), qtype), qtype).astype(np.float32)


def _round_tripped(
    case: GGUFCase,
    weights: dict[str, np.ndarray],
    tensors: dict[str, np.ndarray],
    types: dict[str, Q],
    config: dict[str, Any],
) -> dict[str, np.ndarray]:
    """The mlx-lm weights whose GGUF tensor is quantized, as that quantization keeps them."""
    out: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        if ".embed_q." in name or ".unembed_out." in name:
            continue
        (gguf_name,) = _gguf_tensors(case, {name: value}, config)
        if types[gguf_name] != Q.F32:
            out[name] = _round_trip(value, types[gguf_name])
    if case.arch != gguf.MODEL_ARCH.DEEPSEEK2:
        return out
    heads, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
    for layer in range(config["num_hidden_layers"]):
        p, b = f"model.layers.{layer}.self_attn", f"blk.{layer}"
        if case.options["split_kv_b"]:
            for name, gguf_name in (
                (f"{p}.embed_q.weight", f"{b}.attn_k_b.weight"),
                (f"{p}.unembed_out.weight", f"{b}.attn_v_b.weight"),
            ):
                if types[gguf_name] != Q.F32:
                    out[name] = _round_trip(weights[name], types[gguf_name])
        elif types[f"{b}.attn_kv_b.weight"] != Q.F32:
            kv_b = _round_trip(tensors[f"{b}.attn_kv_b.weight"], types[f"{b}.attn_kv_b.weight"])
            kv_b = kv_b.reshape(heads, -1, kv_b.shape[-1])
            out[f"{p}.embed_q.weight"] = np.ascontiguousarray(kv_b[:, :nope].swapaxes(1, 2))
            out[f"{p}.unembed_out.weight"] = np.ascontiguousarray(kv_b[:, nope:])
    return out


def write_case(
    out: Path,
    case_name: str,
    qtype_name: str,
    tokenizer_fields: dict[str, Field],
    *,
    seed: int = 0,
    ollama: bool = False,
    overrides: dict[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write `case_name` as `out/ref/` (mlx-lm directory) and `out/model.<qtype>.gguf`;
    returns (directory, gguf path). `ollama`: as Ollama's single-file multimodal GGUFs,
    with a vision tower's tensors and its named rope bases. `overrides`: config changes."""
    from mlx_lm.utils import save_config, save_model

    case = CASES[case_name]
    if overrides:
        case = dataclasses.replace(case, config={**case.config, **overrides})
    qtype = QUANT_TYPES[qtype_name]
    vocab = len(tokenizer_fields["tokenizer.ggml.tokens"][0])
    model, config = random_model(case, vocab, seed)
    from mlx.utils import tree_flatten

    weights = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}
    if case.model_type == "deepseek_v2":
        weights = _mla_split(weights, config)
    tensors = _gguf_tensors(case, weights, config)
    if (scaling := config.get("rope_scaling")) and scaling["type"] == "longrope":
        for kind in ("long", "short"):  # the converter's extra tensors (float32)
            tensors[f"rope_factors_{kind}.weight"] = np.array(scaling[f"{kind}_factor"], np.float32)
    types = {name: qtype if quantizable(name, v, qtype) else Q.F32 for name, v in tensors.items()}
    if qtype != Q.F32:
        # Give the reference the weights this quantization keeps: quantize -> dequantize in
        # llama.cpp's layout, then back to mlx-lm's (the transforms only move rows, except
        # DeepSeek's kv_b, which is split back).
        weights.update(_round_tripped(case, weights, tensors, types, config))
        joined = _mla_join(weights) if case.model_type == "deepseek_v2" else weights
        model.load_weights([(k, mx.array(v)) for k, v in joined.items()])
        tensors.update(_gguf_tensors(case, weights, config))
    ref = out / "ref"
    ref.mkdir(parents=True, exist_ok=True)
    save_model(ref, model)
    save_config(dict(config), ref / "config.json")

    path = out / f"model.{qtype_name}.gguf"
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[case.arch])
    writer.add_name(f"tiny-{case_name}")
    writer.add_vocab_size(vocab)
    case.hparams(writer, {**config, "ollama": ollama})
    add_tokenizer(writer, tokenizer_fields)
    if ollama:
        tensors["v.blk.0.attn_q.weight"] = np.ones((32, 32), np.float32)
        tensors["mm.input_projection.weight"] = np.ones((32, 64), np.float32)
        types.update(dict.fromkeys(("v.blk.0.attn_q.weight", "mm.input_projection.weight"), Q.F32))
    for name, value in tensors.items():
        t = types[name]
        if t == Q.F32:
            writer.add_tensor(name, value.astype(np.float32))
        elif t == Q.F16:
            writer.add_tensor(name, value.astype(np.float16))
        else:
            packed = quantize(value.astype(np.float32), t)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return ref, path


Field = tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def small_tokenizer_fields() -> dict[str, Field]:
    """A 262-token byte-level BPE (SmolLM2's pre-tokenizer): the logits tests need a
    vocabulary, not the embedded model's 49k tokens, whose embedding and header would make
    every file ~10x slower to write and read."""
    from compat_serve.models.gguf_tokenizer import bytes_to_unicode

    v = gguf.GGUFValueType
    tokens = [*CONTROL, *bytes_to_unicode().values(), "Ġt", "he", "Ġthe"]
    return {
        "tokenizer.ggml.model": ("gpt2", v.STRING, None),
        "tokenizer.ggml.pre": ("smollm", v.STRING, None),
        "tokenizer.ggml.tokens": (tokens, v.ARRAY, v.STRING),
        "tokenizer.ggml.merges": (["Ġ t", "h e", "Ġt he"], v.ARRAY, v.STRING),
        "tokenizer.ggml.token_type": ([3 if t in CONTROL else 1 for t in tokens], v.ARRAY, v.INT32),
        "tokenizer.ggml.bos_token_id": (1, v.UINT32, None),
        "tokenizer.ggml.eos_token_id": (2, v.UINT32, None),
        "tokenizer.chat_template": (CHATML, v.STRING, None),
    }


def tokenizer_fields(gguf_file: str) -> dict[str, Field]:
    """A GGUF's `tokenizer.*` metadata (the embedded model's, for tests that chat)."""
    reader = gguf.GGUFReader(gguf_file)
    out: dict[str, Field] = {}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            out[key] = (f.contents(), f.types[0], sub)
    return out


def add_tokenizer(writer: gguf.GGUFWriter, fields: dict[str, Field]) -> None:
    for key, (value, vtype, sub) in fields.items():
        writer.add_key_value(key, value, vtype, sub_type=sub)
