"""BERT and XLM-RoBERTa encoders in MLX, batched with an attention mask, and their
sequence-classification heads (cross-encoder rerankers).

Parameter names are Hugging Face's, so a checkpoint loads without renaming beyond its
prefix. Our own modules rather than `mlx-embeddings`' (which serves as the tests'
independent reference): theirs import mlx-vlm and transformers at package import, fix the
activation to exact GELU whatever `hidden_act` says, and have no classification heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.nn.layers.activations import GELU, ReLU, SiLU
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.normalization import LayerNorm


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    # XLM-R/RoBERTa number positions from pad_token_id + 1 and skip padding.
    positions_after_padding: bool
    pad_token_id: int
    # BERT pairs: token type 1 after the first [SEP] (what its tokenizer's template assigns).
    sep_token_id: int | None

    @classmethod
    def from_dict(cls, config: dict[str, Any], sep_token_id: int | None) -> EncoderConfig:
        roberta = str(config.get("model_type")) in ("xlm-roberta", "roberta")
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=int(config["num_attention_heads"]),
            intermediate_size=int(config["intermediate_size"]),
            max_position_embeddings=int(config["max_position_embeddings"]),
            type_vocab_size=int(config.get("type_vocab_size", 2)),
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
            hidden_act=str(config.get("hidden_act", "gelu")),
            positions_after_padding=roberta,
            pad_token_id=int(config.get("pad_token_id") or (1 if roberta else 0)),
            sep_token_id=sep_token_id,
        )

    @property
    def max_tokens(self) -> int:
        if self.positions_after_padding:
            return self.max_position_embeddings - self.pad_token_id - 1
        return self.max_position_embeddings


def activation(name: str) -> Module:
    if name == "gelu":
        return GELU()  # type: ignore[no-untyped-call]
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return GELU(approx="precise")  # type: ignore[no-untyped-call]
    if name == "relu":
        return ReLU()  # type: ignore[no-untyped-call]
    if name in ("silu", "swish"):
        return SiLU()  # type: ignore[no-untyped-call]
    raise ValueError(f"unsupported hidden_act {name!r}")


def key_mask(mask: mx.array) -> mx.array:
    """[n, L] bool (True = real token) -> the [n, 1, 1, L] key mask attention broadcasts."""
    return mask[:, None, None, :]


class BertEmbeddings(Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cfg = cfg
        self.word_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def __call__(self, ids: mx.array, mask: mx.array) -> mx.array:
        cfg = self.cfg
        if cfg.positions_after_padding:
            real = mask.astype(mx.int32)
            positions = mx.cumsum(real, axis=1) * real + cfg.pad_token_id
        else:
            positions = mx.broadcast_to(mx.arange(ids.shape[1])[None, :], ids.shape)
        if cfg.type_vocab_size > 1 and cfg.sep_token_id is not None:
            is_sep = (ids == cfg.sep_token_id).astype(mx.int32)
            types = ((mx.cumsum(is_sep, axis=1) - is_sep) > 0).astype(mx.int32)
        else:
            types = mx.zeros_like(ids)
        x = (
            self.word_embeddings(ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(types)
        )
        out: mx.array = self.LayerNorm(x)
        return out


class BertSelfAttention(Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.heads = cfg.num_attention_heads
        self.query = Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = Linear(cfg.hidden_size, cfg.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        n, length, width = x.shape
        head_dim = width // self.heads

        def split(t: mx.array) -> mx.array:
            return t.reshape(n, length, self.heads, head_dim).transpose(0, 2, 1, 3)

        out = mx.fast.scaled_dot_product_attention(
            split(self.query(x)),
            split(self.key(x)),
            split(self.value(x)),
            scale=head_dim**-0.5,
            mask=mask,
        )
        return out.transpose(0, 2, 1, 3).reshape(n, length, width)


class BertDenseNorm(Module):
    """Linear, then LayerNorm of (that + the residual): BERT's SelfOutput and Output."""

    def __init__(self, in_dims: int, cfg: EncoderConfig) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.dense = Linear(in_dims, cfg.hidden_size)
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        out: mx.array = self.LayerNorm(self.dense(x) + residual)
        return out


class BertAttention(Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.self = BertSelfAttention(cfg)
        self.output = BertDenseNorm(cfg.hidden_size, cfg)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        return self.output(self.self(x, mask), x)


class BertIntermediate(Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.dense = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = activation(cfg.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        out: mx.array = self.act(self.dense(x))
        return out


class BertLayer(Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertDenseNorm(cfg.intermediate_size, cfg)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        attended = self.attention(x, mask)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.layer = [BertLayer(cfg) for _ in range(cfg.num_hidden_layers)]


class BertPooler(Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size)

    def __call__(self, hidden: mx.array) -> mx.array:
        return mx.tanh(self.dense(hidden[:, 0]))


class BertModel(Module):
    """BertModel / XLMRobertaModel: token ids [n, L] and a mask [n, L] (True = real token,
    right padding) -> last hidden states [n, L, hidden]."""

    def __init__(self, cfg: EncoderConfig, *, pooler: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        if pooler:
            self.pooler = BertPooler(cfg)

    def __call__(self, ids: mx.array, mask: mx.array) -> mx.array:
        x = self.embeddings(ids, mask)
        keys = key_mask(mask)
        for layer in self.encoder.layer:
            x = layer(x, keys)
        return x


class BertForSequenceClassification(Module):
    """`bert.*` + `classifier`: logits = classifier(tanh(pooler(h[CLS])))."""

    def __init__(self, cfg: EncoderConfig, labels: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.bert = BertModel(cfg, pooler=True)
        self.classifier = Linear(cfg.hidden_size, labels)

    def __call__(self, ids: mx.array, mask: mx.array) -> mx.array:
        return self.classifier(self.bert.pooler(self.bert(ids, mask)))


class RobertaClassificationHead(Module):
    def __init__(self, cfg: EncoderConfig, labels: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = Linear(cfg.hidden_size, labels)

    def __call__(self, hidden: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(hidden[:, 0])))


class XLMRobertaForSequenceClassification(Module):
    """`roberta.*` (no pooler) + `classifier.dense`/`classifier.out_proj` on h[<s>]: the
    bge-reranker architecture."""

    def __init__(self, cfg: EncoderConfig, labels: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.roberta = BertModel(cfg, pooler=False)
        self.classifier = RobertaClassificationHead(cfg, labels)

    def __call__(self, ids: mx.array, mask: mx.array) -> mx.array:
        return self.classifier(self.roberta(ids, mask))


def sanitize_encoder_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Drop buffers HF saves beside the parameters; old TF-converted names (gamma/beta)."""
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        if name.endswith("position_ids"):
            continue
        renamed = name.replace("LayerNorm.gamma", "LayerNorm.weight")
        out[renamed.replace("LayerNorm.beta", "LayerNorm.bias")] = value
    return out
