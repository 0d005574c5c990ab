"""Images in chat requests: what the API adapters record (`ImageRef`), the marker that
holds an image's place in message text until the prompt is rendered, and decoding and
validation with Anthropic's documented limits and messages (both APIs use them).

No MLX here; PIL and httpx are imported only when an image is actually decoded or
fetched (vision-language models only).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass
from typing import Any

MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
MEDIA_TYPES_TEXT = "'image/jpeg', 'image/png', 'image/gif' or 'image/webp'"
MAX_IMAGE_BYTES = 5 * 1024 * 1024  # Anthropic: 5 MB per image (the base64 string)
MAX_DIMENSION = 8000  # Anthropic: pixels per side
MAX_IMAGES = 100  # Anthropic: images per request
URL_TIMEOUT_S = 10.0
_PIL_FORMATS = {"JPEG": "image/jpeg", "PNG": "image/png", "GIF": "image/gif", "WEBP": "image/webp"}

# An image's place in message text: private-use characters no tokenizer sees (the
# markers are replaced by the model's image markup before tokenization).
_OPEN, _CLOSE = "\U000f0000", "\U000f0001"
_MARKER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


class ImageError(ValueError):
    """An image the request cannot use; `param` names where it is."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class ImageRef:
    """An image as the request gave it: base64 data with its declared media type, or a
    URL (http(s), or a `data:` URL). `where` is its path in the request."""

    where: str
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


def marker(index: int) -> str:
    return f"{_OPEN}{index}{_CLOSE}"


def replace_markers(text: str, markup: str, count: int) -> str:
    """Each image marker becomes the model's image markup; they must appear once each,
    in order (a template that drops or repeats message content breaks that)."""
    found = [int(m) for m in _MARKER.findall(text)]
    if found != list(range(count)):
        raise ImageError(
            "messages",
            f"the chat template rendered {len(found)} of {count} images in order; "
            "this model's template cannot place them",
        )
    return _MARKER.sub(markup, text)


def anthropic_image(block: dict[str, Any], where: str) -> ImageRef:
    """An Anthropic `image` block's source, shape-checked."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise ImageError(f"{where}.source", "Field required")
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in MEDIA_TYPES:
            raise ImageError(
                f"{where}.source.base64.media_type", f"Input should be {MEDIA_TYPES_TEXT}"
            )
        if not isinstance(data, str):
            raise ImageError(f"{where}.source.base64.data", "Field required")
        return ImageRef(where, media_type=str(media_type), data=data)
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise ImageError(f"{where}.source.url", "Field required")
        return ImageRef(where, url=url)
    raise ImageError(
        f"{where}.source.type", "Input should be 'base64' or 'url' (files are not supported)"
    )


def url_image(url: str, where: str) -> ImageRef:
    """An OpenAI `image_url` (a `data:` URL or http(s))."""
    if url.startswith("data:"):
        head, sep, data = url.partition(",")
        media_type = head[5:].removesuffix(";base64")
        if not sep or not head.endswith(";base64"):
            raise ImageError(where, "a data URL must be data:<media type>;base64,<data>")
        if media_type not in MEDIA_TYPES:
            raise ImageError(where, f"media type should be {MEDIA_TYPES_TEXT}, not {media_type!r}")
        return ImageRef(where, media_type=media_type, data=data)
    if not url.startswith(("http://", "https://")):
        raise ImageError(where, "image URLs must be http(s) or data: URLs")
    return ImageRef(where, url=url)


def decode_image(ref: ImageRef, raw: bytes | None = None) -> Any:
    """The PIL image of `ref` (base64 data, or `raw` bytes fetched from its URL),
    validated: size, media type, decodability, dimensions. RGB out."""
    from PIL import Image, UnidentifiedImageError

    base = f"{ref.where}.source"
    if raw is None:
        assert ref.data is not None
        if len(ref.data) > MAX_IMAGE_BYTES:
            raise ImageError(
                base, f"image exceeds 5 MB maximum: {len(ref.data)} bytes > {MAX_IMAGE_BYTES} bytes"
            )
        try:
            raw = base64.b64decode(ref.data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageError(f"{base}.base64.data", "invalid base64 data") from exc
    elif len(raw) > MAX_IMAGE_BYTES:
        raise ImageError(
            base, f"image exceeds 5 MB maximum: {len(raw)} bytes > {MAX_IMAGE_BYTES} bytes"
        )
    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"{base}.base64.data", "Could not process image") from exc
    actual = _PIL_FORMATS.get(image.format or "")
    if actual is None:
        raise ImageError(f"{base}.base64.media_type", f"Input should be {MEDIA_TYPES_TEXT}")
    if ref.media_type is not None and actual != ref.media_type:
        raise ImageError(
            f"{base}.base64",
            f"The image was specified using the {ref.media_type} media type, but the image "
            f"appears to be a {actual} image",
        )
    if max(image.size) > MAX_DIMENSION:
        raise ImageError(
            f"{base}.base64.data",
            f"At least one of the image dimensions exceed max allowed size: {MAX_DIMENSION} pixels",
        )
    return image.convert("RGB")


async def fetch_image(ref: ImageRef, timeout_s: float = URL_TIMEOUT_S) -> bytes:
    """GET an image URL with a time limit and a size limit (never more than
    MAX_IMAGE_BYTES read)."""
    import httpx

    assert ref.url is not None
    where = f"{ref.where}.source.url"
    try:
        async with (
            httpx.AsyncClient(timeout=timeout_s, follow_redirects=True) as client,
            client.stream("GET", ref.url) as response,
        ):
            if response.status_code != 200:
                raise ImageError(where, f"fetching the image failed: HTTP {response.status_code}")
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > MAX_IMAGE_BYTES:
                    raise ImageError(
                        f"{ref.where}.source",
                        f"image exceeds 5 MB maximum: more than {MAX_IMAGE_BYTES} bytes",
                    )
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.TimeoutException as exc:
        raise ImageError(where, f"fetching the image timed out after {timeout_s:g}s") from exc
    except httpx.HTTPError as exc:
        raise ImageError(where, f"fetching the image failed: {type(exc).__name__}") from exc


def join_parts(parts: list[str]) -> str:
    """A message's text parts joined with newlines, image markers glued to their
    neighbours (chat templates put an image's markup right next to the text)."""
    out = ""
    for i, part in enumerate(parts):
        if i and not _MARKER.fullmatch(part) and not _MARKER.fullmatch(parts[i - 1]):
            out += "\n"
        out += part
    return out
