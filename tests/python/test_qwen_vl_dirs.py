"""Qwen-VL directories as users have them (issue #25 item 8): the image token ids read from
config.json in each version's layout, else from the tokenizer, else a load error naming
the field; config.json as transformers 5 saves it loads as the original does."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.loader import load_model
from compat_serve.models.types import LoadedModel
from compat_serve.models.vision_tokens import QwenVisionTokens, qwen_vision_tokens
from tests.tiny_vlm import VISION_TOKENS, tiny_vlm, write_qwen_vl_dir

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


# Qwen2-VL's layout is rewritten as Qwen2.5-VL's (and has no vision model_type check).
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_a_transformers_5_layout_loads_as_the_flat_one(
    model_type: str, embedded_model: LoadedModel, tmp_path: Path
) -> None:
    """transformers 5 saves the Qwen-VL family with the text settings only in
    text_config, rope_parameters and `<type>_vision`, which mlx-vlm's classes cannot
    read: it loads through a rewritten shadow and computes what the original computes."""
    import mlx.core as mx
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    from compat_serve.engine.runner import ModelRunner

    flat = tiny_vlm(model_type, embedded_model)
    out = tmp_path / model_type
    shutil.copytree(flat.path, out)
    old = json.loads((out / "config.json").read_text())
    ids = {k: v for k, v in old.items() if k in IDS}
    text = old.get("text_config") or {
        k: v for k, v in old.items() if k != "vision_config" and k not in ids
    }
    classes = {"qwen2_vl": Qwen2VLConfig, "qwen2_5_vl": Qwen2_5_VLConfig}
    cls = classes.get(model_type, Qwen3VLConfig)
    saved = cls(text_config=text, vision_config=old["vision_config"], **ids).to_dict()
    assert "hidden_size" not in saved and "rope_parameters" in saved["text_config"]
    assert "mrope_section" in saved["text_config"]["rope_parameters"]
    assert saved["vision_config"]["model_type"] == f"{model_type}_vision"
    (out / "config.json").write_text(json.dumps(saved))

    nested = load_model(str(out))
    assert nested.model_type == model_type
    vision = nested.extra["vision"]
    prompt = f"<|im_start|>user\n{vision.image_markup}Describe.<|im_end|>\n<|im_start|>assistant\n"
    prompt_ids = nested.tokenizer.encode(prompt)
    assert flat.loaded.extra["vision"].image_markup == vision.image_markup
    logits = []
    for loaded in (flat.loaded, nested):
        processor = loaded.extra["vision"]
        full, request = processor.expand(prompt_ids, [processor.prepare(picture())])
        runner = ModelRunner(loaded)
        logits.append(runner.last_logits(runner.new_cache(), full, request, 0))
    assert mx.abs(logits[0]).max().item() > 0.1
    assert mx.abs(logits[0] - logits[1]).max().item() < 1e-5
