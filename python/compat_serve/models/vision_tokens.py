"""The image token ids of a Qwen-VL checkpoint (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), read from
the directory's own files, never from mlx-vlm's config class (whose fields differ by
version: qwen2_vl's has no `vision_end_token_id`, and every version falls back to the
151k ids of Qwen's tokenizer when config.json is silent).

Each id comes from config.json (the top level, as every Qwen-VL release writes them, or
`text_config`), under its own name or the older `*_index` spelling, else from the
tokenizer's vocabulary (the special token the chat template writes). A directory that has
neither fails to load with the field named.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from compat_serve.models.errors import ModelLoadError

__all__ = ["QwenVisionTokens", "qwen_vision_tokens"]


@dataclass(frozen=True)
class QwenVisionTokens:
    """What Qwen's chat templates write for one image, `<|vision_start|><|image_pad|>
    <|vision_end|>`, as ids; `image` is repeated once per merged patch."""

    image: int
    start: int
    end: int
    video: int | None


# (config.json names, in order of preference; the tokenizer's special token)
_FIELDS: dict[str, tuple[tuple[str, ...], str]] = {
    "image": (("image_token_id", "image_token_index"), "<|image_pad|>"),
    "start": (("vision_start_token_id",), "<|vision_start|>"),
    "end": (("vision_end_token_id",), "<|vision_end|>"),
    "video": (("video_token_id", "video_token_index"), "<|video_pad|>"),
}


def qwen_vision_tokens(
    config: Mapping[str, Any], vocab: Mapping[str, int], where: str
) -> QwenVisionTokens:
    """The ids for `config` (config.json) and `vocab` (the tokenizer's token → id, added
    tokens included). Raises ModelLoadError naming the field when neither has one."""
    found: dict[str, int | None] = {}
    for field, (names, token) in _FIELDS.items():
        found[field] = _from_config(config, names)
        if found[field] is None:
            found[field] = vocab.get(token)
        if found[field] is None and field != "video":
            raise ModelLoadError(
                f"{where}: config.json has no {' or '.join(names)} and the tokenizer has no "
                f"{token} token, so images cannot be placed in the prompt; add "
                f'"{names[0]}": <the id of {token}> to config.json'
            )
    image, start, end = found["image"], found["start"], found["end"]
    assert image is not None and start is not None and end is not None
    return QwenVisionTokens(image, start, end, found["video"])


def _from_config(config: Mapping[str, Any], names: tuple[str, ...]) -> int | None:
    text = config.get("text_config")
    for source in (config, text if isinstance(text, Mapping) else {}):
        for name in names:
            value = source.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
    return None
