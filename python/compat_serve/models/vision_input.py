"""What a vision-language request carries into the engine: each image's span of
placeholder tokens in the prompt (with its pixels and hash), and the prompt's M-RoPE
positions. The model's processor (models/vlm.py) builds it; the engine's runner feeds it
to the model (engine/vision.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ImageSpan:
    """An image's placeholder tokens `[start, start + length)` in the prompt."""

    start: int
    length: int
    hash: bytes  # 16 bytes: the prefix cache's per-block key and the feature LRU's key
    pixel_values: Any  # what the model's vision tower takes (numpy)
    grid: tuple[int, int, int]


@dataclass(frozen=True)
class VisionInput:
    """A request's images and its M-RoPE positions (`[3, prompt_len]` numpy), plus the
    delta every position after the prompt gets (generated tokens)."""

    spans: tuple[ImageSpan, ...]
    positions: Any
    rope_delta: int

    def cache_keys(self) -> list[tuple[int, int, bytes]]:
        """`(start, length, hash)` per image: the prefix cache's `images=`."""
        return [(s.start, s.length, s.hash) for s in self.spans]

    def first_image_at_or_after(self, position: int) -> int | None:
        starts = [s.start for s in self.spans if s.start >= position]
        return min(starts) if starts else None
