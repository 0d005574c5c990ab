"""Requests with images on a vision-language model: fetch URLs (time and size limits),
decode and validate (chat/images.py), run the model's image processor, render the prompt
with the model's image markup and expand each image to its tokens. The result is the
prompt and the engine's `VisionInput`; everything heavy runs off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from compat_serve.chat.images import (
    MAX_IMAGES,
    ImageError,
    ImageRef,
    decode_image,
    fetch_image,
)
from compat_serve.chat.prompt import Prompt, PromptError
from compat_serve.chat.types import ChatRequest
from compat_serve.server.errors import ApiError
from compat_serve.server.state import ServerState


def vision_processor(state: ServerState) -> Any | None:
    """The loaded model's image processor (models/vlm.py), None for a text-only model."""
    return state.engine.model.extra.get("vision")


def reads_images(state: ServerState) -> bool:
    return vision_processor(state) is not None


async def build_vision_prompt(state: ServerState, chat: ChatRequest) -> Prompt:
    processor = vision_processor(state)
    if processor is None:  # the adapters refuse images for text-only models first
        raise ApiError(400, "messages: this model is text-only and cannot read images")
    if len(chat.images) > MAX_IMAGES:
        raise ApiError(
            400,
            f"messages: too many images: {len(chat.images)} > {MAX_IMAGES} per request",
            param="messages",
        )
    try:
        raws = await asyncio.gather(*(_fetched(ref) for ref in chat.images))
    except ImageError as exc:
        raise ApiError(400, str(exc), param=exc.param) from exc

    def work() -> Prompt:
        images = [decode_image(ref, raw) for ref, raw in zip(chat.images, raws, strict=True)]
        prepared = [processor.prepare(image) for image in images]
        prompt = state.prompt_builder.build(chat, processor.image_markup)
        ids, vision = processor.expand(prompt.token_ids, prepared)
        return Prompt(prompt.text, tuple(ids), vision)

    try:
        return await asyncio.to_thread(work)
    except ImageError as exc:
        raise ApiError(400, str(exc), param=exc.param) from exc
    except PromptError as exc:
        raise ApiError(400, str(exc)) from exc
    except ValueError as exc:
        raise ApiError(400, f"messages: cannot render the request: {exc}") from exc


async def _fetched(ref: ImageRef) -> bytes | None:
    return await fetch_image(ref) if ref.url is not None else None
