"""Vision-language models: mlx-vlm's model classes and torch-free image processors, driven
step by step by compat-serve's engine (never mlx-vlm's generator, server or cache).

A model directory whose config.json has a `vision_config` loads here when mlx-vlm is
installed (`compat-serve[vision]`) and the architecture is supported; the engine then
sees a `VisionLanguageModel`: called like an mlx-lm model on token ids (text rows:
positions from each row's cache offset plus its M-RoPE delta), or on input embeddings
with explicit positions (image rows, built by the runner from `engine/vision.py`).
Caches are mlx-lm's own (`make_prompt_cache` over `.layers`), so the prefix cache,
snapshots and batching work unchanged. Nothing here keeps per-request state on the model
(mlx-vlm's language model caches rope deltas on itself; we always pass positions).

Only this module and `engine/vision.py` import mlx_vlm, lazily: the text-only install
never imports it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module

from compat_serve._native import image_hash
from compat_serve.models.context_length import context_length_from_config
from compat_serve.models.errors import ModelLoadError
from compat_serve.models.types import LoadedModel
from compat_serve.models.vision_input import ImageSpan, VisionInput
from compat_serve.models.vision_tokens import QwenVisionTokens, qwen_vision_tokens
from compat_serve.models.vlm_config import mlx_vlm_readable_dir

__all__ = [
    "SUPPORTED_VLM_TYPES",
    "PreparedImage",
    "VisionLanguageModel",
    "VisionProcessor",
    "load_vlm_dir",
    "vision_architecture",
]

log = logging.getLogger(__name__)

# mlx-vlm model types driven here: Qwen2/2.5/3-VL (M-RoPE positions; Qwen3-VL adds
# DeepStack features to its first language layers) and Idefics3/SmolVLM (a Llama language
# model; images split into tiles or not, as the checkpoint says).
QWEN_VL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})
IDEFICS3_TYPES = frozenset({"idefics3", "smolvlm"})
SUPPORTED_VLM_TYPES = QWEN_VL_TYPES | IDEFICS3_TYPES


def vision_architecture(config: dict[str, Any]) -> str | None:
    """The model type when `config` describes a vision-language model, else None."""
    if not isinstance(config.get("vision_config"), dict):
        return None
    return str(config.get("model_type", ""))


class VisionLanguageModel(Module):
    """The language model of an mlx-vlm model, called the way the engine calls models.

    `model(inputs[B, L], cache=...)` returns logits `[B, L, vocab]`;
    `input_embeddings` (`[B, L, D]`) replaces the token embeddings (image rows). Qwen-VL
    (M-RoPE): positions are, per row, the cache offset (a `BatchKVCache` has one per row)
    plus `rope_deltas[row]` on all three axes, or `positions` (`[3, B, L]`). Other
    architectures take positions from the cache offset alone."""

    def __init__(self, vlm: Module) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.vlm = vlm
        self.mrope = hasattr(vlm.language_model, "get_rope_index")

    @property
    def _text(self) -> Any:
        lm = self.vlm.language_model
        return lm.model if self.mrope else lm

    @property
    def layers(self) -> list[Any]:
        layers: list[Any] = self._text.layers
        return layers

    def embed(self, inputs: mx.array) -> mx.array:
        out: mx.array = self._text.embed_tokens(inputs)
        return out

    def encode_image(self, pixel_values: Any, grid: tuple[int, int, int]) -> mx.array:
        """The vision tower's features of one image: `[tokens, levels, hidden]`. Level 0
        replaces the image tokens' embeddings; levels 1.. (Qwen3-VL's DeepStack) are added
        to the hidden states after language layers 0, 1, ... at the same positions."""
        if not self.mrope:
            return self._encode_idefics3(pixel_values)[:, None, :]
        tower = self.vlm.vision_tower
        pixels = mx.array(pixel_values).astype(tower.patch_embed.proj.weight.dtype)
        out = tower(pixels, mx.array([list(grid)]), output_hidden_states=False)
        if isinstance(out, tuple):  # Qwen3-VL: (features, [DeepStack features per level])
            features, deepstack = out
            return mx.stack([features, *deepstack], axis=1)
        stacked: mx.array = out[:, None, :]
        return stacked

    def _encode_idefics3(self, inputs: dict[str, Any]) -> mx.array:
        """mlx-vlm's Idefics3 image path: patches the pixel mask covers, the encoder, the
        pixel-shuffle connector."""
        pixels = mx.array(inputs["pixel_values"])  # [tiles, C, H, W]
        mask = mx.array(inputs["pixel_attention_mask"]).astype(mx.bool_)  # [tiles, H, W]
        size = int(self.vlm.config.vision_config.patch_size)
        tiles, height, width = mask.shape
        rows, cols = height // size, width // size
        patches = mask[:, : rows * size, : cols * size].reshape(tiles, rows, size, cols, size)
        patch_mask = patches.transpose(0, 1, 3, 2, 4).sum(axis=(-1, -2)) > 0
        pooled, *_ = self.vlm.vision_model(
            pixels.transpose(0, 2, 3, 1), patch_attention_mask=patch_mask, output_hidden_states=True
        )
        features = self.vlm.connector(pooled.astype(pixels.dtype))
        out: mx.array = features.reshape(-1, features.shape[-1])
        return out

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        *,
        input_embeddings: mx.array | None = None,
        positions: mx.array | None = None,
        rope_deltas: Sequence[int] | None = None,
        deepstack: tuple[mx.array, mx.array] | None = None,
    ) -> mx.array:
        """`deepstack` (Qwen3-VL image rows): the `[1, L]` mask of the image positions
        and their features per DeepStack level, `[levels, positions, hidden]`."""
        lm = self.vlm.language_model
        if not self.mrope:
            out = lm(inputs, inputs_embeds=input_embeddings, cache=cache)
            logits: mx.array = out.logits
            return logits
        rows, length = inputs.shape[0], inputs.shape[1]
        if positions is None:
            offset = cache[0].offset if cache else 0
            base = (
                offset.reshape(-1, 1).astype(mx.int32)
                if isinstance(offset, mx.array)
                else mx.full((rows, 1), int(offset), dtype=mx.int32)
            )
            if rope_deltas is not None:
                base = base + mx.array(list(rope_deltas), dtype=mx.int32).reshape(-1, 1)
            grid = base + mx.arange(length, dtype=mx.int32)[None]
            positions = mx.broadcast_to(grid[None], (3, rows, length))
        extra: dict[str, Any] = {}
        if deepstack is not None:
            extra = {"visual_pos_masks": deepstack[0], "deepstack_visual_embeds": deepstack[1]}
        hidden = lm.model(
            inputs, cache=cache, inputs_embeds=input_embeddings, position_ids=positions, **extra
        )
        if lm.args.tie_word_embeddings:
            logits = lm.model.embed_tokens.as_linear(hidden)
        else:
            logits = lm.lm_head(hidden)
        return logits


@dataclass(frozen=True)
class PreparedImage:
    """One image after the model's processor: what the prompt and the encoder need."""

    hash: bytes  # xxh3-128 of the processor settings and the decoded pixels
    num_tokens: int
    pixel_values: Any  # numpy [patches, C * temporal * patch * patch]
    grid: tuple[int, int, int]  # (t, h, w) in patches


class VisionProcessor:
    """Images → pixel values, and rendered prompts → token ids with each image's
    placeholder expanded to its token count (mlx-vlm's processor rule), plus the
    request's `VisionInput` (spans, M-RoPE positions and delta). Pure numpy/PIL in, no
    MLX out: the server calls it off the event loop."""

    def __init__(self, vlm: Module, processor: Any, tokens: QwenVisionTokens) -> None:
        self._vlm = vlm
        self.image_processor = processor.image_processor
        self.image_token_id = tokens.image
        self.merge = int(vlm.config.vision_config.spatial_merge_size)
        tok = processor.tokenizer
        start, pad, end = tok.convert_ids_to_tokens([tokens.start, tokens.image, tokens.end])
        # What the chat template writes for one image (every Qwen-VL template).
        self.image_markup = f"{start}{pad}{end}"
        settings = {
            k: getattr(self.image_processor, k, None)
            for k in (
                "patch_size",
                "temporal_patch_size",
                "merge_size",
                "min_pixels",
                "max_pixels",
                "image_mean",
                "image_std",
                "rescale_factor",
            )
        }
        self._settings = json.dumps(settings, sort_keys=True, default=str).encode()

    def prepare(self, image: Any) -> PreparedImage:
        """A decoded PIL image (RGB) through the model's image processor."""
        rgb = image.convert("RGB") if image.mode != "RGB" else image
        out = self.image_processor(images=[rgb])
        grid = tuple(int(v) for v in np.asarray(out["image_grid_thw"])[0])
        digest = image_hash(self._settings + f"|{rgb.width}x{rgb.height}|".encode() + rgb.tobytes())
        tokens = grid[0] * grid[1] * grid[2] // (self.merge * self.merge)
        return PreparedImage(
            digest, int(tokens), np.asarray(out["pixel_values"]), (grid[0], grid[1], grid[2])
        )

    def expand(
        self, token_ids: Sequence[int], images: Sequence[PreparedImage]
    ) -> tuple[list[int], VisionInput]:
        """Each image-placeholder id of `token_ids` (one per image, in order) becomes the
        image's tokens. Raises ValueError when the counts disagree."""
        ids, spans = _splice_images(token_ids, images, self.image_token_id, self._image_tokens)
        positions, delta = self._positions(ids, images)
        return ids, VisionInput(spans, positions, delta)

    def _image_tokens(self, image: PreparedImage, start: int) -> tuple[list[int], list[ImageSpan]]:
        """One image as its run of placeholder ids, one span over the run."""
        span = ImageSpan(start, image.num_tokens, image.hash, image.pixel_values, image.grid)
        return [self.image_token_id] * image.num_tokens, [span]

    def _positions(self, ids: list[int], images: Sequence[PreparedImage]) -> tuple[np.ndarray, int]:
        """mlx-vlm's own M-RoPE index for the prompt: `[3, len]` positions and the delta
        every later position gets (max position + 1 - length)."""
        if not images:
            return np.tile(np.arange(len(ids), dtype=np.int32), (3, 1)), 0
        grids = mx.array([list(image.grid) for image in images])
        positions, deltas = self._vlm.language_model.get_rope_index(
            mx.array([ids]), image_grid_thw=grids
        )
        return np.asarray(positions[:, 0, :]).astype(np.int32), int(deltas.reshape(-1)[0].item())


class Idefics3Processor:
    """`VisionProcessor` for Idefics3/SmolVLM. An image is split into tiles (or not, as
    the checkpoint's image processor says) and written as mlx-vlm's processor writes it:
    per tile `<fake><row_i_col_j>` and its `<image>` tokens, then `<fake><global-img>`,
    the global tile's tokens and `<fake>`. Each tile's run of `<image>` tokens is one
    span with its own pixels and hash (image hash + tile), encoded on its own (tiles go
    through the encoder independently). Positions are plain (a Llama language model)."""

    def __init__(self, vlm: Module, processor: Any) -> None:
        from mlx_vlm.models.idefics3.processing_idefics3 import get_image_prompt_string

        self._prompt_string: Any = get_image_prompt_string
        self.image_processor = processor.image_processor
        self.tokenizer = processor.tokenizer
        self.image_token_id = int(vlm.config.image_token_id)
        self.image_seq_len = int(processor.image_seq_len)
        self.image_markup = str(processor.image_token)
        self._around = str(processor.fake_image_token)
        self._global = str(processor.global_image_tag)
        self._settings = _settings(self.image_processor, self.image_seq_len)

    def prepare(self, image: Any) -> PreparedImage:
        rgb = image.convert("RGB") if image.mode != "RGB" else image
        out = self.image_processor([[rgb]], return_row_col_info=True, return_tensors="np")
        rows = int(out.get("rows", [[0]])[0][0])
        cols = int(out.get("cols", [[0]])[0][0])
        pixels = np.asarray(out["pixel_values"])[0]  # [tiles, C, H, W]
        masks = np.asarray(out["pixel_attention_mask"])[0]  # [tiles, H, W]
        tiles = [
            {"pixel_values": pixels[t : t + 1], "pixel_attention_mask": masks[t : t + 1]}
            for t in range(pixels.shape[0])
        ]
        digest = image_hash(self._settings + f"|{rgb.width}x{rgb.height}|".encode() + rgb.tobytes())
        layout = {"tiles": tiles, "rows": rows, "cols": cols}
        return PreparedImage(digest, len(tiles) * self.image_seq_len, layout, (1, rows, cols))

    def expand(
        self, token_ids: Sequence[int], images: Sequence[PreparedImage]
    ) -> tuple[list[int], VisionInput]:
        ids, spans = _splice_images(token_ids, images, self.image_token_id, self._image_tokens)
        positions = np.tile(np.arange(len(ids), dtype=np.int32), (3, 1))
        return ids, VisionInput(spans, positions, 0)

    def _image_tokens(self, image: PreparedImage, start: int) -> tuple[list[int], list[ImageSpan]]:
        """One image as mlx-vlm's markup of its tiles, one span per tile's run of image
        tokens."""
        layout = image.pixel_values
        text = self._prompt_string(
            layout["rows"],
            layout["cols"],
            self.image_seq_len,
            fake_token_around_image=self._around,
            image_token=self.image_markup,
            global_img_token=self._global,
        )
        markup: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        runs = _runs(markup, self.image_token_id)
        if len(runs) != len(layout["tiles"]):
            raise ValueError(f"{len(runs)} image token runs for {len(layout['tiles'])} tiles")
        spans = [
            ImageSpan(
                start + offset,
                length,
                image_hash(image.hash + tile.to_bytes(4, "little")),
                layout["tiles"][tile],
                (1, 0, 0),
            )
            for tile, (offset, length) in enumerate(runs)
        ]
        return markup, spans


def _splice_images(
    token_ids: Sequence[int],
    images: Sequence[PreparedImage],
    placeholder: int,
    image_tokens: Callable[[PreparedImage, int], tuple[list[int], list[ImageSpan]]],
) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """`token_ids` with each `placeholder` id (one per image, in order) replaced by
    `image_tokens(image, start)`: the image's ids and spans, given where they start in the
    result. Raises ValueError when the placeholder and image counts disagree."""
    at = [i for i, t in enumerate(token_ids) if t == placeholder]
    if len(at) != len(images):
        raise ValueError(f"the prompt has {len(at)} image placeholders for {len(images)} images")
    ids: list[int] = []
    spans: list[ImageSpan] = []
    last = 0
    for where, image in zip(at, images, strict=True):
        ids.extend(token_ids[last:where])
        image_ids, image_spans = image_tokens(image, len(ids))
        spans.extend(image_spans)
        ids.extend(image_ids)
        last = where + 1
    ids.extend(token_ids[last:])
    return ids, tuple(spans)


def _runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in `ids`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _settings(image_processor: Any, *extra: Any) -> bytes:
    """What the processor does to pixels, for the image hash."""
    names = sorted(k for k, v in vars(image_processor).items() if not k.startswith("_"))
    settings = {k: getattr(image_processor, k) for k in names}
    return json.dumps([settings, extra], sort_keys=True, default=str).encode()


def use_vision_tokens(vlm: Module, tokens: QwenVisionTokens) -> None:
    """Make mlx-vlm's config (which its M-RoPE index reads) carry the checkpoint's ids,
    not its class defaults."""
    configs = {id(c): c for c in (vlm.config, getattr(vlm.language_model, "config", None))}
    for config in configs.values():
        if config is None:
            continue
        config.image_token_id = tokens.image
        config.vision_start_token_id = tokens.start
        config.vision_end_token_id = tokens.end
        if tokens.video is not None:
            config.video_token_id = tokens.video
        if hasattr(config, "image_token_index"):
            config.image_token_index = tokens.image
            if tokens.video is not None:
                config.video_token_index = tokens.video


def load_vlm_dir(
    model_dir: Path, config: dict[str, Any], *, dtype: str | None, source: str, name: str
) -> LoadedModel | None:
    """Load `model_dir` as a vision-language model; None when it cannot be (mlx-vlm not
    installed, or an architecture this module does not drive): the caller then loads
    its language model with mlx-lm, text-only."""
    model_type = vision_architecture(config)
    if model_type is None:
        return None
    if model_type not in SUPPORTED_VLM_TYPES:
        log.warning(
            "%s: vision model type %r is not supported yet; serving it text-only",
            model_dir,
            model_type,
        )
        return None
    try:
        from mlx_vlm.utils import load_model as vlm_load_model
        from mlx_vlm.utils import load_processor
    except ImportError:
        log.warning(
            "%s has a vision part but mlx-vlm is not installed (pip install "
            "'compat-serve[vision]'); serving it text-only",
            model_dir,
        )
        return None
    from compat_serve.models.hf_tokenizer import load_hf_tokenizer
    from compat_serve.models.load_steps import evaluate_in_slices, run_inline
    from compat_serve.models.weights import (
        cast_floating,
        dequantize_model,
        mx_dtype,
        resolve_dtype,
    )

    plan = resolve_dtype(dtype)
    t0 = time.perf_counter()
    with mlx_vlm_readable_dir(model_dir, config) as readable:
        try:
            vlm = vlm_load_model(readable, lazy=True)
            processor = load_processor(readable, add_detokenizer=False)
        except (ValueError, FileNotFoundError, KeyError, OSError, TypeError) as exc:
            raise ModelLoadError(f"cannot load {model_dir} with mlx-vlm: {exc}") from exc
        dtype_name = "as stored"
        if plan.dense is not None:
            target = mx_dtype(plan.dense)
            dequantize_model(vlm, target)
            cast_floating(vlm, target)
            dtype_name = plan.dense
        vision: VisionProcessor | Idefics3Processor
        if model_type in QWEN_VL_TYPES:
            vocab = processor.tokenizer.get_vocab()
            tokens = qwen_vision_tokens(config, vocab, str(model_dir))
            use_vision_tokens(vlm, tokens)
            vision = VisionProcessor(vlm, processor, tokens)
        else:
            vision = Idefics3Processor(vlm, processor)
        # Before the links go; the whole load is one host slice (engine/host.py).
        run_inline(evaluate_in_slices(vlm, "loading weights", log=log))
    info = load_hf_tokenizer(model_dir, config)
    log.info("vision-language model ready in %.2fs", time.perf_counter() - t0)
    return LoadedModel(
        model=VisionLanguageModel(vlm),
        tokenizer=info.tokenizer,
        chat_template=info.chat_template,
        context_length=context_length_from_config(config, info.tokenizer_config),
        name=name,
        source=source,
        dtype=dtype_name,
        model_type=model_type,
        extra={
            "format": "mlx-vlm-dir",
            "config": config,
            "backend": plan.backend,
            "model_dir": str(model_dir),
            "vision": vision,
            "load_seconds": {"total": time.perf_counter() - t0},
        },
    )
