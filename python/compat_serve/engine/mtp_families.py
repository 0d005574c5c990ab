"""The MTP heads that checkpoints ship: DeepSeek-V3/R1, GLM-4.5/4.6/4.7, MiMo, Qwen3-Next,
Qwen3.5/3.6.

Each family's MTP module is built from the family's own mlx-lm decoder layer (MLA and MoE
for DeepSeek-V3, GLM-4.5's MoE layer, MiMo's Qwen2-style block, a full-attention MoE
Qwen3-Next or Qwen3.5 layer) plus the family's norms and projection, named as in its checkpoint, and
composed as vllm composes it (`deepseek_mtp.py`, `glm4_moe_mtp.py`, `mimo_mtp.py`,
`qwen3_next_mtp.py`): the embedding of the token and the main model's hidden state, each
normalized, joined by the projection, one decoder layer, a final norm, the main model's
vocabulary head. The embedding and the head are the main model's (shared: DeepSeek-V3's
report; the checkpoints' `embed_tokens`/`shared_head.head` copies are not read).

The tensors are read from the directory's safetensors files (mlx-lm's `sanitize` drops
them), or from a GGUF's `nextn` block (models/gguf_mtp.py: llama.cpp's names turned into the
checkpoint's, quantized ones in MLX's layout or dense as the main model was read), and go
through the handling the main weights got: the family's own `sanitize` (expert stacking,
DeepSeek's `kv_b_proj` split, fp8 dequantization), quantized layers built where `scales` are
present, then dequantized when the main model was (the CPU rule).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.normalization import RMSNorm
from mlx.nn.layers.quantized import QuantizedLinear, quantize

from compat_serve.engine.mtp_head import MTP_FAMILIES, MTPHead, MTPHeadError, run_block
from compat_serve.models.gguf_mtp import gguf_tensor_name, read_gguf_mtp_tensors
from compat_serve.models.mtp_weights import mtp_layer_count, mtp_prefix, read_mtp_tensors
from compat_serve.models.weights import cast_floating, dequantize_model, model_arrays

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel


@dataclass(frozen=True)
class Layout:
    """How a family names and composes its MTP module (names relative to its prefix)."""

    family: str
    embed_norm: str
    hidden_norm: str
    proj: str
    embedding_first: bool  # the projection's input: cat(embedding, hidden) or the reverse
    out_norm: str  # the norm before the vocabulary head (dotted)
    chain_normed: bool  # the hidden state for the next draft: after `out_norm` or before
    block: str  # where the decoder layer's tensors live: "" (beside the norms) or a path
    ignored: tuple[str, ...] = ()  # the checkpoint's copies of shared tensors


# DeepSeek-V3 (`DeepSeekMultiTokenPredictorLayer`) and GLM-4.5 (`Glm4MoeMultiTokenPredictorLayer`).
DEEPSEEK = Layout(
    "DeepSeek-V3/GLM-4.5",
    "enorm",
    "hnorm",
    "eh_proj",
    embedding_first=True,
    out_norm="shared_head.norm",
    chain_normed=False,
    block="",
    ignored=("embed_tokens.", "shared_head.head."),
)
# MiMo (`MiMoMultiTokenPredictorLayer`): the hidden state first, the output normalized.
MIMO = Layout(
    "MiMo",
    "token_layernorm",
    "hidden_layernorm",
    "input_proj",
    embedding_first=False,
    out_norm="final_layernorm",
    chain_normed=True,
    block="",
)
# Qwen3-Next (`Qwen3NextMultiTokenPredictor`): the layer under `layers.0`, `norm` after it.
QWEN3_NEXT = Layout(
    "Qwen3-Next",
    "pre_fc_norm_embedding",
    "pre_fc_norm_hidden",
    "fc",
    embedding_first=True,
    out_norm="norm",
    chain_normed=True,
    block="layers.0",
)


class _SharedHead(Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.norm = RMSNorm(hidden, eps=eps)


class _Stack(Module):
    """A module holding the decoder layer under `layers` (Qwen3-Next's `mtp.layers.0`)."""

    def __init__(self, block: Module) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.layers = [block]


def mtp_module(layout: Layout, block: Module, hidden: int, eps: float) -> Module:
    """The MTP module of `layout` around the family's decoder layer `block`."""
    root = block if not layout.block else _Stack(block)
    setattr(root, layout.embed_norm, RMSNorm(hidden, eps=eps))
    setattr(root, layout.hidden_norm, RMSNorm(hidden, eps=eps))
    setattr(root, layout.proj, Linear(2 * hidden, hidden, bias=False))
    if layout.out_norm == "shared_head.norm":
        root.shared_head = _SharedHead(hidden, eps)
    else:
        setattr(root, layout.out_norm, RMSNorm(hidden, eps=eps))
    return root


def _attr(module: Module, dotted: str) -> Any:
    value: Any = module
    for part in dotted.split("."):
        value = value[int(part)] if part.isdigit() else getattr(value, part)
    return value


def compose(
    layout: Layout, module: Module, embedded: mx.array, hidden: mx.array, cache: Any = None
) -> tuple[mx.array, mx.array]:
    """One MTP step: `(embedded [B, H], hidden [B, H]) -> (the vocabulary head's input, the
    hidden state the next step chains on)`, or over L positions (`[B, L, H]`, causal); the
    family's decoder layer attends over `cache` (its KV cache: the row's earlier
    positions, extended by these) when given."""
    e = _attr(module, layout.embed_norm)(embedded)
    h = _attr(module, layout.hidden_norm)(hidden.astype(e.dtype))
    joined = mx.concatenate([e, h] if layout.embedding_first else [h, e], axis=-1)
    block = module if not layout.block else _attr(module, layout.block)
    x = run_block(block, _attr(module, layout.proj)(joined), cache)
    normed = _attr(module, layout.out_norm)(x)
    return normed, normed if layout.chain_normed else x


@dataclass(frozen=True)
class Family:
    layout: Layout
    block: Callable[[Any], Module]  # the family's decoder layer for the MTP position
    prepare: Callable[[Module, dict[str, mx.array]], dict[str, mx.array]]  # -> module names


def _deepseek_block(args: Any) -> Module:
    from mlx_lm.models import deepseek_v3

    return deepseek_v3.DeepseekV3DecoderLayer(args, args.num_hidden_layers)


def _glm_block(args: Any) -> Module:
    from mlx_lm.models import glm4_moe

    return glm4_moe.DecoderLayer(args, args.num_hidden_layers)


def _mimo_block(args: Any) -> Module:
    from mlx_lm.models import mimo

    return mimo.TransformerBlock(args)


def _qwen3_next_block(args: Any) -> Module:
    from mlx_lm.models import qwen3_next

    # The index of a full-attention layer (the MTP layer is one; MoE as the model's are).
    return qwen3_next.Qwen3NextDecoderLayer(args, args.full_attention_interval - 1)


def _qwen3_5_block(args: Any) -> Module:
    from mlx_lm.models import qwen3_5

    return qwen3_5.DecoderLayer(args, args.full_attention_interval - 1)


def _own_and_block(
    layout: Layout, tensors: dict[str, mx.array]
) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    own_roots = (layout.embed_norm, layout.hidden_norm, layout.proj, layout.out_norm)
    own: dict[str, mx.array] = {}
    block: dict[str, mx.array] = {}
    for key, value in tensors.items():
        if key.startswith(layout.ignored or ("\0",)):
            continue
        if any(key.startswith(root + ".") for root in own_roots):
            own[key] = value
        elif not layout.block:
            block[key] = value
        elif key.startswith(layout.block + "."):
            block[key.removeprefix(layout.block + ".")] = value
    return own, block


def _through_sanitize(
    model: Module,
) -> Callable[[Module, dict[str, mx.array]], dict[str, mx.array]]:
    """The layer's tensors through the main model's own `sanitize`, as layer 0's (fp8
    blocks dequantized, experts stacked, `kv_b_proj` split)."""

    def prepare(_module: Module, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
        own, block = _own_and_block(DEEPSEEK, tensors)
        renamed = {f"model.layers.0.{k}": v for k, v in {**own, **block}.items()}
        try:
            sanitized = model.sanitize(renamed)
        except KeyError as exc:  # a missing expert or partner tensor of a transform
            missing = str(exc.args[0]).removeprefix("model.layers.0.")
            raise _Missing(missing) from None
        return {k.removeprefix("model.layers.0."): v for k, v in sanitized.items()}

    return prepare


def _mimo_prepare(_module: Module, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    own, block = _own_and_block(MIMO, tensors)
    return {**own, **block}


def _qwen3_next_prepare(module: Module, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """Hugging Face's Qwen3-Next layout: experts one by one (stacked here as mlx-lm's
    `switch_mlp`), zero-centred RMSNorm weights (weight + 1, as mlx-lm's `sanitize`)."""
    own, block = _own_and_block(QWEN3_NEXT, tensors)
    out = {**own, **{f"{QWEN3_NEXT.block}.{k}": v for k, v in block.items()}}
    experts = _attr(module, QWEN3_NEXT.block).mlp
    count = int(getattr(experts, "num_experts", 0))
    stem = f"{QWEN3_NEXT.block}.mlp"
    if f"{stem}.experts.gate_up_proj" in out:  # Qwen3.5-MoE's fused experts, as mlx-lm splits them
        gate_up = out.pop(f"{stem}.experts.gate_up_proj")
        mid = gate_up.shape[-2] // 2
        out[f"{stem}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out[f"{stem}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        if f"{stem}.experts.down_proj" not in out:
            raise _Missing(f"{stem}.experts.down_proj")
        out[f"{stem}.switch_mlp.down_proj.weight"] = out.pop(f"{stem}.experts.down_proj")
    elif count and f"{stem}.experts.0.up_proj.weight" in out:
        for name in ("gate_proj", "up_proj", "down_proj"):
            parts = []
            for e in range(count):
                key = f"{stem}.experts.{e}.{name}.weight"
                if key not in out:
                    raise _Missing(key)
                parts.append(out.pop(key))
            out[f"{stem}.switch_mlp.{name}.weight"] = mx.stack(parts)
    for key, value in out.items():
        if "norm" in key.rsplit(".", 2)[-2] and value.ndim == 1:
            out[key] = value + 1.0
    return out


class _Missing(Exception):
    """A tensor the MTP module needs is not in the checkpoint (its name, sans prefix)."""


def family_for(model: Module, model_type: str) -> Family | None:
    if model_type == "deepseek_v3":
        return Family(DEEPSEEK, _deepseek_block, _through_sanitize(model))
    if model_type == "glm4_moe":
        return Family(DEEPSEEK, _glm_block, _through_sanitize(model))
    if model_type == "mimo":
        return Family(MIMO, _mimo_block, _mimo_prepare)
    if model_type == "qwen3_next":
        return Family(QWEN3_NEXT, _qwen3_next_block, _qwen3_next_prepare)
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        return Family(QWEN3_NEXT, _qwen3_5_block, _qwen3_next_prepare)
    return None


def _is_quantized(model: Module) -> bool:
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    untyped: Any = model
    return any(
        isinstance(m, (QuantizedLinear, QuantizedSwitchLinear)) for _, m in untyped.named_modules()
    )


def _quantize_like(module: Module, weights: dict[str, mx.array], config: dict[str, Any]) -> None:
    """Quantize the layers whose `scales` the checkpoint has, as mlx-lm's `load_model`."""
    from mlx_lm.utils import infer_quant_config

    quant = config.get("quantization") or {}

    def predicate(path: str, layer: Module) -> bool | dict[str, Any]:
        if not hasattr(layer, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, layer, weights)

    quantize(
        module,
        group_size=int(quant.get("group_size", 64)),
        bits=int(quant.get("bits", 4)),
        mode=str(quant.get("mode", "affine")),
        class_predicate=predicate,
    )


def load_family_head(loaded: LoadedModel) -> MTPHead | None:
    """The MTP head of `loaded`'s own checkpoint; None when its config declares no MTP
    layer or its directory or GGUF file has none (a conversion that dropped them). Raises
    `MTPHeadError` naming the first missing tensor of an incomplete one or a tensor of the
    wrong shape, and for MTP layers of a model type (or a loader) the heads are not built
    for."""
    config = loaded.extra.get("config")
    fmt = loaded.extra.get("format")
    source = loaded.extra.get("gguf_file" if fmt == "gguf" else "model_dir")
    if not isinstance(config, dict) or not source or not mtp_layer_count(config):
        return None
    if fmt not in ("mlx-dir", "gguf"):
        raise MTPHeadError(
            f"--speculative mtp: {loaded.name}'s MTP weights are read only for text models "
            f"loaded with mlx-lm or from a GGUF file (this one loaded as {fmt})"
        )
    model = loaded.model
    model_type = str(config.get("model_type"))
    family = family_for(model, model_type)
    prefix = mtp_prefix(config)
    if family is None or prefix is None:
        raise MTPHeadError(
            f"--speculative mtp: {loaded.name} ({model_type}) declares MTP layers, but they "
            f"are read only for {MTP_FAMILIES}; give a trained head with --mtp-head FILE"
        )
    if fmt == "gguf":  # llama.cpp's `nextn` block, named in errors as the file names it
        tensors = read_gguf_mtp_tensors(source, config, keep_quantized=_is_quantized(model))

        def named(name: str) -> str:
            return gguf_tensor_name(source, config, name)
    else:
        tensors = read_mtp_tensors(source, config)
        stem = prefix

        def named(name: str) -> str:
            return stem + name

    if not tensors:
        return None
    # Qwen3.5's language model keeps its own args (the outer ones hold `text_config`).
    args = getattr(getattr(model, "language_model", None), "args", None) or model.args
    eps = float(getattr(args, "rms_norm_eps", 1e-6))
    module = mtp_module(family.layout, family.block(args), int(args.hidden_size), eps)
    where = f"{loaded.name}: the MTP weights are incomplete"
    try:
        weights = family.prepare(module, tensors)
    except _Missing as exc:
        raise MTPHeadError(f"{where}: no tensor {named(str(exc.args[0]))!r}") from None
    if any(k.endswith(".scales") for k in weights):
        _quantize_like(module, weights, config)
    wanted = model_arrays(module)
    for name, param in wanted.items():
        got = weights.get(name)
        if got is None:
            raise MTPHeadError(f"{where}: no tensor {named(name)!r}")
        if tuple(got.shape) != tuple(param.shape):
            raise MTPHeadError(
                f"{loaded.name}: MTP tensor {named(name)!r} has shape {tuple(got.shape)}, "
                f"the model needs {tuple(param.shape)}"
            )
    module.load_weights([(name, weights[name]) for name in wanted])
    dtype = model.model.norm.weight.dtype
    if not _is_quantized(model):
        dequantize_model(module, dtype)
    cast_floating(module, dtype)
    untyped: Any = module
    mx.eval(untyped.parameters())
    return MTPHead(module, model, functools.partial(compose, family.layout))


__all__ = ["DEEPSEEK", "MIMO", "MTP_FAMILIES", "QWEN3_NEXT", "Layout", "load_family_head"]
