"""Chat prompts for engine-level tests on the embedded (ChatML) model."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel


def chat_ids(model: LoadedModel, text: str) -> tuple[int, ...]:
    """Token ids of one ChatML user turn asking for the assistant's reply."""
    prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return tuple(model.tokenizer.encode(prompt))
