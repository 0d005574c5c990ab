"""`--speculative mtp` with the MTP weights a checkpoint ships (engine/mtp_families.py):
DeepSeek-V3/R1, GLM-4.5-4.7, MiMo and Qwen3-Next, from tiny random checkpoints written with
those weights under their real names and shapes (tests/tiny_mtp.py).

The head's one-step logits are checked against the step composed here from vllm's
formula (`deepseek_mtp.py`/`glm4_moe_mtp.py`: `eh_proj(cat(enorm(e), hnorm(h)))`, the
block, `shared_head.norm`; `mimo_mtp.py`: hidden state first, `final_layernorm`;
`qwen3_next_mtp.py`: `fc`, `pre_fc_norm_*`, `norm`), on the decoder layer the weights were
written from; greedy output with the head drafting equals plain decoding.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import pytest
from mlx.nn.layers.quantized import QuantizedLinear
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache

from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.mtp_head import MTPHeadError
from compat_serve.engine.mtp_setup import head_for
from compat_serve.engine.speculation import SpeculationConfig
from compat_serve.engine.types import EngineRequest
from compat_serve.models.loader import load_model
from compat_serve.models.weights import resolve_dtype
from tests.chat_prompts import chat_ids
from tests.greedy_ties import assert_same_or_near_tie
from tests.python.test_batching import greedy
from tests.python.test_speculative import COPY_PROMPTS, outputs, tokens
from tests.tiny_models import write_model_dir
from tests.tiny_mtp import OWN_NAMES, Source, write_mtp_dir

if TYPE_CHECKING:
    from compat_serve.engine.mtp_cache import MTPDrafter
    from compat_serve.models.types import LoadedModel

MAX_TOKENS = 16


def rms(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def reference_step(
    model_type: str, source: Source, main: LoadedModel, hidden: mx.array, tokens: mx.array
) -> tuple[mx.array, mx.array]:
    """One MTP step as the reference implementations write it: (logits, chained hidden).
    Over a sequence (`hidden [1, T, H]`, `tokens [1, T]`) the block runs once with a causal
    mask: the last position's."""
    embed_norm, hidden_norm, proj, out_norm = OWN_NAMES[model_type]
    language = getattr(main.model, "language_model", main.model)  # Qwen3.5 nests it
    own, eps = source.own, float(language.args.rms_norm_eps)
    e = rms(language.model.embed_tokens(tokens), own[f"{embed_norm}.weight"], eps)
    h = rms(hidden, own[f"{hidden_norm}.weight"], eps)
    joined = mx.concatenate([h, e] if model_type == "mimo" else [e, h], axis=-1)
    if joined.ndim == 2:
        x = source.block((joined @ own[f"{proj}.weight"].T)[:, None, :])[:, 0, :]
    else:
        causal = create_causal_mask(joined.shape[1])
        x = source.block(joined @ own[f"{proj}.weight"].T, causal)[:, -1, :]
    normed = rms(x, own[f"{out_norm}.weight"], eps)
    logits = language.lm_head(normed)
    return logits, x if model_type in ("deepseek_v3", "glm4_moe") else normed


@pytest.fixture(scope="module")
def checkpoints(
    embedded_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, int | None, str | None], tuple[Source, LoadedModel]]:
    """Each (model_type, bits, dtype) checkpoint written (seed 7) and loaded once for the
    module: the head's step and the drafting tests read the same files."""
    root = tmp_path_factory.mktemp("mtp-families")
    made: dict[tuple[str, int | None, str | None], tuple[Source, LoadedModel]] = {}

    def get(model_type: str, bits: int | None, dtype: str | None) -> tuple[Source, LoadedModel]:
        key = (model_type, bits, dtype)
        if key not in made:
            out = root / f"{model_type}-{bits}-{dtype}"
            source = write_mtp_dir(out, model_type, embedded_model, seed=7, bits=bits)
            made[key] = source, load_model(str(out), dtype=dtype)
        return made[key]

    return get


# float32 epsilon (1.2e-7) x the longest reduction (2 x hidden = 128) x ~8 reductions in a
# chain (norms, projection, attention, MoE, head), relative to the logits' scale.
BOUND = 1.2e-7 * 128 * 8


@pytest.mark.parametrize(
    ("model_type", "bits", "dtype"),
    [
        ("deepseek_v3", None, None),
        ("deepseek_v3", 4, "quantized"),  # kept quantized, as the model is
        ("glm4_moe", None, None),
        ("glm4_moe", 4, None),  # dequantized on the CPU, as the model is (kept on a GPU)
        ("mimo", None, None),
        ("qwen3_next", None, None),
        ("qwen3_5", None, None),
        ("qwen3_5_moe", None, None),
    ],
)
def test_a_family_checkpoint_s_mtp_head_loads_and_steps_as_the_reference(
    checkpoints: Callable[[str, int | None, str | None], tuple[Source, LoadedModel]],
    model_type: str,
    bits: int | None,
    dtype: str | None,
) -> None:
    source, main = checkpoints(model_type, bits, dtype)
    head = head_for(main, None)
    language = getattr(main.model, "language_model", main.model)
    kept = isinstance(language.lm_head, QuantizedLinear)
    assert kept == (bits is not None and resolve_dtype(dtype).keep_quantized)
    if bits is not None:  # the head's projection as the model's own layers
        assert isinstance(head.layer.eh_proj, QuantizedLinear) == kept
    mx.random.seed(9)
    hidden = mx.random.normal((3, 64))
    toks = mx.array([5, 300, 4000], dtype=mx.uint32)
    logits, chained = head.step(hidden, toks)
    want_logits, want_chained = reference_step(model_type, source, main, hidden, toks)
    scale = float(mx.abs(want_logits).max())
    assert float(mx.abs(logits - want_logits).max()) <= BOUND * (1 + scale)
    assert float(mx.abs(chained - want_chained).max()) <= BOUND * (
        1 + float(mx.abs(want_chained).max())
    )
    # With its KV cache: three pairs appended, then the step on the fourth attends to them.
    sequence, seq_tokens = mx.random.normal((1, 4, 64)), mx.array([[7, 70, 700, 7000]])
    cache = KVCache()
    head.extend(sequence[:, :3], seq_tokens[:, :3], cache)
    logits, _ = head.step(sequence[:, 3], seq_tokens[:, 3], cache)
    want_logits, _ = reference_step(model_type, source, main, sequence, seq_tokens)
    assert float(mx.abs(logits - want_logits).max()) <= BOUND * (
        1 + float(mx.abs(want_logits).max())
    )


def off_and_mtp(
    main: LoadedModel, requests: list[EngineRequest], num_tokens: int
) -> tuple[dict[str, list[list[int]]], dict[str, object], MTPDrafter | None]:
    """Greedy outputs of `requests` with speculation off, then with `num_tokens` MTP drafts:
    the outputs by mode, the MTP engine's speculation status and its drafter."""
    got: dict[str, list[list[int]]] = {}
    status: dict[str, object] = {}
    drafter = None
    for mode in ("off", "mtp"):
        spec = SpeculationConfig(mode, num_tokens=num_tokens, cost_aware=False)
        engine = Engine(main, EngineConfig(prefill_chunk=128, max_num_seqs=4, speculation=spec))
        engine.start()
        try:
            got[mode] = [tokens(e) for e in outputs(engine, requests)]
            status = engine.speculation_status()
            drafter = engine._executor.spec._mtp
        finally:
            engine.shutdown()
    return got, status, drafter


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe", "mimo"])
def test_drafting_with_the_checkpoint_s_head_leaves_greedy_output_unchanged(
    checkpoints: Callable[[str, int | None, str | None], tuple[Source, LoadedModel]],
    model_type: str,
) -> None:
    main = checkpoints(model_type, None, None)[1]
    requests = [
        EngineRequest(f"r{i}", chat_ids(main, text), greedy(MAX_TOKENS))
        for i, text in enumerate(COPY_PROMPTS[:2])
    ]
    got, status, drafter = off_and_mtp(main, requests, 3)
    assert status["mode"] == "mtp", status
    assert int(status["draft_tokens"]) > 0, status  # type: ignore[call-overload]
    assert drafter is not None and drafter.broken is None  # the head's cache kept up
    for request, want, have in zip(requests, got["off"], got["mtp"], strict=True):
        assert_same_or_near_tie(main, request.prompt_ids, want, have)


def test_a_hybrid_family_drafts_with_its_head_and_keeps_greedy_output(
    checkpoints: Callable[[str, int | None, str | None], tuple[Source, LoadedModel]],
) -> None:
    """Qwen3-Next's recurrent layers roll back rejected drafts (engine/verify_rollback.py):
    its own head drafts, rows of different lengths in one batch, and greedy output is that
    of plain decoding."""
    main = checkpoints("qwen3_next", None, None)[1]
    requests = [
        EngineRequest(f"r{i}", chat_ids(main, text), greedy(6))
        for i, text in enumerate([COPY_PROMPTS[0], "Hi"])
    ]
    got, status, _ = off_and_mtp(main, requests, 2)
    assert status["mode"] == "mtp" and status["disabled_reason"] is None, status
    assert int(status["draft_tokens"]) > 0, status  # type: ignore[call-overload]
    for request, want, have in zip(requests, got["off"], got["mtp"], strict=True):
        assert_same_or_near_tie(main, request.prompt_ids, want, have)


@pytest.mark.parametrize(
    ("model_type", "dropped"),
    [
        ("deepseek_v3", "model.layers.2.hnorm.weight"),
        ("glm4_moe", "model.layers.2.mlp.experts.3.up_proj.weight"),
        ("mimo", "model.mtp_layers.0.self_attn.o_proj.weight"),
        ("qwen3_next", "mtp.pre_fc_norm_hidden.weight"),
    ],
)
def test_a_checkpoint_missing_one_mtp_tensor_names_it_at_start(
    embedded_model: LoadedModel, tmp_path: Path, model_type: str, dropped: str
) -> None:
    from compat_serve.bootstrap import ServeOptions, build_state

    write_mtp_dir(tmp_path / model_type, model_type, embedded_model, drop=(dropped,))
    main = load_model(str(tmp_path / model_type))
    with pytest.raises(MTPHeadError) as caught:
        build_state(ServeOptions(speculative="mtp", prefix_cache=False), main)
    message = str(caught.value)
    assert "\n" not in message
    assert f"no tensor {dropped!r}" in message and main.name in message


def test_a_family_model_without_mtp_weights_fails_at_start_in_one_line(
    embedded_model: LoadedModel, tmp_path: Path
) -> None:
    """A config that declares no MTP layer, and one that declares a layer its checkpoint
    dropped (an mlx-lm conversion), both get the start-up error naming the families."""
    for name, layers in (("none", 0), ("dropped", 1)):
        out = tmp_path / name
        write_mtp_dir(out, "glm4_moe", embedded_model, mtp_layers=layers)
        if layers:
            (out / "model-mtp.safetensors").unlink()
        main = load_model(str(out))
        with pytest.raises(MTPHeadError) as caught:
            head_for(main, None)
        message = str(caught.value)
        assert "\n" not in message and main.name in message
        assert "has no MTP weights" in message and "GLM-4.5" in message


def test_mtp_weights_of_a_model_mlx_vlm_loaded_are_refused_in_one_line(
    checkpoints: Callable[[str, int | None, str | None], tuple[Source, LoadedModel]],
) -> None:
    """A Qwen3.5 checkpoint with a vision tower loads through mlx-vlm, whose model classes
    the heads are not built on: refused at start, saying so (the directory is a text-only
    one here, relabelled as mlx-vlm's loader labels its models)."""
    main = checkpoints("qwen3_5", None, None)[1]
    as_vlm = dataclasses.replace(main, extra={**main.extra, "format": "mlx-vlm-dir"})
    with pytest.raises(MTPHeadError) as caught:
        head_for(as_vlm, None)
    message = str(caught.value)
    assert "\n" not in message and main.name in message
    assert "only for text models loaded with mlx-lm" in message


def test_mtp_layers_of_a_family_not_read_are_refused_naming_the_model_type(
    embedded_model: LoadedModel, tmp_path: Path
) -> None:
    """A config that declares MTP layers for a model type whose head is not built here
    (DeepSeek-V3.2, GLM-4.7-Flash...; a llama config stands in) says so, not "no MTP
    weights"."""
    out = tmp_path / "llama"
    write_model_dir(out, "llama", embedded_model)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    main = load_model(str(out))
    with pytest.raises(MTPHeadError) as caught:
        head_for(main, None)
    message = str(caught.value)
    assert "\n" not in message and main.name in message and "(llama)" in message
    assert "declares MTP layers" in message and "--mtp-head" in message
