"""Images in the engine: the vision-encoder feature LRU, and the input embeddings and
positions of a prefill chunk of an image row (what a request carries, `VisionInput`, is
models/vision_input.py's).

The engine sees embeddings and positions, never HTTP or PIL. A chunk may start or end
inside an image: the image's features are computed once (whole image) and sliced. An
image's features are `[tokens, levels, hidden]`: level 0 replaces its tokens' embeddings;
further levels (Qwen3-VL's DeepStack) are added after the first language layers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from compat_serve.models.vision_input import ImageSpan, VisionInput


class ImageEncoder(Protocol):
    def embed(self, inputs: mx.array) -> mx.array: ...

    def encode_image(self, pixel_values: Any, grid: tuple[int, int, int]) -> mx.array:
        """`[tokens, levels, hidden]` features of one image."""
        ...


# Encoder features kept for re-sent images: a real model's image is 1-20 MB of features.
FEATURE_CACHE_BYTES = 256 * 1024 * 1024


class FeatureCache:
    """Vision-encoder features by image hash, least recently used out first (at most
    `max_bytes`), so a turn that re-sends an image whose tokens are not all cached does
    not re-run the encoder."""

    def __init__(self, encoder: ImageEncoder, max_bytes: int = FEATURE_CACHE_BYTES) -> None:
        self._encoder = encoder
        self._max_bytes = max_bytes
        self._features: OrderedDict[bytes, mx.array] = OrderedDict()
        self.bytes_in_use = 0
        self.encoder_runs = 0
        self.hits = 0

    def get(self, span: ImageSpan) -> mx.array:
        found = self._features.get(span.hash)
        if found is not None:
            self._features.move_to_end(span.hash)
            self.hits += 1
            return found
        features = self._encoder.encode_image(span.pixel_values, span.grid)
        mx.eval(features)
        if features.shape[0] != span.length:
            raise ValueError(
                f"the vision encoder gave {features.shape[0]} features for {span.length} "
                "image tokens"
            )
        self.encoder_runs += 1
        self._features[span.hash] = features
        self.bytes_in_use += features.nbytes
        while self.bytes_in_use > self._max_bytes and len(self._features) > 1:
            _, dropped = self._features.popitem(last=False)
            self.bytes_in_use -= dropped.nbytes
        return features

    def render_metrics(self) -> list[str]:
        """Prometheus lines for `/metrics` (EngineMetrics.extra_renderers)."""
        return [
            "# HELP compat_vision_encoder_runs_total Vision-encoder forward passes.",
            "# TYPE compat_vision_encoder_runs_total counter",
            f"compat_vision_encoder_runs_total {self.encoder_runs}",
            "# HELP compat_vision_feature_hits_total Images whose features the LRU served.",
            "# TYPE compat_vision_feature_hits_total counter",
            f"compat_vision_feature_hits_total {self.hits}",
        ]


@dataclass(frozen=True)
class ChunkInputs:
    """What the model takes for one prefill chunk of an image row."""

    ids: mx.array  # [1, L]
    embeddings: mx.array  # [1, L, D]: image features where the chunk overlaps an image
    positions: mx.array  # [3, 1, L] M-RoPE positions
    # DeepStack (Qwen3-VL): the [1, L] mask of image positions and their features per
    # level, [levels, positions, D]; None when the chunk has no image or the model none.
    deepstack: tuple[mx.array, mx.array] | None


def chunk_inputs(
    features: FeatureCache,
    encoder: ImageEncoder,
    vision: VisionInput,
    start: int,
    tokens: Sequence[int],
) -> ChunkInputs:
    """The model's inputs for tokens `[start, start + L)` of an image row."""
    end = start + len(tokens)
    ids = mx.array(list(tokens), dtype=mx.uint32)[None]
    embeddings = encoder.embed(ids)
    mask = np.zeros((1, len(tokens)), dtype=bool)
    deep: list[mx.array] = []
    for span in vision.spans:
        a, b = max(span.start, start), min(span.start + span.length, end)
        if a >= b:
            continue
        image = features.get(span)[a - span.start : b - span.start]
        embeddings[:, a - start : b - start, :] = image[:, 0].astype(embeddings.dtype)[None]
        if image.shape[1] > 1:
            mask[0, a - start : b - start] = True
            deep.append(image[:, 1:].astype(embeddings.dtype))
    prompt_positions = np.asarray(vision.positions)
    prompt_len = prompt_positions.shape[1]
    head = prompt_positions[:, start : min(end, prompt_len)]
    if end > prompt_len:  # a preempted request recomputes generated tokens too
        after = np.arange(max(start, prompt_len), end, dtype=np.int32) + vision.rope_delta
        head = np.concatenate([head, np.tile(after, (3, 1))], axis=1)
    positions = mx.array(head.astype(np.int32))[:, None, :]
    deepstack = None
    if deep:  # spans are in prompt order, as the mask's positions
        deepstack = (mx.array(mask), mx.concatenate(deep, axis=0).transpose(1, 0, 2))
    return ChunkInputs(ids, embeddings, positions, deepstack)
