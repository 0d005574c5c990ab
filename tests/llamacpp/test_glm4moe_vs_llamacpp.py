"""llama.cpp on the GLM-4.5 GGUF tests/tiny_gguf_nextn.py writes (a tiny random model with
GLM-4.5's attention, q/k/v biases and no q/k norms, and its MTP layer as llama.cpp's `nextn`
block): llama.cpp loads the file as its converter would have written it (`block_count`
counting the nextn layer it skips), and compat-serve's greedy continuation, plain and with
the file's own MTP head drafting, equals llama.cpp's.

Both sides compute in float32 (float32 weights; llama.cpp with a float32 KV cache and no
flash attention): measured, llama.cpp's log-probabilities of its top 10 differ from ours by
at most 1.4e-6 at each of the 12 positions (1.6e-3 with its default float16 KV cache and
flash attention), so the float32 paths' tie tolerance applies (tests/greedy_ties.py's
F32_TIE); the smallest top-two margin on the way is 0.057.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.speculation import SpeculationConfig
from compat_serve.engine.types import EngineRequest
from compat_serve.models.loader import load_model
from tests.greedy_ties import F32_TIE, assert_greedy_equal_up_to_tie
from tests.llamacpp.reference import LlamaCpp
from tests.python.test_batching import greedy
from tests.python.test_speculative import outputs, tokens
from tests.tiny_gguf_nextn import write_glm_nextn

GREEDY_TOKENS = 12


@pytest.fixture(scope="module")
def glm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_glm_nextn(tmp_path_factory.mktemp("glm"))[1]


@pytest.fixture(scope="module")
def glm_llamacpp(glm_gguf: Path) -> Iterator[LlamaCpp]:
    reference = LlamaCpp(glm_gguf, n_ctx=256, threads=1, float32=True)
    yield reference
    reference.close()


def test_greedy_plain_and_with_mtp_drafts_equal_llamacpp(
    glm_gguf: Path, glm_llamacpp: LlamaCpp
) -> None:
    main = load_model(str(glm_gguf), dtype="float32")
    prompt = main.tokenizer.encode("The quick brown fox jumps over the lazy dog. Once upon a")
    reference = glm_llamacpp.greedy(prompt, GREEDY_TOKENS)
    for mode in ("off", "mtp"):
        spec = SpeculationConfig(mode, num_tokens=2, cost_aware=False)
        engine = Engine(main, EngineConfig(prefill_chunk=128, max_num_seqs=2, speculation=spec))
        engine.start()
        try:
            request = EngineRequest(mode, prompt, greedy(GREEDY_TOKENS))
            got = tokens(outputs(engine, [request])[0])
            status = engine.speculation_status()
        finally:
            engine.shutdown()
        assert status["mode"] == mode, status
        if mode == "mtp":
            assert int(status["draft_tokens"]) > 0, status  # type: ignore[call-overload]
        assert_greedy_equal_up_to_tie(
            reference.ids,
            got,
            lambda i: reference.top_ids[i],
            tolerance=F32_TIE,
            what=f"--speculative {mode}",
        )
