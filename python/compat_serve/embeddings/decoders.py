"""Decoder embedding models and yes/no rerankers on mlx-lm's own model classes.

- Embedding (Qwen3-Embedding, any mlx-lm architecture with a pooling config): the hidden
  states before the LM head (`model.model(ids)`), pooled. Right padding under the causal
  mask leaves every real token's state untouched by the padding, so last-token pooling
  reads position `length - 1` and needs no left padding.
- Reranker (Qwen3-Reranker): its documented prompt; score = p("yes") of the softmax over
  the "yes" and "no" logits at the last position.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from compat_serve.embeddings.pooling import last_positions
from compat_serve.embeddings.text_tokens import TextTokens
from compat_serve.models.errors import ModelLoadError

# Qwen3-Reranker's model card (Qwen/Qwen3-Reranker-0.6B, "Usage"): the system turn, the
# default instruction, and the empty thinking block the assistant turn opens with.
QWEN3_RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n"
)
QWEN3_RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANK_INSTRUCTION = (
    "Given a web search query, retrieve relevant passages that answer the query"
)


def qwen3_rerank_pair(tokens: TextTokens, query: str, document: str) -> list[int]:
    body = f"<Instruct>: {QWEN3_RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    return tokens.encode(QWEN3_RERANK_PREFIX + body + QWEN3_RERANK_SUFFIX, special=False)


def read_weights(model_dir: Path) -> dict[str, mx.array]:
    files = sorted(glob.glob(str(model_dir / "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{model_dir}: no .safetensors weights")
    weights: dict[str, mx.array] = {}
    for file in files:
        loaded: Any = mx.load(file)
        weights.update(loaded)
    return weights


def build_decoder(model_dir: Path, config: dict[str, Any], *, keep_head: bool) -> nn.Module:
    """The mlx-lm model of `config` with the directory's weights (lazy). Checkpoints saved
    without the `model.` prefix (Qwen3-Embedding's `Qwen3Model`) get it; without
    `keep_head` the LM head is dropped and only `model.model` is loaded (an untied
    embedding checkpoint ships no head)."""
    from mlx_lm.utils import _get_classes

    try:
        model_class, args_class = _get_classes(config)
    except ValueError as exc:
        raise ModelLoadError(f"{model_dir}: {exc}") from exc
    model: Any = model_class(args_class.from_dict(config))
    weights = read_weights(model_dir)
    if not any(name.startswith("model.") for name in weights):
        weights = {f"model.{name}": value for name, value in weights.items()}
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    quantization = config.get("quantization")
    if isinstance(quantization, dict):
        nn.quantize(
            model,
            group_size=int(quantization["group_size"]),
            bits=int(quantization["bits"]),
            class_predicate=lambda path, module: (
                hasattr(module, "to_quantized") and f"{path}.scales" in weights
            ),
        )
    try:
        if keep_head:
            model.load_weights(list(weights.items()), strict=True)
        else:
            inner = [(k[len("model.") :], v) for k, v in weights.items() if k.startswith("model.")]
            model.model.load_weights(inner, strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"{model_dir}: weights do not match the config: {exc}") from exc
    return model


def decoder_hidden(model: Any) -> Any:
    """Hidden states before the LM head; the mask is not needed (causal, right padding)."""

    def forward(ids: mx.array, mask: mx.array) -> mx.array:
        del mask
        hidden: mx.array = model.model(ids)
        return hidden

    return forward


def yes_no_scorer(model: Any, yes_id: int, no_id: int) -> Any:
    """p(yes) from the two logits at each row's last real token."""

    def forward(ids: mx.array, mask: mx.array, lengths: mx.array) -> mx.array:
        del mask
        last = last_positions(model.model(ids), lengths)
        if getattr(model, "lm_head", None) is not None and "lm_head" in model:
            logits = model.lm_head(last)
        else:
            logits = model.model.embed_tokens.as_linear(last)
        logits = logits.astype(mx.float32)
        return mx.sigmoid(logits[:, yes_id] - logits[:, no_id])

    return forward
