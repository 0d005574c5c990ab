"""GGUF files of every supported family (models/gguf_families/): a tiny random model of the
mlx-lm class, written as an mlx-lm directory (the reference, read by mlx-lm's own loader) and
as a GGUF laid out as llama.cpp's converter writes it (tests/tiny_gguf.py), must give the
directory's logits. Quantized files are compared with a directory holding the weights the
`gguf` package dequantizes from the same quantization."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx.nn.layers.quantized import QuantizedEmbedding, QuantizedLinear
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from mlx_lm.utils import load_model

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.gguf import load_gguf
from compat_serve.models.gguf_header import read_tensor_table
from compat_serve.models.weight_estimate import estimate_weight_bytes
from tests.tiny_gguf import CASES, small_tokenizer_fields, write_case
from tests.tiny_gguf_kquants import write_k_quant_case

# 40 tokens: past gemma3's 24-token sliding window, so a wrong window or pattern shows.
TOKENS = mx.array([[1, 50, 34, 28, 46, 31, 70, 30, 216, 198] * 4])
# Dense float32 loads: the loader's weights are the directory's bit for bit (measured
# max |Δlogit| 0.0 for every family and type); 1e-5 leaves room for another BLAS.
DENSE_TOL = 1e-5
# Weights kept quantized run MLX's quantized kernels with the file's float16 scales
# against the float32 reference: measured up to 2.3e-2 on logits of magnitude ~4 (Gemma's
# sqrt(hidden) embedding scale and soft-capping make its logits the largest).
QUANTIZED_REL_TOL = 1e-2

TYPES_PER_FAMILY = ["F32", "Q8_0", "Q4_0"]
MORE_TYPES = [
    ("qwen3", "F16"),
    ("qwen3", "BF16"),
    ("gemma3", "BF16"),
    ("qwen3", "Q4_1"),
    ("gemma3", "Q4_1"),
    ("deepseek2", "Q4_1"),
]


@pytest.fixture(scope="module")
def tokenizer() -> dict[str, Any]:
    return small_tokenizer_fields()


def _max_delta(a: mx.array, b: mx.array) -> float:
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())


@pytest.mark.parametrize(
    ("case", "qtype"),
    [(c, q) for c in CASES for q in TYPES_PER_FAMILY] + MORE_TYPES,
)
def test_gguf_gives_the_directorys_logits(
    tmp_path: Path, tokenizer: dict[str, Any], case: str, qtype: str
) -> None:
    ref_dir, path = write_case(tmp_path, case, qtype, tokenizer)
    reference, _ = load_model(ref_dir)
    loaded = load_gguf(str(path))
    assert loaded.model_type == CASES[case].model_type
    assert loaded.dtype == "float32"
    expected = reference(TOKENS)
    assert _max_delta(loaded.model(TOKENS), expected) <= DENSE_TOL


def test_ollama_gemma3_with_its_vision_tower(tmp_path: Path, tokenizer: dict[str, Any]) -> None:
    """Ollama's Gemma 3 files hold the vision tower (`v.*`, `mm.*`) and name the rope bases
    `rope.global/local.freq_base`: the text model loads, the tower is left out."""
    bases = {"rope_theta": 500_000.0, "rope_local_base_freq": 20_000.0}  # not the defaults
    ref_dir, path = write_case(tmp_path, "gemma3", "Q8_0", tokenizer, ollama=True, overrides=bases)
    assert "v.blk.0.attn_q.weight" in {t.name for t in read_tensor_table(str(path))}
    reference, _ = load_model(ref_dir)
    loaded = load_gguf(str(path))
    config = loaded.extra["config"]
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (500_000.0, 20_000.0)
    assert _max_delta(loaded.model(TOKENS), reference(TOKENS)) <= DENSE_TOL


@pytest.mark.parametrize(
    ("case", "qtype"),
    [("qwen3", "Q4_0"), ("gemma3", "Q8_0"), ("qwen3moe", "Q4_1"), ("deepseek2", "Q4_0")],
)
def test_quantized_dtype_keeps_the_files_quantization(
    tmp_path: Path, tokenizer: dict[str, Any], case: str, qtype: str
) -> None:
    ref_dir, path = write_case(tmp_path, case, qtype, tokenizer)
    reference, _ = load_model(ref_dir)
    loaded = load_gguf(str(path), dtype="quantized")
    bits = 8 if qtype == "Q8_0" else 4
    assert loaded.dtype == f"quantized-{bits}bit"
    modules = [m for _, m in loaded.model.named_modules()]

    def has(kind: type) -> bool:  # the embedding is a float32-output subclass
        return any(isinstance(m, kind) for m in modules)

    assert has(QuantizedLinear) and has(QuantizedEmbedding)
    if case == "qwen3moe":
        assert has(QuantizedSwitchLinear)
    expected = reference(TOKENS)
    scale = float(mx.abs(expected).max())
    assert _max_delta(loaded.model(TOKENS), expected) <= QUANTIZED_REL_TOL * scale


def test_convert_gguf_writes_a_directory_mlx_lm_loads(
    tmp_path: Path, tokenizer: dict[str, Any]
) -> None:
    import mlx_lm

    from compat_serve.models.convert import convert_gguf

    # Gemma 3: the +1 norms undone, q/k norms, the sliding-window pattern in config.json.
    ref_dir, path = write_case(tmp_path / "gemma3", "gemma3", "Q8_0", tokenizer)
    out = convert_gguf(str(path), str(tmp_path / "gemma3-f32"), dtype="float32")
    model = mlx_lm.load(str(out))[0]
    reference, _ = load_model(ref_dir)
    assert _max_delta(model(TOKENS), reference(TOKENS)) <= DENSE_TOL

    # DeepSeek's MLA split kept quantized: mlx-lm's own loader takes embed_q/unembed_out.
    ref_dir, path = write_case(tmp_path / "ds", "deepseek2", "Q4_0", tokenizer)
    out = convert_gguf(str(path), str(tmp_path / "ds-q"), dtype="quantized")
    model = mlx_lm.load(str(out))[0]
    reference, _ = load_model(ref_dir)
    expected = reference(TOKENS)
    scale = float(mx.abs(expected).max())
    assert _max_delta(model(TOKENS), expected) <= QUANTIZED_REL_TOL * scale


def _one_tensor_gguf(path: Path, qtype: gguf.GGMLQuantizationType, raw: np.ndarray) -> Path:
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Q4_K_M/Q5_K_M files (llama.cpp's K-quants; Q5_0 where a row is not 256-aligned, as in
# Gemma 3 270M), read from the file's bytes (models/gguf_tensors.py): dense, the directory's
# values bit for bit; kept quantized, MLX layouts whose sub-block scales round to float16.
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q5_0"])
@pytest.mark.parametrize("dtype", [None, "quantized"])
def test_k_quant_models_give_the_directorys_logits(
    tmp_path: Path, tokenizer: dict[str, Any], dtype: str | None, name: str
) -> None:
    ref_dir, path = write_k_quant_case(tmp_path, name, tokenizer)
    reference, _ = load_model(ref_dir)
    loaded = load_gguf(str(path), dtype=dtype)
    bits = {"Q4_K": 4, "Q5_K": 5, "Q5_0": 5}[name]
    assert loaded.dtype == (f"quantized-{bits}bit" if dtype else "float32")
    # The memory estimate is what this load made.
    loaded_bytes = sum(int(a.nbytes) for _, a in tree_flatten(loaded.model.parameters()))
    assert estimate_weight_bytes(str(path), dtype) == loaded_bytes
    expected = reference(TOKENS)
    if dtype is None:
        assert _max_delta(loaded.model(TOKENS), expected) <= DENSE_TOL
        return
    scale = float(mx.abs(expected).max())
    assert _max_delta(loaded.model(TOKENS), expected) <= QUANTIZED_REL_TOL * scale


# IQ2_XXS/IQ3_S (lattice codebooks) and TQ1_0 (ternary) have no MLX layout: each is refused
# by name, in one line, before any tensor is read.
@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ3_S", "TQ1_0"])
def test_types_without_a_reader_are_refused_in_one_line(tmp_path: Path, name: str) -> None:
    qtype = gguf.GGMLQuantizationType[name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((8, 512 // block * size), np.uint8)
    path = _one_tensor_gguf(tmp_path / f"{name}.gguf", qtype, raw)
    with pytest.raises(ModelLoadError) as err:
        load_gguf(str(path))
    message = str(err.value)
    assert "\n" not in message
    assert f"tensor blk.0.attn_q.weight stored as {name}, a GGUF type compat-serve cannot read" in (
        message
    )
    assert "llama-quantize --allow-requantize IN.gguf OUT.gguf Q8_0" in message


def test_unsupported_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    path = tmp_path / "rwkv.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv7")
    writer.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError) as err:
        load_gguf(str(path))
    assert str(err.value).endswith(
        "GGUF architecture 'rwkv7' is not supported (supported: deepseek2, gemma2, gemma3, "
        "glm4moe, llama, phi3, qwen2, qwen3, qwen3moe); serve the original weights as an "
        "MLX/HF model directory instead"
    )


@pytest.fixture(scope="module")
def models_dir_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from compat_serve.bootstrap import ServeOptions
    from compat_serve.serve_models import ModelFlags, build_hub
    from compat_serve.server.app import create_app
    from tests.conftest import run_app

    root = tmp_path_factory.mktemp("ggufs")
    fields = small_tokenizer_fields()
    for case, qtype, file in (
        ("qwen3", "Q4_0", "Qwen3-tiny-Q4_0.gguf"),
        ("gemma2", "Q8_0", "gemma-2-tiny.Q8_0.gguf"),
    ):
        _, path = write_case(tmp_path_factory.mktemp(case), case, qtype, fields)
        path.rename(root / file)
    iq2 = gguf.GGMLQuantizationType.IQ2_XXS
    block, size = gguf.GGML_QUANT_SIZES[iq2]
    _one_tensor_gguf(
        root / "Qwen3-tiny-IQ2_XXS.gguf", iq2, np.zeros((8, 512 // block * size), np.uint8)
    )
    hub = build_hub(ServeOptions(), ModelFlags(models_dir=str(root)))
    running = run_app(create_app(hub), hub)
    yield running.base_url
    running.stop()


def test_models_dir_lists_and_serves_family_ggufs(models_dir_server: str) -> None:
    base = models_dir_server
    ids = [card["id"] for card in httpx.get(f"{base}/v1/models").json()["data"]]
    assert ids == ["Qwen3-tiny-IQ2_XXS", "Qwen3-tiny-Q4_0", "gemma-2-tiny.Q8_0"]
    for model in ("Qwen3-tiny-Q4_0", "gemma-2-tiny.Q8_0"):
        reply = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["model"] == model
        assert body["usage"]["completion_tokens"] >= 1

    # A file of a type compat-serve cannot read is listed, and a request for it gets the one-line
    # refusal (the hub's load-failure policy: 500 on the failed load, 400 after).
    reply = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "Qwen3-tiny-IQ2_XXS", "messages": [{"role": "user", "content": "Hi"}]},
        timeout=120,
    )
    assert reply.status_code == 500  # the first request: the failed load itself
    message = reply.json()["error"]["message"]
    assert "stored as IQ2_XXS, a GGUF type compat-serve cannot read" in message
    assert "llama-quantize" in message


def test_an_ollama_store_serves_its_blobs_to_the_ollama_client(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`--models-dir ~/.ollama/models`: Ollama names its GGUF files by digest, with no
    suffix, behind manifests; the Ollama client lists and chats with them by Ollama's names."""
    import json

    import ollama

    from compat_serve.bootstrap import ServeOptions
    from compat_serve.serve_models import ModelFlags, build_hub
    from compat_serve.server.app import create_app
    from tests.conftest import run_app

    store = tmp_path_factory.mktemp("ollama") / "models"
    (store / "blobs").mkdir(parents=True)
    _, path = write_case(
        tmp_path_factory.mktemp("qwen3"), "qwen3", "Q8_0", small_tokenizer_fields()
    )
    path.rename(store / "blobs" / "sha256-0123abcd")
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "qwen3-tiny" / "q8"
    manifest.parent.mkdir(parents=True)
    layer = {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:0123abcd"}
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [layer]}))

    hub = build_hub(ServeOptions(), ModelFlags(models_dir=str(store.parent)))
    running = run_app(create_app(hub), hub)
    try:
        client = ollama.Client(host=running.base_url)
        [listed] = client.list().models
        assert listed.model == "qwen3-tiny:q8"
        assert listed.details is not None and listed.details.format == "gguf"
        reply = client.chat(
            model="qwen3-tiny:q8",
            messages=[{"role": "user", "content": "Hi"}],
            options={"num_predict": 4},
        )
        assert reply.model == "qwen3-tiny:q8"
        assert reply.eval_count and reply.eval_count >= 1
    finally:
        running.stop()
