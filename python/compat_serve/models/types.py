"""What a model loader hands to the engine: API-neutral, HTTP-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx.nn.layers.base import Module

    from compat_serve.models.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """A ready-to-run model.

    `model` follows the mlx-lm convention: `model(inputs[B, T], cache=list_of_layer_caches)`
    returns logits `[B, T, vocab]`, and `mlx_lm.models.cache.make_prompt_cache(model)` builds
    its cache.
    """

    model: Module
    tokenizer: Tokenizer
    chat_template: str | None
    context_length: int
    # Name the server reports by default (e.g. "SmolLM2-135M-Instruct").
    name: str
    # Where it came from: a path, a hub id, or "embedded:<file>".
    source: str
    # "float32", "float16", "bfloat16" or "quantized-4bit"/"quantized-8bit"...
    dtype: str
    # Architecture id as mlx-lm knows it ("llama", "qwen3", ...).
    model_type: str
    extra: dict[str, Any] = field(default_factory=dict)
    # Sampling the publisher recommends (`generation_config.json`: temperature, top_p,
    # top_k), and where it was read from; requests that send none get it, over the
    # --default-* flags (server/sampling_defaults.py).
    generation_config: dict[str, Any] = field(default_factory=dict)
    generation_config_source: str = "generation_config.json"
    # Recommended sampling stated elsewhere (a model card), and where: used only where
    # neither the file nor a --default-* flag sets the field.
    fallback_sampling: dict[str, Any] = field(default_factory=dict)
    fallback_sampling_source: str = ""
