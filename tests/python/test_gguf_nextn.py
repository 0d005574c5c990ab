"""`--speculative mtp` from a GGUF's `nextn` tensors (models/gguf_mtp.py, the `glm4moe`
family): one tiny random GLM-4.5 written twice, as a checkpoint directory with its MTP layer
in Hugging Face's names (tests/tiny_mtp.py: the path test_mtp_families.py checks against
vllm's formula) and as the GGUF llama.cpp's converter makes of it (tests/tiny_gguf_nextn.py).

Both files hold the same float32 values and both loads run the same mlx-lm classes in
float32, so the main model's logits and the MTP head's step are compared for equality (and
the step with vllm's formula, within test_mtp_families.py's bound); greedy output with the
GGUF's head drafting equals plain decoding. tests/llamacpp/test_glm4moe_vs_llamacpp.py runs
the same file in llama.cpp.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import mlx.core as mx
import pytest
from mlx.nn.layers.quantized import QuantizedLinear
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from compat_serve.engine.mtp_head import MTPHeadError
from compat_serve.engine.mtp_setup import head_for
from compat_serve.engine.types import EngineRequest
from compat_serve.models.gguf_header import read_tensor_table
from compat_serve.models.loader import load_model
from tests.chat_prompts import chat_ids
from tests.greedy_ties import assert_same_or_near_tie
from tests.python.test_batching import greedy
from tests.python.test_mtp_families import BOUND, off_and_mtp, reference_step
from tests.python.test_speculative import COPY_PROMPTS
from tests.tiny_gguf import small_tokenizer_fields
from tests.tiny_gguf_nextn import write_glm_nextn, write_nextn_gguf
from tests.tiny_mtp import Source

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

MAX_TOKENS = 16
SMALL = small_tokenizer_fields()
Q8_0 = gguf.GGMLQuantizationType.Q8_0


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Source]:
    return write_glm_nextn(tmp_path_factory.mktemp("glm"))


@pytest.fixture(scope="module")
def gguf_main(written: tuple[Path, Path, Source]) -> LoadedModel:
    return load_model(str(written[1]), dtype="float32")


def test_the_gguf_gives_the_directory_s_logits_and_mtp_step(
    written: tuple[Path, Path, Source], gguf_main: LoadedModel
) -> None:
    from_dir, from_gguf = load_model(str(written[0]), dtype="float32"), gguf_main
    assert from_gguf.extra["format"] == "gguf" and from_gguf.model_type == "glm4_moe"
    assert from_gguf.extra["config"]["num_hidden_layers"] == 2  # block_count 3 less 1 nextn
    ids = mx.array([[5, 30, 200, 17, 17, 90, 12, 5]])
    assert mx.array_equal(from_gguf.model(ids), from_dir.model(ids))
    head_dir, head_gguf = head_for(from_dir, None), head_for(from_gguf, None)
    mx.random.seed(9)
    hidden = mx.random.normal((3, 64))
    toks = mx.array([5, 30, 200], dtype=mx.uint32)
    logits, chained = head_gguf.step(hidden, toks)
    want_logits, want_chained = head_dir.step(hidden, toks)
    assert mx.array_equal(logits, want_logits) and mx.array_equal(chained, want_chained)
    formula, _ = reference_step("glm4_moe", written[2], from_gguf, hidden, toks)
    assert float(mx.abs(logits - formula).max()) <= BOUND * (1 + float(mx.abs(formula).max()))


def test_drafting_with_the_gguf_s_head_leaves_greedy_output_unchanged(
    gguf_main: LoadedModel,
) -> None:
    main = gguf_main
    requests = [
        EngineRequest(f"r{i}", chat_ids(main, text), greedy(MAX_TOKENS))
        for i, text in enumerate(COPY_PROMPTS[:2])
    ]
    got, status, _ = off_and_mtp(main, requests, 3)
    assert status["mode"] == "mtp", status
    assert int(status["draft_tokens"]) > 0, status  # type: ignore[call-overload]
    for request, want, have in zip(requests, got["off"], got["mtp"], strict=True):
        assert_same_or_near_tie(main, request.prompt_ids, want, have)


@pytest.mark.parametrize(
    "dropped", ["blk.2.nextn.hnorm.weight", "blk.2.ffn_up_exps.weight", "blk.2.exp_probs_b.bias"]
)
def test_a_gguf_missing_one_nextn_tensor_names_it(
    written: tuple[Path, Path, Source], gguf_main: LoadedModel, tmp_path: Path, dropped: str
) -> None:
    path = write_nextn_gguf(written[0], tmp_path / "cut.gguf", SMALL, drop=(dropped,))
    main = load_model(str(path))  # the main model loads: the MTP layer is no part of it
    with pytest.raises(MTPHeadError) as caught:
        head_for(main, None)
    message = str(caught.value)
    assert "\n" not in message and main.name in message
    assert f"no tensor {dropped!r}" in message


def test_a_gguf_without_nextn_tensors_fails_mtp_at_start_in_one_line(
    written: tuple[Path, Path, Source], tmp_path: Path
) -> None:
    """A file converted from a config without `num_nextn_predict_layers` (no MTP layer),
    and one that declares a nextn layer but lost its block: both get the start-up error."""
    block = tuple(t.name for t in read_tensor_table(str(written[1])) if t.name.startswith("blk.2."))
    none = write_nextn_gguf(written[0], tmp_path / "none.gguf", SMALL, declare_nextn=False)
    stripped = write_nextn_gguf(written[0], tmp_path / "cut.gguf", SMALL, drop=block)
    for path, nextn in ((none, 0), (stripped, 1)):
        main = load_model(str(path))
        assert main.extra["config"]["num_nextn_predict_layers"] == nextn
        with pytest.raises(MTPHeadError) as caught:
            head_for(main, None)
        message = str(caught.value)
        assert "\n" not in message and main.name in message
        assert "has no MTP weights" in message and "GLM-4.5" in message


# Kept quantized, the head runs MLX's quantized kernels on the layout's float16 scales and
# biases (Q8_0's codes and scales are exact: gguf_layout.py): one float16 rounding (2^-11)
# per op of the step's ~8 (norms, projection, attention, MoE, head), relative to the
# logits' scale. Measured: 7.9e-4 on logits up to 1.7 (Q4_0 alike).
F16_CHAIN = 2.0**-11 * 8


def test_a_quantized_gguf_s_head_is_kept_quantized_where_the_model_is(
    written: tuple[Path, Path, Source], tmp_path: Path
) -> None:
    path = write_nextn_gguf(written[0], tmp_path / "q8.gguf", SMALL, qtype=Q8_0)
    dense, kept = load_model(str(path), dtype="float32"), load_model(str(path), dtype="quantized")
    head_dense, head_kept = head_for(dense, None), head_for(kept, None)
    assert isinstance(head_kept.layer.eh_proj, QuantizedLinear)
    assert isinstance(head_kept.layer.mlp.switch_mlp.up_proj, QuantizedSwitchLinear)
    assert not isinstance(head_dense.layer.eh_proj, QuantizedLinear)  # dequantized, as the model
    mx.random.seed(9)
    hidden = mx.random.normal((3, 64))
    toks = mx.array([5, 30, 200], dtype=mx.uint32)
    want, _ = head_dense.step(hidden, toks)
    got, _ = head_kept.step(hidden, toks)
    delta = float(mx.abs(got.astype(mx.float32) - want).max())
    assert delta <= F16_CHAIN * (1 + float(mx.abs(want).max()))
