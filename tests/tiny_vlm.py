"""Tiny randomly initialised vision-language models (mlx-vlm's own classes) written to a
directory the way a checkpoint looks: config.json with a vision part (as each version's
Hugging Face config.json lays it out), safetensors, preprocessor_config.json (tiny
images: one merged token per 28x28 or 32x32 pixels, at most 16), a real tokenizer (the
embedded SmolLM2 one plus the vision special tokens) and a chat template. Qwen2-VL,
Qwen2.5-VL and Qwen3-VL, and Idefics3 (SmolVLM's architecture). mlx-vlm loads them
offline, and so does compat-serve.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen2-VL's template, shortened: images render as vision_start, image_pad, vision_end.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LM_WEIGHT_SCALE = 6.0
# Qwen3-VL's DeepStack mergers scaled up too: at the default init their features are
# small beside the scaled hidden states, and dropping them would not change the output.
DEEPSTACK_WEIGHT_SCALE = 40.0
PATCH = 14
MERGE = 2
TILE = PATCH * MERGE  # one merged image token per 28x28 pixels


def _qwen_vl_ids(first_vision_id: int) -> dict[str, int]:
    """The vision token ids as Qwen's config.json files write them (top level)."""
    return {
        "vision_start_token_id": first_vision_id,
        "vision_end_token_id": first_vision_id + 1,
        "image_token_id": first_vision_id + 2,
        "video_token_id": first_vision_id + 3,
    }


def _qwen2_text(vocab_size: int) -> dict[str, Any]:
    """Qwen2's language model settings (Qwen2-VL, Qwen2.5-VL: at the top level)."""
    return {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "tie_word_embeddings": True,
    }


def qwen2_vl_config(vocab_size: int, first_vision_id: int) -> dict[str, Any]:
    """Qwen2-VL-2B-Instruct's config.json, shrunk: flat text settings, the vision ids
    (`vision_end_token_id` included, which mlx-vlm's qwen2_vl config class lacks)."""
    return {
        "model_type": "qwen2_vl",
        "architectures": ["Qwen2VLForConditionalGeneration"],
        **_qwen2_text(vocab_size),
        **_qwen_vl_ids(first_vision_id),
        "vision_token_id": first_vision_id + 2,
        "vision_config": {
            "depth": 2,
            "embed_dim": 32,
            "mlp_ratio": 2,
            "num_heads": 2,
            "in_chans": 3,
            "hidden_size": 64,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "spatial_patch_size": PATCH,
            "temporal_patch_size": 2,
        },
    }


def qwen25_vl_config(vocab_size: int, first_vision_id: int) -> dict[str, Any]:
    return {
        "model_type": "qwen2_5_vl",
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        **_qwen2_text(vocab_size),
        **_qwen_vl_ids(first_vision_id),
        "vision_token_id": first_vision_id + 2,
        "vision_config": {
            "model_type": "qwen2_5_vl",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "patch_size": PATCH,
            "spatial_patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "in_channels": 3,
        },
    }


QWEN3_PATCH = 16


def qwen3_vl_config(vocab_size: int, first_vision_id: int) -> dict[str, Any]:
    """Qwen3-VL-2B-Instruct's config.json, shrunk: the text settings nested in
    `text_config`, interleaved M-RoPE, 16 px patches, DeepStack features from the first
    vision block added to the first language layer."""
    return {
        "model_type": "qwen3_vl",
        "architectures": ["Qwen3VLForConditionalGeneration"],
        **_qwen_vl_ids(first_vision_id),
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "qwen3_vl_text",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rms_norm_eps": 1e-6,
            "vocab_size": vocab_size,
            "max_position_embeddings": 4096,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "mrope_interleaved": True,
                "mrope_section": [4, 2, 2],
                "rope_type": "default",
            },
            "tie_word_embeddings": True,
        },
        "vision_config": {
            "model_type": "qwen3_vl",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": QWEN3_PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
    }


def _scale(name: str) -> float:
    if not name.endswith("weight") or "norm" in name:
        return 1.0
    if name.startswith("language_model.") and "embed" not in name:
        return LM_WEIGHT_SCALE
    if name.startswith("vision_tower.deepstack_merger_list.") and "linear_fc2" in name:
        return DEEPSTACK_WEIGHT_SCALE
    return 1.0


def _tokenizer_with(like: LoadedModel, tokens: tuple[str, ...]) -> Any:
    """A copy of `like`'s tokenizer (a `tokenizers.Tokenizer`) with `tokens` added as
    special tokens."""
    from tokenizers import AddedToken

    backend = like.tokenizer.backend.__class__.from_str(like.tokenizer.backend.to_str())
    backend.add_special_tokens([AddedToken(t, special=True) for t in tokens])
    return backend


def _write_model_dir(
    out: Path,
    architecture: Any,
    config: dict[str, Any],
    preprocessor: dict[str, Any],
    *,
    like: LoadedModel,
    tokenizer: Any,
    eos_token: str,
    chat_template: str,
    seed: int,
) -> None:
    """Write to `out` (created) a random model of `architecture` (an mlx-vlm model
    module) for `config`, the image preprocessor's config, and `tokenizer` (from
    `_tokenizer_with`) with `like`'s BOS token, `eos_token` and `chat_template`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import update_module_configs

    out.mkdir(parents=True)
    mx.random.seed(seed)
    # A copy (from_dict writes into it), with a text_config for the architectures whose
    # text settings sit at the top level.
    params = {"text_config": {}, **config}
    model_config = architecture.ModelConfig.from_dict(params)
    model_config = update_module_configs(model_config, architecture, params, ["text", "vision"])
    model = architecture.Model(model_config)
    mx.eval(model.parameters())
    # Projections of the language model scaled up: at the default init a random model
    # repeats one token whatever the input; at this scale its greedy output depends on
    # the prompt and the image.
    weights = {k: v * _scale(k) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": like.tokenizer.bos_token,
        "eos_token": eos_token,
        "pad_token": "<|endoftext|>",
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": chat_template}))
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor))


def qwen3_vl_moe_config(vocab_size: int, first_vision_id: int) -> dict[str, Any]:
    """Qwen3-VL-30B-A3B's layout: Qwen3-VL with mixture-of-experts language layers."""
    config = qwen3_vl_config(vocab_size, first_vision_id)
    config["model_type"] = "qwen3_vl_moe"
    config["architectures"] = ["Qwen3VLMoeForConditionalGeneration"]
    config["vision_config"]["model_type"] = "qwen3_vl_moe"
    config["text_config"].update(
        model_type="qwen3_vl_moe_text",
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=32,
    )
    return config


QWEN_VL_CONFIGS = {
    "qwen2_vl": qwen2_vl_config,
    "qwen2_5_vl": qwen25_vl_config,
    "qwen3_vl": qwen3_vl_config,
    "qwen3_vl_moe": qwen3_vl_moe_config,
}
QWEN_VL_TYPES = tuple(QWEN_VL_CONFIGS)


def qwen_vl_preprocessor(model_type: str) -> dict[str, Any]:
    """preprocessor_config.json as each version's checkpoints have it (tiny images: at
    most 16 merged tokens): Qwen2/2.5-VL bound pixels with min/max_pixels and CLIP's
    mean/std, Qwen3-VL with `size` (shortest/longest edge in pixels) and 0.5/0.5."""
    if model_type.startswith("qwen3_vl"):
        tile = QWEN3_PATCH * MERGE
        return {
            "image_processor_type": "Qwen2VLImageProcessorFast",
            "processor_class": "Qwen3VLProcessor",
            "patch_size": QWEN3_PATCH,
            "merge_size": MERGE,
            "temporal_patch_size": 2,
            "size": {"shortest_edge": tile * tile, "longest_edge": 16 * tile * tile},
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        }
    processor = "Qwen2VLProcessor" if model_type == "qwen2_vl" else "Qwen2_5_VLProcessor"
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor,
        "patch_size": PATCH,
        "merge_size": MERGE,
        "temporal_patch_size": 2,
        "min_pixels": TILE * TILE,
        "max_pixels": 16 * TILE * TILE,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }


def write_qwen_vl_dir(
    out: Path,
    like: LoadedModel,
    *,
    model_type: str = "qwen2_5_vl",
    seed: int = 0,
    drop: tuple[str, ...] = (),
) -> Path:
    """Write a tiny Qwen-VL of `model_type` (a key of QWEN_VL_CONFIGS) to `out`
    (created) with `like`'s tokenizer plus Qwen's vision tokens. `drop`: top-level
    config.json keys to leave out (checkpoints that lack them)."""
    import importlib

    architecture = importlib.import_module(f"mlx_vlm.models.{model_type}")
    backend = _tokenizer_with(like, VISION_TOKENS)
    first = backend.token_to_id(VISION_TOKENS[0])
    vocab = backend.get_vocab_size(with_added_tokens=True)
    config = QWEN_VL_CONFIGS[model_type](vocab, first)
    end = backend.token_to_id("<|im_end|>")
    # Qwen3-VL keeps bos/eos in text_config; the others at the top level.
    ids_at = config.get("text_config", config)
    ids_at["bos_token_id"] = ids_at["eos_token_id"] = end
    _write_model_dir(
        out,
        architecture,
        config,
        qwen_vl_preprocessor(model_type),
        like=like,
        tokenizer=backend,
        eos_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
        seed=seed,
    )
    if drop:
        written = json.loads((out / "config.json").read_text())
        for key in drop:
            written.pop(key, None)
        (out / "config.json").write_text(json.dumps(written, indent=1))
    return out


@dataclass(frozen=True)
class TinyVlm:
    """A tiny VLM directory, loaded by compat-serve and (for references) by mlx-vlm."""

    path: Path
    loaded: LoadedModel
    vlm: Any  # mlx-vlm's model, loaded by mlx-vlm from the same directory
    processor: Any


_TINY_VLMS: dict[tuple[str, int], TinyVlm] = {}


def tiny_vlm(name: str, like: LoadedModel) -> TinyVlm:
    """The tiny VLM `name` (a Qwen-VL type, "idefics3" or "idefics3-tiled"), written once
    per test session to a temporary directory and loaded both ways: the test modules
    share it (engines and servers over one LoadedModel, one after another)."""
    found = _TINY_VLMS.get((name, id(like)))
    if found is not None:
        return found
    from mlx_vlm import load

    from compat_serve.models.loader import load_model

    root = Path(tempfile.mkdtemp(prefix="tiny-vlm-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    out = root / name
    if name in QWEN_VL_CONFIGS:
        write_qwen_vl_dir(out, like, model_type=name)
    else:
        write_idefics3_dir(out, like, split=name == "idefics3-tiled")
    model, processor = load(str(out))
    made = TinyVlm(out, load_model(str(out)), model, processor)
    _TINY_VLMS[(name, id(like))] = made
    return made


def write_qwen25_vl_dir(out: Path, like: LoadedModel, *, seed: int = 0) -> Path:
    """Write the tiny Qwen2.5-VL to `out` (created) with `like`'s tokenizer."""
    return write_qwen_vl_dir(out, like, model_type="qwen2_5_vl", seed=seed)


# SmolVLM / Idefics3: a Llama language model, a SigLIP-style encoder and a pixel-shuffle
# connector; one image (no tiling) is 4 `<image>` tokens between its markers.
IDEFICS3_TOKENS = (
    "<image>",
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)),
)
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
IDEFICS3_IMAGE = 56  # pixels per side after resizing: 4x4 patches, 2x2 after the shuffle


def write_idefics3_dir(out: Path, like: LoadedModel, *, seed: int = 0, split: bool = False) -> Path:
    """Write a tiny random Idefics3 (SmolVLM's architecture) to `out` (created).
    `split`: images up to 112 px are split into 56 px tiles plus the global one (as
    SmolVLM checkpoints do), else resized to one 56 px tile."""
    from mlx_vlm.models import idefics3

    backend = _tokenizer_with(like, IDEFICS3_TOKENS)
    vocab = backend.get_vocab_size(with_added_tokens=True)
    config: dict[str, Any] = {
        "model_type": "idefics3",
        "architectures": ["Idefics3ForConditionalGeneration"],
        "image_token_id": backend.token_to_id("<image>"),
        "scale_factor": 2,
        "vocab_size": vocab,
        "eos_token_id": backend.token_to_id("<end_of_utterance>"),
        "text_config": {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "vocab_size": vocab,
            "max_position_embeddings": 4096,
        },
        "vision_config": {
            "model_type": "idefics3",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "patch_size": 14,
            "image_size": IDEFICS3_IMAGE,
        },
    }
    preprocessor = {
        "image_processor_type": "Idefics3ImageProcessor",
        "processor_class": "Idefics3Processor",
        "do_image_splitting": split,
        "do_resize": True,
        "size": {"longest_edge": 2 * IDEFICS3_IMAGE if split else IDEFICS3_IMAGE},
        "max_image_size": {"longest_edge": IDEFICS3_IMAGE},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    _write_model_dir(
        out,
        idefics3,
        config,
        preprocessor,
        like=like,
        tokenizer=backend,
        eos_token="<end_of_utterance>",
        chat_template=IDEFICS3_TEMPLATE,
        seed=seed,
    )
    (out / "processor_config.json").write_text(
        json.dumps({"image_seq_len": 4, "processor_class": "Idefics3Processor"})
    )
    return out
