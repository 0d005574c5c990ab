"""Reference forwards for the embedding/reranker tests, independent of the code under test:
`mlx-embeddings`' own BERT, XLM-RoBERTa and ModernBERT modules and mlx-lm's Qwen3, each run
on one input at a time without padding, with the pooling, normalization and heads written
out in numpy here."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from compat_serve.embeddings.st_config import read_json


def weights_np(model_dir: Path) -> dict[str, np.ndarray]:
    loaded: Any = mx.load(str(model_dir / "model.safetensors"))
    return {k: np.array(v, dtype=np.float32) for k, v in loaded.items()}


def _strip(weights: dict[str, np.ndarray], prefix: str) -> list[tuple[str, mx.array]]:
    return [(k[len(prefix) :], mx.array(v)) for k, v in weights.items() if k.startswith(prefix)]


def mlx_embeddings_family(name: str) -> Any:
    """mlx-embeddings' model file `name` (bert, xlm_roberta, modernbert), imported on its
    own: the package's __init__ imports mlx-vlm and transformers' processors (~3 s), which
    the model files do not need. A private package name keeps `mlx_embeddings` itself
    untouched for anything else in the session."""
    alias = "_mlx_embeddings_models"
    if alias not in sys.modules:
        spec = importlib.util.find_spec("mlx_embeddings")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("mlx-embeddings is not installed (make setup installs it)")
        package = types.ModuleType(alias)
        package.__path__ = [str(Path(next(iter(spec.submodule_search_locations))) / "models")]
        sys.modules[alias] = package
    return importlib.import_module(f"{alias}.{name}")


def mlx_embeddings_encoder(model_dir: Path, prefix: str = "") -> Any:
    """mlx-embeddings' module for the directory's encoder family, with its weights."""
    bert = mlx_embeddings_family("bert")
    xlm_roberta = mlx_embeddings_family("xlm_roberta")
    modernbert = mlx_embeddings_family("modernbert")

    config = read_json(model_dir / "config.json") or {}
    family = {"bert": bert, "xlm-roberta": xlm_roberta, "modernbert": modernbert}[
        config["model_type"]
    ]
    if family is modernbert:
        args = modernbert.ModelArgs.from_dict(config)
        module: Any = modernbert.ModernBertModel(args)
    else:
        args = family.ModelArgs.from_dict({**config, "add_pooling_layer": False})
        module = family.Model(args)
    weights = _strip(weights_np(model_dir), prefix)
    if family is bert:
        module.load_weights(weights, strict=True)
    else:  # no pooler in XLM-R heads; ModernBertModel has none
        module.load_weights(weights, strict=False)
    if family is modernbert and config.get("hidden_activation", "gelu") == "gelu":
        # mlx-embeddings 0.1.0's ModernBERT MLP uses the tanh approximation of GELU where
        # Hugging Face's "gelu" is the exact one (outputs differ by ~1e-5): the reference
        # follows Hugging Face.
        for layer in module.layers:
            layer.mlp.act = nn.GELU()
    module.eval()  # their dropout layers are live in MLX's default training mode
    return module


def encoder_hidden(module: Any, ids: list[int], type_ids: list[int] | None = None) -> np.ndarray:
    """Last hidden states [L, H] of one unpadded input."""
    x = mx.array([ids])
    mask = mx.ones((1, len(ids)))
    if isinstance(module, mlx_embeddings_family("modernbert").ModernBertModel):
        out = module(x, attention_mask=mask)["last_hidden_state"]
    elif type_ids is not None:
        out = module(x, token_type_ids=mx.array([type_ids]), attention_mask=mask).last_hidden_state
    else:
        out = module(x, attention_mask=mask).last_hidden_state
    return np.array(out[0], dtype=np.float32)


def bert_pooler_output(module: Any, ids: list[int], type_ids: list[int]) -> np.ndarray:
    x = mx.array([ids])
    out = module(x, token_type_ids=mx.array([type_ids]), attention_mask=mx.ones((1, len(ids))))
    return np.array(out.pooler_output[0], dtype=np.float32)


def qwen3_model(model_dir: Path) -> Any:
    """mlx-lm's Qwen3 with the directory's weights (Qwen3Model files get `model.`)."""
    from mlx_lm.models import qwen3

    config = read_json(model_dir / "config.json") or {}
    model: Any = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = weights_np(model_dir)
    if not any(k.startswith("model.") for k in weights):
        weights = {f"model.{k}": v for k, v in weights.items()}
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    return model


def decoder_hidden(model: Any, ids: list[int]) -> np.ndarray:
    return np.array(model.model(mx.array([ids]))[0], dtype=np.float32)


def decoder_logits(model: Any, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0], dtype=np.float32)


# Pooling, normalization and heads, written out.


def pool_np(hidden: np.ndarray, mode: str) -> np.ndarray:
    if mode == "cls":
        return hidden[0]
    if mode == "lasttoken":
        return hidden[-1]
    if mode == "mean":
        return hidden.mean(axis=0)
    raise ValueError(mode)


def normalize_np(x: np.ndarray) -> np.ndarray:
    return x / max(float(np.linalg.norm(x)), 1e-12)


def sigmoid_np(x: float) -> float:
    return float(1.0 / (1.0 + np.exp(-x)))


def softmax_yes_np(logits: np.ndarray, yes: int, no: int) -> float:
    pair = np.array([logits[no], logits[yes]], dtype=np.float64)
    e = np.exp(pair - pair.max())
    return float(e[1] / e.sum())


def gelu_np(x: np.ndarray) -> np.ndarray:
    """Exact GELU: x * Phi(x)."""
    from math import erf, sqrt

    return x * 0.5 * (1.0 + np.vectorize(erf)(x / sqrt(2.0)))


def layer_norm_np(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    centred = x - x.mean()
    return centred / np.sqrt((centred**2).mean() + eps) * weight
