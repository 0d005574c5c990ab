"""ModernBERT in MLX, batched with an attention mask: pre-norm layers, rotary positions
(global theta on every `global_attn_every_n_layers`-th layer, local theta and a
`local_attention` sliding window on the others), GeGLU MLPs. Names follow Hugging Face's
`ModernBertModel` (and `ModernBertForSequenceClassification`'s `model.`/`head.`/
`classifier`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Identity, Linear
from mlx.nn.layers.normalization import LayerNorm
from mlx.nn.layers.positional_encoding import RoPE

from compat_serve.embeddings.encoders import activation


@dataclass(frozen=True)
class ModernBertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_activation: str
    global_rope_theta: float
    local_rope_theta: float
    global_attn_every_n_layers: int
    local_attention: int
    pad_token_id: int
    classifier_pooling: str
    classifier_bias: bool
    classifier_activation: str

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> ModernBertConfig:
        act = str(c.get("hidden_activation", "gelu"))
        return cls(
            vocab_size=int(c["vocab_size"]),
            hidden_size=int(c["hidden_size"]),
            num_hidden_layers=int(c["num_hidden_layers"]),
            num_attention_heads=int(c["num_attention_heads"]),
            intermediate_size=int(c["intermediate_size"]),
            max_position_embeddings=int(c.get("max_position_embeddings", 8192)),
            norm_eps=float(c.get("norm_eps", 1e-5)),
            norm_bias=bool(c.get("norm_bias", False)),
            attention_bias=bool(c.get("attention_bias", False)),
            mlp_bias=bool(c.get("mlp_bias", False)),
            hidden_activation=act,
            global_rope_theta=float(c.get("global_rope_theta", 160000.0)),
            local_rope_theta=float(c.get("local_rope_theta", 10000.0)),
            global_attn_every_n_layers=int(c.get("global_attn_every_n_layers", 3)),
            local_attention=int(c.get("local_attention", 128)),
            pad_token_id=int(c.get("pad_token_id") or 0),
            classifier_pooling=str(c.get("classifier_pooling", "cls")),
            classifier_bias=bool(c.get("classifier_bias", False)),
            classifier_activation=str(c.get("classifier_activation") or act),
        )


class ModernBertEmbeddings(Module):
    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)

    def __call__(self, ids: mx.array) -> mx.array:
        out: mx.array = self.norm(self.tok_embeddings(ids))
        return out


class ModernBertAttention(Module):
    def __init__(self, cfg: ModernBertConfig, local: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.local = local
        self.Wqkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)
        self.Wo = Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.attention_bias)
        theta = cfg.local_rope_theta if local else cfg.global_rope_theta
        self.rope = RoPE(self.head_dim, traditional=False, base=theta)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        n, length, width = x.shape
        qkv = self.Wqkv(x).reshape(n, length, 3, self.heads, self.head_dim)
        qkv = qkv.transpose(2, 0, 3, 1, 4)  # [3, n, heads, L, head_dim]
        q, k, v = self.rope(qkv[0]), self.rope(qkv[1]), qkv[2]
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5, mask=mask)
        return self.Wo(out.transpose(0, 2, 1, 3).reshape(n, length, width))


class ModernBertMLP(Module):
    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.Wi = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.Wo = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = activation(cfg.hidden_activation)

    def __call__(self, x: mx.array) -> mx.array:
        value, gate = mx.split(self.Wi(x), 2, axis=-1)
        return self.Wo(self.act(value) * gate)


class ModernBertLayer(Module):
    def __init__(self, cfg: ModernBertConfig, index: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.local = index % cfg.global_attn_every_n_layers != 0
        # The first layer's attention input is the (already normed) embedding output.
        self.attn_norm: Module = (
            Identity()
            if index == 0
            else LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)
        )
        self.attn = ModernBertAttention(cfg, self.local)
        self.mlp_norm = LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.mlp = ModernBertMLP(cfg)

    def __call__(self, x: mx.array, global_mask: mx.array, local_mask: mx.array) -> mx.array:
        x = x + self.attn(self.attn_norm(x), local_mask if self.local else global_mask)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertModel(Module):
    """Token ids [n, L] and a mask [n, L] (True = real token, right padding) -> the final
    normed hidden states [n, L, hidden]."""

    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cfg = cfg
        self.embeddings = ModernBertEmbeddings(cfg)
        self.layers = [ModernBertLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.final_norm = LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)

    def __call__(self, ids: mx.array, mask: mx.array) -> mx.array:
        length = ids.shape[1]
        global_mask = mask[:, None, None, :]
        positions = mx.arange(length)
        near = mx.abs(positions[:, None] - positions[None, :]) <= self.cfg.local_attention // 2
        local_mask = mx.logical_and(global_mask, near[None, None])
        x = self.embeddings(ids)
        for layer in self.layers:
            x = layer(x, global_mask, local_mask)
        out: mx.array = self.final_norm(x)
        return out


class ModernBertPredictionHead(Module):
    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias)
        self.act = activation(cfg.classifier_activation)
        self.norm = LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)

    def __call__(self, x: mx.array) -> mx.array:
        out: mx.array = self.norm(self.act(self.dense(x)))
        return out


class ModernBertForSequenceClassification(Module):
    """`model.*` + `head` + `classifier` on the CLS or mean-pooled state (config's
    `classifier_pooling`)."""

    def __init__(self, cfg: ModernBertConfig, labels: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cfg = cfg
        self.model = ModernBertModel(cfg)
        self.head = ModernBertPredictionHead(cfg)
        self.classifier = Linear(cfg.hidden_size, labels)

    def __call__(self, ids: mx.array, mask: mx.array) -> mx.array:
        hidden = self.model(ids, mask)
        if self.cfg.classifier_pooling == "mean":
            weights = mask[:, :, None].astype(hidden.dtype)
            pooled = (hidden * weights).sum(axis=1) / weights.sum(axis=1)
        else:
            pooled = hidden[:, 0]
        return self.classifier(self.head(pooled))
