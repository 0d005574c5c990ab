"""The image token ids of a Qwen-VL directory (issue #25 item 8): read from config.json in
each version's layout, else from the tokenizer, else a load error naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.loader import load_model
from compat_serve.models.types import LoadedModel
from compat_serve.models.vision_tokens import QwenVisionTokens, qwen_vision_tokens
from tests.tiny_vlm import VISION_TOKENS, write_qwen_vl_dir

VOCAB = {"<|vision_start|>": 900, "<|vision_end|>": 901, "<|image_pad|>": 902, "<|video_pad|>": 903}
IDS = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")


def test_qwen2_vl_layout_reads_the_top_level_ids() -> None:
    config = {"image_token_id": 5, "vision_start_token_id": 6, "vision_end_token_id": 7}
    assert qwen_vision_tokens(config, VOCAB, "d") == QwenVisionTokens(5, 6, 7, 903)


def test_the_index_spelling_and_a_nested_text_config_are_read() -> None:
    config = {
        "image_token_index": 5,
        "video_token_index": 8,
        "text_config": {"vision_start_token_id": 6, "vision_end_token_id": 7},
    }
    assert qwen_vision_tokens(config, VOCAB, "d") == QwenVisionTokens(5, 6, 7, 8)


def test_config_json_wins_over_the_tokenizer_and_fills_from_it() -> None:
    assert qwen_vision_tokens({"image_token_id": 5}, VOCAB, "d") == QwenVisionTokens(
        5, 900, 901, 903
    )
    assert qwen_vision_tokens({}, VOCAB, "d") == QwenVisionTokens(902, 900, 901, 903)


@pytest.mark.parametrize(
    ("field", "token"),
    [
        ("image_token_id or image_token_index", "<|image_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ],
)
def test_a_missing_id_is_a_load_error_naming_the_field(field: str, token: str) -> None:
    vocab = {k: v for k, v in VOCAB.items() if k != token}
    with pytest.raises(
        ModelLoadError, match=re.escape(f"/m: config.json has no {field} and the tokenizer")
    ):
        qwen_vision_tokens({}, vocab, "/m")
    # Without a video token, still loads (images only).
    no_video = {k: v for k, v in VOCAB.items() if k != "<|video_pad|>"}
    assert qwen_vision_tokens({}, no_video, "/m").video is None


def picture() -> Any:
    from PIL import Image

    pixels = np.random.default_rng(1).integers(0, 256, (112, 112, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def test_a_directory_without_ids_in_config_json_reads_them_from_the_tokenizer(
    embedded_model: LoadedModel, tmp_path: Path
) -> None:
    pytest.importorskip("mlx_vlm")
    out = write_qwen_vl_dir(tmp_path / "q2", embedded_model, model_type="qwen2_vl", drop=IDS)
    assert not set(IDS) & set(json.loads((out / "config.json").read_text()))
    loaded = load_model(str(out))
    vision = loaded.extra["vision"]
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    assert vision.image_token_id == added["<|image_pad|>"]
    assert vision.image_markup == "".join(VISION_TOKENS[i] for i in (0, 2, 1))
    # mlx-vlm's M-RoPE index finds the image by these ids (its class defaults, Qwen's
    # 151k ids, are outside this vocabulary): a 4x4-token image shifts later positions.
    ids = loaded.tokenizer.encode(f"<|im_start|>user\n{vision.image_markup}hi<|im_end|>\n")
    _, request = vision.expand(ids, [vision.prepare(picture())])
    assert request.rope_delta == -12


def test_a_directory_missing_vision_end_everywhere_fails_to_load_naming_it(
    embedded_model: LoadedModel, tmp_path: Path
) -> None:
    pytest.importorskip("mlx_vlm")
    out = write_qwen_vl_dir(
        tmp_path / "q2", embedded_model, model_type="qwen2_vl", drop=("vision_end_token_id",)
    )
    tokenizer = out / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace("<|vision_end|>", "<|vision_stop|>"))
    with pytest.raises(ModelLoadError, match=re.escape("config.json has no vision_end_token_id")):
        load_model(str(out))


def test_a_transformers_5_qwen2_vl_config_is_a_load_error_saying_why(
    embedded_model: LoadedModel, tmp_path: Path
) -> None:
    """transformers 5 saves Qwen2/2.5-VL with the text settings only in text_config (and
    rope_parameters), which mlx-vlm's qwen2_vl cannot read: a ModelLoadError, not a
    TypeError from mlx-vlm's config class."""
    pytest.importorskip("mlx_vlm")
    out = write_qwen_vl_dir(tmp_path / "q2", embedded_model, model_type="qwen2_vl")
    flat = json.loads((out / "config.json").read_text())
    text = {k: v for k, v in flat.items() if k != "vision_config" and not k.endswith("token_id")}
    rope = {**text.pop("rope_scaling"), "rope_theta": text.pop("rope_theta")}
    nested = {
        "model_type": "qwen2_vl",
        "architectures": flat["architectures"],
        "text_config": {**text, "rope_parameters": rope},
        "vision_config": flat["vision_config"],
        **{k: v for k, v in flat.items() if k.endswith("token_id")},
    }
    (out / "config.json").write_text(json.dumps(nested))
    with pytest.raises(ModelLoadError, match="only in text_config, as transformers 5 saves"):
        load_model(str(out))
