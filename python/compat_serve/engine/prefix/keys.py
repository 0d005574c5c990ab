"""Keys and small helpers of the prefix cache's index (rank 0): parent keys, image
blocks, and cache-creation counting."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from compat_serve.engine.sequence import Sequence

# Parent id of snapshot files: never a digest, so never anyone's child.
SNAPSHOTS = "snapshots"


def snapshot_key(block_hash: bytes) -> str:
    return "s" + block_hash.hex()


Images = list[tuple[int, int, bytes]] | None


# Disk entries of blocks an image starts in are filed under a parent no lookup by token
# ids asks for (whole-block lookups go by hash).
IMAGE_PARENT = b"image:"


def starts_image(seq: Sequence, i: int, block_size: int) -> bool:
    """Whether an image starts in block `i` of `seq`. Such a block is never matched as a
    child by token ids: image placeholder ids are the same for every image (and a
    text-only prompt could spell them), only its hash tells images apart."""
    vision = seq.request.vision
    at = vision.first_image_at_or_after(i * block_size) if vision is not None else None
    return at is not None and at < (i + 1) * block_size


def images_of(seq: Sequence) -> Images:
    """The request's images as the block hasher's per-block keys (None: text only)."""
    vision = seq.request.vision
    return vision.cache_keys() if vision is not None else None


def root_key(salt: bytes | None) -> bytes:
    return b"root:" + (salt or b"")


def count_written(seq: Sequence, start: int, end: int) -> None:
    """Positions `[start, end)` were newly stored: count its prompt tokens the request did
    not read from the cache as cache creation (so read + creation never exceeds the
    prompt)."""
    seq.cache_written += max(0, min(end, seq.prompt_len) - max(start, seq.cached_tokens))
