"""A Hugging Face model's context window, from its config.json (or tokenizer_config.json):
what the model directory loader and the vision-language loader both report."""

from __future__ import annotations

from typing import Any

DEFAULT_CONTEXT_LENGTH = 4096


def context_length_from_config(
    config: dict[str, Any], tokenizer_config: dict[str, Any] | None = None
) -> int:
    """The model's context window from config.json (or tokenizer_config.json)."""
    sources = [config]
    if isinstance(config.get("text_config"), dict):
        sources.append(config["text_config"])
    for source in sources:
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_ctx"):
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    value = (tokenizer_config or {}).get("model_max_length")
    if isinstance(value, int) and 0 < value < 10_000_000:
        return value
    return DEFAULT_CONTEXT_LENGTH
