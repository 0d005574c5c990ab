"""Tiny random checkpoints of the families that ship MTP weights (#45), with those weights
under their real names and shapes, in Hugging Face's layout (experts one by one,
DeepSeek's `kv_b_proj`, Qwen3-Next's zero-centred norms) or, quantized, as mlx-lm's
converter lays out the model's own layers.

Names as the checkpoints have them (vllm `deepseek_mtp.py`, `glm4_moe_mtp.py`,
`mimo_mtp.py`, `qwen3_next_mtp.py`); the tensors come from a source module built here with
mlx-lm's own decoder-layer classes, which the test keeps to compose the reference step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from tests.tiny_models import FAMILY_CONFIGS, write_model_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

# The MTP families' tiny configs: FAMILY_CONFIGS' (tests/tiny_models.py) plus the MTP count.
QWEN_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")

MIMO_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


# Qwen3.5-MoE (Qwen3.6's 35B-A3B shape): Qwen3.5's hybrid layers with sparse MoE blocks.
QWEN3_5_MOE_CONFIG: dict[str, Any] = {
    **FAMILY_CONFIGS["qwen3_5"],
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
}
EXTRA_CONFIGS = {"mimo": MIMO_CONFIG, "qwen3_5_moe": QWEN3_5_MOE_CONFIG}


def text_args(model_type: str, config: dict[str, Any]) -> Any:
    """The mlx-lm args the decoder layers take (Qwen3.5's text args)."""
    import importlib

    if model_type in ("qwen3_5", "qwen3_5_moe"):
        from mlx_lm.models import qwen3_5

        return qwen3_5.TextModelArgs.from_dict(config)
    module: Any = importlib.import_module(f"mlx_lm.models.{model_type}")
    return module.ModelArgs.from_dict(config)


@dataclass
class Source:
    """What a tiny MTP checkpoint was written from, for the reference step."""

    model: Any  # the main mlx-lm model
    block: nn.Module  # the MTP decoder layer (mlx-lm's class of the family, dense weights)
    own: dict[str, mx.array]  # the MTP norms and projection, checkpoint names sans prefix
    prefix: str
    written: dict[str, mx.array]  # every MTP tensor written, full checkpoint names


def _block(model_type: str, args: Any) -> nn.Module:
    import importlib

    module: Any = importlib.import_module(f"mlx_lm.models.{model_type}")
    if model_type == "deepseek_v3":
        return module.DeepseekV3DecoderLayer(args, args.num_hidden_layers)
    if model_type == "glm4_moe":
        return module.DecoderLayer(args, args.num_hidden_layers)
    if model_type == "mimo":
        return module.TransformerBlock(args)
    if model_type == "qwen3_next":
        return module.Qwen3NextDecoderLayer(args, args.full_attention_interval - 1)
    from mlx_lm.models import qwen3_5

    return qwen3_5.DecoderLayer(args, args.full_attention_interval - 1)


OWN_NAMES = {
    "deepseek_v3": ("enorm", "hnorm", "eh_proj", "shared_head.norm"),
    "glm4_moe": ("enorm", "hnorm", "eh_proj", "shared_head.norm"),
    "mimo": ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"),
    **{t: ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm") for t in QWEN_TYPES},
}


def hf_block_tensors(model_type: str, block: nn.Module, args: Any) -> dict[str, mx.array]:
    """The block's tensors as Hugging Face names them: stacked experts split one by one,
    DeepSeek-V3's `embed_q`/`unembed_out` joined back into `kv_b_proj`, Qwen3-Next's norm
    weights zero-centred."""
    out: dict[str, mx.array] = {}
    flat = dict(tree_flatten(block.parameters()))
    for name, value in flat.items():
        if model_type == "qwen3_5_moe" and ".switch_mlp." in name:  # fused, gate then up
            stem, rest = name.split(".switch_mlp.")
            if rest == "down_proj.weight":
                out[f"{stem}.experts.down_proj"] = value
            elif rest == "gate_proj.weight":
                up = flat[f"{stem}.switch_mlp.up_proj.weight"]
                out[f"{stem}.experts.gate_up_proj"] = mx.concatenate([value, up], axis=-2)
        elif ".switch_mlp." in name:
            stem, rest = name.split(".switch_mlp.")
            for e in range(value.shape[0]):
                out[f"{stem}.experts.{e}.{rest}"] = value[e]
        elif name == "self_attn.embed_q.weight":  # [heads, kv_lora_rank, nope]
            wk = value.swapaxes(-1, -2)  # [heads, nope, rank]
            wv = block.self_attn.unembed_out.weight  # [heads, v_head, rank]
            joined = mx.concatenate([wk, wv], axis=1)
            out["self_attn.kv_b_proj.weight"] = joined.reshape(-1, joined.shape[-1])
        elif name == "self_attn.unembed_out.weight":
            continue
        elif model_type in QWEN_TYPES and name.endswith("norm.weight"):
            out[name] = value - 1.0
        else:
            out[name] = value
    return out


def write_mtp_dir(
    out: Path,
    model_type: str,
    like: LoadedModel,
    *,
    seed: int = 0,
    bits: int | None = None,
    drop: tuple[str, ...] = (),
    mtp_layers: int = 1,
    overrides: dict[str, Any] | None = None,
) -> Source:
    """A tiny `model_type` checkpoint whose MTP layer is in `model-mtp.safetensors` (minus
    the tensors named in `drop`, full names); `mtp_layers` 0 writes none and says so in
    config.json. With `bits`, the model and the MTP layer's linear layers are quantized
    (group 32, mlx-lm's layout). `overrides`: changes to the family's tiny config."""
    saved = FAMILY_CONFIGS.get(model_type)
    # Only while writing: tests/python/test_families.py runs every FAMILY_CONFIGS as it is.
    FAMILY_CONFIGS[model_type] = {
        **(EXTRA_CONFIGS[model_type] if saved is None else saved),
        **(overrides or {}),
    }
    try:
        model = write_model_dir(out, model_type, like, seed=seed, bits=bits)
    finally:
        if saved is None:
            del FAMILY_CONFIGS[model_type]
        else:
            FAMILY_CONFIGS[model_type] = saved
    config = json.loads((out / "config.json").read_text())
    count_key = "mtp_num_hidden_layers" if model_type in QWEN_TYPES else "num_nextn_predict_layers"
    config[count_key] = mtp_layers
    (out / "config.json").write_text(json.dumps(config))
    if not mtp_layers:
        return Source(model, nn.Identity(), {}, "", {})
    args = text_args(model_type, config)
    mx.random.seed(seed + 1)
    block = _block(model_type, args)
    hidden = args.hidden_size
    embed_norm, hidden_norm, proj, out_norm = OWN_NAMES[model_type]
    own = {
        f"{embed_norm}.weight": 1.0 + 0.1 * mx.random.normal((hidden,)),
        f"{hidden_norm}.weight": 1.0 + 0.1 * mx.random.normal((hidden,)),
        f"{proj}.weight": mx.random.normal((hidden, 2 * hidden)) * (2 * hidden) ** -0.5,
        f"{out_norm}.weight": 1.0 + 0.1 * mx.random.normal((hidden,)),
    }
    # Random norm weights: a norm loaded from the wrong tensor changes the result.
    for name, value in tree_flatten(block.parameters()):
        if name.endswith("norm.weight"):
            block.update(_nested(name, 1.0 + 0.1 * mx.random.normal(value.shape)))
    mx.eval(block.parameters(), *own.values())
    if model_type in QWEN_TYPES:
        prefix, block_prefix = "mtp.", "mtp.layers.0."
        zero_centred = {k: v - 1.0 for k, v in own.items() if "norm" in k}
        own_written = {**own, **zero_centred}
    else:
        prefix = (
            "model.mtp_layers.0."
            if model_type == "mimo"
            else f"model.layers.{args.num_hidden_layers}."
        )
        block_prefix = prefix
        own_written = dict(own)
    if bits is None:
        block_written = hf_block_tensors(model_type, block, args)
    else:  # as mlx-lm's converter writes a model's own layers: sanitized, then quantized
        quantized = _quantized_copy(block, bits)
        block_written = dict(tree_flatten(quantized.parameters()))
        q, scales, biases = mx.quantize(own_written[f"{proj}.weight"], group_size=32, bits=bits)
        own_written[f"{proj}.weight"] = q
        own_written[f"{proj}.scales"], own_written[f"{proj}.biases"] = scales, biases
        # The reference uses what the checkpoint holds: the dequantized weights.
        own[f"{proj}.weight"] = mx.dequantize(q, scales, biases, group_size=32, bits=bits)
        block = _dequantized(quantized)
    written = {prefix + k: v for k, v in own_written.items()}
    written.update({block_prefix + k: v for k, v in block_written.items()})
    if model_type in ("deepseek_v3", "glm4_moe"):  # the checkpoints' copies of shared tensors
        written[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight
        written[prefix + "shared_head.head.weight"] = model.lm_head.weight
    kept = {k: v for k, v in written.items() if k not in drop}
    mx.save_safetensors(str(out / "model-mtp.safetensors"), kept)
    return Source(model, block, own, prefix, written)


def _nested(dotted: str, value: mx.array) -> dict[str, Any]:
    from mlx.utils import tree_unflatten

    return dict(tree_unflatten([(dotted, value)]))


def _quantized_copy(block: nn.Module, bits: int) -> nn.Module:
    import copy

    quantized = copy.deepcopy(block)
    nn.quantize(
        quantized,
        group_size=32,
        bits=bits,
        class_predicate=lambda _p, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0,
    )
    mx.eval(quantized.parameters())
    return quantized


def _dequantized(block: nn.Module) -> nn.Module:
    from mlx_lm.utils import dequantize_model

    dense: nn.Module = dequantize_model(block)
    mx.eval(dense.parameters())
    return dense
