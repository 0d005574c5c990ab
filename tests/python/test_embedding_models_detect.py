"""Detection of the model kind from a directory, the load's errors, the inputs a model
refuses, and where a load runs its MLX evaluations (#37)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from compat_serve.embeddings import load_embedding_model, load_embedding_model_steps, model_kind
from compat_serve.models.errors import ModelLoadError
from compat_serve.models.load_steps import watch_evaluations
from tests.tiny_embedding_models import TINY_KINDS

if TYPE_CHECKING:
    from compat_serve.embeddings import EmbeddingModel

DirOf = Callable[[str], Path]
ModelOf = Callable[[str], "EmbeddingModel"]

KINDS = {
    "qwen3_embedding": "embedding",
    "bert_embedding": "embedding",
    "modernbert_embedding": "embedding",
    "qwen3_reranker": "reranker",
    "qwen3_reranker_seq_cls": "reranker",
    "bert_cross_encoder": "reranker",
    "xlm_roberta_cross_encoder": "reranker",
    "modernbert_cross_encoder": "reranker",
}


def edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def copy_of(tiny_embedding_dir: DirOf, kind: str, tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(tiny_embedding_dir(kind), tmp_path / name))


def test_every_tiny_directory_is_detected_as_its_kind(tiny_embedding_dir: DirOf) -> None:
    assert set(KINDS) == set(TINY_KINDS)
    assert {kind: model_kind(tiny_embedding_dir(kind)) for kind in KINDS} == KINDS


def test_a_chat_model_is_chat(tiny_embedding_dir: DirOf, tmp_path: Path) -> None:
    # The reranker's files in a directory not named like one: a plain Qwen3ForCausalLM.
    chat = copy_of(tiny_embedding_dir, "qwen3_reranker", tmp_path, "qwen3-tiny-chat")
    assert model_kind(chat) == "chat"
    with pytest.raises(ModelLoadError, match="is a chat model"):
        load_embedding_model(chat)
    edit_json(chat / "config.json", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    assert model_kind(chat) == "chat"
    edit_json(chat / "config.json", architectures=["Qwen3Model"], model_type="qwen3")
    assert model_kind(chat) == "embedding"  # a backbone without its LM head
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert model_kind(gguf) == "chat"
    assert model_kind(tmp_path / "missing") == "chat"


def test_a_causal_lm_with_a_pooling_config_embeds(
    tiny_embedding_dir: DirOf, tmp_path: Path
) -> None:
    chat = copy_of(tiny_embedding_dir, "qwen3_reranker", tmp_path, "qwen3-tiny")
    pooling = tiny_embedding_dir("qwen3_embedding") / "1_Pooling"
    shutil.copytree(pooling, chat / "1_Pooling")
    assert model_kind(chat) == "embedding"
    model = load_embedding_model(chat)
    # A causal LM with the LM head in its files: the head is skipped, not required.
    assert model.kind == "embedding" and model.pooling == "lasttoken" and not model.normalize
    assert model.embed([model.tokenize("the cache")]).shape == (1, model.dimensions)


def test_unsupported_pooling_is_a_clear_error(tiny_embedding_dir: DirOf, tmp_path: Path) -> None:
    model_dir = copy_of(tiny_embedding_dir, "bert_embedding", tmp_path, "weighted")
    edit_json(
        model_dir / "1_Pooling" / "config.json",
        pooling_mode_mean_tokens=False,
        pooling_mode_weightedmean_tokens=True,
    )
    with pytest.raises(ModelLoadError, match="unsupported pooling"):
        load_embedding_model(model_dir)


def test_an_unsupported_sentence_transformers_module_is_refused(
    tiny_embedding_dir: DirOf, tmp_path: Path
) -> None:
    model_dir = copy_of(tiny_embedding_dir, "bert_embedding", tmp_path, "dense")
    modules = json.loads((model_dir / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (model_dir / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match=r"module sentence_transformers\.models\.Dense"):
        load_embedding_model(model_dir)


def test_a_multi_label_head_is_refused(tiny_embedding_dir: DirOf, tmp_path: Path) -> None:
    model_dir = copy_of(tiny_embedding_dir, "bert_cross_encoder", tmp_path, "nli")
    edit_json(model_dir / "config.json", id2label={"0": "a", "1": "b", "2": "c"})
    with pytest.raises(ModelLoadError, match="3 labels"):
        load_embedding_model(model_dir)


def test_missing_files_are_clear_errors(tiny_embedding_dir: DirOf, tmp_path: Path) -> None:
    no_tokenizer = copy_of(tiny_embedding_dir, "bert_embedding", tmp_path, "no-tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        load_embedding_model(no_tokenizer)
    no_weights = copy_of(tiny_embedding_dir, "bert_embedding", tmp_path, "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \.safetensors"):
        load_embedding_model(no_weights)
    wrong_shape = copy_of(tiny_embedding_dir, "bert_embedding", tmp_path, "wrong-shape")
    edit_json(wrong_shape / "config.json", intermediate_size=48)
    with pytest.raises(ModelLoadError, match="do not match the config"):
        load_embedding_model(wrong_shape)
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_embedding_model(tmp_path)


def test_inputs_a_model_cannot_take_are_value_errors(tiny_embedding_model: ModelOf) -> None:
    model = tiny_embedding_model("bert_embedding")
    assert model.max_tokens == 48  # sentence_bert_config.json's max_seq_length, under 64
    ok = model.tokenize("the cache")
    with pytest.raises(ValueError, match=r"49 tokens; .* at most 48"):
        model.embed([ok, ok[:1] * 49])
    with pytest.raises(ValueError, match=f"token id {model.vocab_size} is outside"):
        model.embed([[2, model.vocab_size, 3]])
    with pytest.raises(ValueError, match="no tokens"):
        model.embed([ok, []])
    with pytest.raises(ValueError, match="empty batch"):
        model.embed([])
    with pytest.raises(TypeError, match="not a reranker"):
        model.score([ok])
    with pytest.raises(TypeError, match="not a reranker"):
        model.pair_tokens("q", "d")
    reranker = tiny_embedding_model("bert_cross_encoder")
    with pytest.raises(TypeError, match="not an embedding model"):
        reranker.embed([ok])


def test_max_tokens_follow_each_family(tiny_embedding_model: ModelOf) -> None:
    # XLM-R numbers positions from pad_token_id + 1: 66 positions hold 64 tokens.
    assert tiny_embedding_model("xlm_roberta_cross_encoder").max_tokens == 64
    assert tiny_embedding_model("bert_cross_encoder").max_tokens == 64
    assert tiny_embedding_model("qwen3_reranker").max_tokens == 4096


@pytest.mark.parametrize("kind", ["bert_embedding", "qwen3_reranker"])
def test_every_load_evaluation_runs_in_a_host_step(kind: str, tiny_embedding_dir: DirOf) -> None:
    """A multi-model server runs host steps on its engine thread: no MLX evaluation may
    happen in a WORKER step."""
    steps = load_embedding_model_steps(tiny_embedding_dir(kind))
    slices: list[tuple[bool, int]] = []
    with watch_evaluations() as seen:
        on_host = False  # the code before the first yield runs on the caller's thread
        try:
            while True:
                before = len(seen)
                step = next(steps)
                slices.append((on_host, len(seen) - before))
                on_host = step.on_host
        except StopIteration as stop:
            slices.append((on_host, len(seen) - before))
            model = stop.value
    assert model.kind == KINDS[kind]
    assert sum(n for _, n in slices) > 0
    assert all(on_host for on_host, n in slices if n)
    assert model.weight_bytes() > 0


def test_a_quantized_decoder_embedding_model_loads_quantized_and_dense(
    tiny_embedding_dir: DirOf, tiny_embedding_model: ModelOf, tmp_path: Path
) -> None:
    """An mlx-community style 4-bit conversion (quantization in config.json, `model.`
    names, packed weights): kept quantized on request (the users' path on Metal/CUDA),
    dequantized to float32 by default on the CPU; both embed alike."""
    import mlx.core as mx
    from mlx.nn.layers.quantized import quantize
    from mlx.utils import tree_flatten

    from compat_serve.embeddings.loader import has_quantized_layers
    from tests.python.embedding_reference import qwen3_model

    original = tiny_embedding_dir("qwen3_embedding")
    model_dir = copy_of(tiny_embedding_dir, "qwen3_embedding", tmp_path, "Qwen3-Embedding-4bit")
    backbone = qwen3_model(original).model
    quantize(backbone, group_size=32, bits=4)
    assert has_quantized_layers(backbone)
    weights = {f"model.{k}": v for k, v in tree_flatten(backbone.parameters())}
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights)
    edit_json(model_dir / "config.json", quantization={"group_size": 32, "bits": 4})

    stored = load_embedding_model(model_dir, dtype="quantized")
    dense = load_embedding_model(model_dir, dtype="float32")
    assert has_quantized_layers(stored.module) and not has_quantized_layers(dense.module)
    rows = [stored.tokenize(t) for t in ("the cache", "find the function in rust")]
    quantized_out, dense_out = stored.embed(rows), dense.embed(rows)
    assert float(mx.abs(quantized_out - dense_out).max()) < 1e-4
    # The 4-bit weights really differ from the float32 original's.
    full = tiny_embedding_model("qwen3_embedding").embed(rows)
    assert float(mx.abs(dense_out - full).max()) > 1e-4
