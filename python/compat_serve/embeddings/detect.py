"""Which kind of model a directory holds: chat, embedding or reranker.

Read from what users' directories carry: `config.json` architectures and model type,
sentence-transformers' `modules.json` / `1_Pooling/config.json`, and the directory name for
Qwen3-Reranker (a plain `Qwen3ForCausalLM` checkpoint whose files say nothing else about it;
its model card is the only other place that names it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from compat_serve.embeddings.st_config import pooling_config_path, read_json, read_modules

ModelKind = Literal["chat", "embedding", "reranker"]

# Encoder families this package runs (config.json model_type).
ENCODER_TYPES = frozenset({"bert", "xlm-roberta", "modernbert"})


def architectures(config: dict[str, Any]) -> list[str]:
    archs = config.get("architectures")
    return [str(a) for a in archs] if isinstance(archs, list) else []


def is_qwen3_reranker_dir(model_dir: Path, config: dict[str, Any]) -> bool:
    """A causal LM released as a yes/no reranker (Qwen3-Reranker and its MLX conversions):
    the directory name says "reranker"."""
    return "reranker" in model_dir.resolve().name.lower() and any(
        a.endswith("ForCausalLM") for a in architectures(config)
    )


def kind_from_config(model_dir: Path, config: dict[str, Any]) -> ModelKind:
    archs = architectures(config)
    model_type = str(config.get("model_type", ""))
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return "reranker"
    if is_qwen3_reranker_dir(model_dir, config):
        return "reranker"
    if pooling_config_path(model_dir) is not None or read_modules(model_dir):
        return "embedding"
    if model_type in ENCODER_TYPES:
        # A bare encoder (BertModel, XLMRobertaModel, ModernBertModel, ...ForMaskedLM):
        # nothing to chat with; served as an embedding model with the family's pooling.
        return "embedding"
    if archs and all(a.endswith("Model") and "LMHead" not in a for a in archs):
        # A decoder saved without its LM head (Qwen3Model): an embedding backbone. (Not
        # GPT2LMHeadModel and its kin: chat models whose class name ends in "Model".)
        return "embedding"
    return "chat"


def model_kind(path: Path) -> ModelKind:
    """The kind of model in `path` (a directory; a file such as a GGUF is a chat model)."""
    path = Path(path)
    if not path.is_dir():
        return "chat"
    config = read_json(path / "config.json")
    if config is None:
        return "chat"
    return kind_from_config(path, config)
