"""Random-init models of real shapes, built from mlx-lm's own classes (no download).

Full size: a Llama-3.1-8B-shaped dense model (bf16, and 4-bit by `mlx.nn.quantize` group
64) and a Qwen3-30B-A3B-shaped MoE in 4-bit. Smoke: the same families at hidden size 64.
Weights are made one decoder layer at a time (random init, cast, quantize, evaluate), so
the float32 init of a 30B model never lives in memory at once. The weights stay as built:
on CUDA or Metal the engine runs them as stored, the users' path.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx import nn

from compat_serve.models.tokenizer import Tokenizer
from compat_serve.models.types import LoadedModel

GROUP_SIZE = 64

LLAMA_31_8B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
}
QWEN3_30B_A3B: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}
# The smoke shapes: the same classes, hidden size 64 (head dim 64 so quantized KV groups
# of 64 divide it), a vocabulary of 512.
_TINY = {"hidden_size": 64, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64}
SMOKE_LLAMA = {
    **LLAMA_31_8B,
    **_TINY,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 8192,
}
SMOKE_MOE = {
    **QWEN3_30B_A3B,
    **_TINY,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 512,
    "max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Shape:
    """One model to build: a name for the tables, its config.json, and how to store it."""

    name: str
    config: dict[str, Any]
    bits: int | None  # None: dense in `dtype`; else affine-quantized, group 64

    @property
    def label(self) -> str:
        return f"{self.name} {'bf16' if self.bits is None else f'{self.bits}-bit'}"


def shapes(smoke: bool) -> dict[str, Shape]:
    llama, moe = (SMOKE_LLAMA, SMOKE_MOE) if smoke else (LLAMA_31_8B, QWEN3_30B_A3B)
    prefix = "tiny " if smoke else ""
    return {
        "dense-4bit": Shape(f"{prefix}Llama-3.1-8B-shaped", llama, 4),
        "dense-bf16": Shape(f"{prefix}Llama-3.1-8B-shaped", llama, None),
        "moe-4bit": Shape(f"{prefix}Qwen3-30B-A3B-shaped", moe, 4),
    }


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level vocabulary `t0 .. t{n-1}`: the random models are fed token ids, and
    the engine only needs to detokenize what they generate. No EOS: runs last max_tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment]
    return Tokenizer(backend)


def _quantize_predicate(model: nn.Module) -> Any:
    """mlx-lm's own choices (`model.quant_predicate`: e.g. Qwen3-MoE's router in 8-bit),
    on the layers whose input width the group divides, as `mlx_lm.convert -q` does."""
    own = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if not hasattr(module, "to_quantized"):
            return False
        if module.weight.shape[-1] % GROUP_SIZE:
            return False
        return own(path, module) if own is not None else True

    return predicate


def build(shape: Shape, *, seed: int = 0, dtype: mx.Dtype = mx.bfloat16) -> LoadedModel:
    """The model of `shape`, random weights, evaluated layer by layer."""
    config = shape.config
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))  # lazy: nothing allocated yet
    predicate = _quantize_predicate(model)
    for layer in model.model.layers:
        layer.set_dtype(dtype)
        if shape.bits is not None:
            nn.quantize(layer, GROUP_SIZE, shape.bits, class_predicate=predicate)
        mx.eval(layer.parameters())
    model.set_dtype(dtype)
    if shape.bits is not None:  # the embedding and the LM head (layers are done)
        nn.quantize(model, GROUP_SIZE, shape.bits, class_predicate=predicate)
    mx.eval(model.parameters())
    mx.clear_cache()
    stored = "bfloat16" if shape.bits is None else f"quantized-{shape.bits}bit"
    return LoadedModel(
        model=model,
        tokenizer=synthetic_tokenizer(config["vocab_size"]),
        chat_template=None,
        context_length=int(config["max_position_embeddings"]),
        name=shape.label,
        source="random-init",
        dtype=stored,
        model_type=config["model_type"],
    )


def random_prompt(vocab_size: int, length: int, seed: int) -> tuple[int, ...]:
    """`length` token ids, distinct per seed (so no prefix cache serves one from another)."""
    key = mx.random.key(seed)
    ids = mx.random.randint(1, vocab_size, (length,), key=key)
    return tuple(int(i) for i in ids.tolist())
