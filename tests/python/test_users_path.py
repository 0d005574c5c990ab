"""The users' path (`--dtype quantized`) on the embedded model: the weights Mac and GPU
users run (the GGUF's Q4_1/Q8_0 kept quantized), stock mlx-lm modules, no CPU fast path.
The server answers both APIs and reports that plan, an exact repeat reads prompt - 1
tokens from the cache, eight concurrent greedy streams equal their solo runs, `--kv-bits 8`
works (live, and from the prefix cache's disk tier after a restart), and greedy output
equals mlx-lm's own `generate_step` on the same weights.

These run in the users'-path lane alone (`make test-users-path`, where `embedded_model` is
the quantized load): MLX's CPU quantized matmul is ~15x slower than dense, so prompts are
a dozen tokens and outputs a few.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from compat_serve.engine.engine import Engine
from compat_serve.engine.kv_quant import KVFormat
from compat_serve.engine.types import EngineEvent, EngineRequest
from compat_serve.models.weight_report import weights_status
from tests.chat_prompts import chat_ids
from tests.conftest import RunningServer, start_server
from tests.greedy_ties import Q8_KV_TIE, assert_same_or_near_tie
from tests.python.test_batching import (
    DecodeSpy,
    greedy,
    run_alone_then_together,
    started,
    tokens_of,
)

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

pytestmark = [pytest.mark.users_path, pytest.mark.quantized_only]

# Greedy tokens may part only at a near tie of the reference (tests/greedy_ties.py:
# F32_TIE for float32 KV, Q8_KV_TIE for 8-bit KV): batch shapes and cache layouts change the
# order of float sums, not the weights or modules.
Q8 = KVFormat(8, 64)
USERS_PATH_WEIGHTS = {
    "dtype": "quantized-4bit",
    "requested": "quantized",
    "auto_kept_as_stored": None,  # set only when --dtype auto keeps the stored weights
    "modules": "stock mlx-lm",
    "fast_paths": {},
}


@pytest.fixture(scope="module")
def quantized(embedded_model: LoadedModel) -> LoadedModel:
    """The lane's embedded model: quantized layers, stock mlx-lm classes."""
    from mlx.nn.layers.quantized import QuantizedEmbedding, QuantizedLinear

    untyped: Any = embedded_model.model
    modules = [m for _, m in untyped.named_modules()]
    quantized = [m for m in modules if isinstance(m, (QuantizedLinear, QuantizedEmbedding))]
    assert len(quantized) == 30 * 7 + 1  # every projection and the tied embedding/head
    # The CPU fast paths swap classes (SkinnyLinear, fused blocks, split attention): none.
    # The one class of ours is the embedding whose output is float32, as llama.cpp computes
    # a GGUF's activations (models/float32_activations.py): a QuantizedEmbedding subclass.
    ours = [m for m in modules if not type(m).__module__.startswith(("mlx.", "mlx_lm."))]
    assert [type(m).__module__ for m in ours] == ["compat_serve.models.float32_activations"]
    assert isinstance(ours[0], QuantizedEmbedding)
    return embedded_model


@pytest.fixture(scope="module")
def engine(quantized: LoadedModel) -> Iterator[Engine]:
    eng = started(quantized, prefill_chunk=64, max_num_seqs=8)
    yield eng
    eng.shutdown()


def test_the_loader_reports_the_users_path(quantized: LoadedModel) -> None:
    assert weights_status(quantized) == USERS_PATH_WEIGHTS


def test_greedy_equals_mlx_lm_generate_step_on_the_same_weights(
    engine: Engine, quantized: LoadedModel
) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    ids = chat_ids(quantized, "Name three colours.")
    reference = [tok for tok, _ in generate_step(mx.array(ids), quantized.model, max_tokens=10)]
    request = EngineRequest("ref", ids, greedy(10, stop_at_eos=False))
    produced = asyncio.run(tokens_of(engine, request))
    assert len(produced) == 10
    assert_same_or_near_tie(quantized, ids, reference, produced)


def test_eight_concurrent_greedy_streams_equal_their_solo_runs(
    engine: Engine, quantized: LoadedModel
) -> None:
    spy = DecodeSpy(engine)
    texts = [
        "Paris is",
        "Two plus",
        "Rain falls",
        "Hamlet was",
        "Apples are",
        "Bonjour",
        "One, two",
    ]
    texts.append("Gravity")
    requests = [
        EngineRequest(f"s{i}", tuple(quantized.tokenizer.encode(text)), greedy(5))
        for i, text in enumerate(texts)
    ]
    alone, together = run_alone_then_together(engine, requests)
    batched_rows = spy.rows[sum(len(t) for t in alone) - len(alone) :]
    assert max(batched_rows) >= 6, f"the requests were not batched: {batched_rows}"
    for request, a, b in zip(requests, alone, together, strict=True):
        assert_same_or_near_tie(quantized, request.prompt_ids, a, b)


def _ask(server: RunningServer, question: str) -> dict[str, Any]:
    """The body the Anthropic SDK sends by default (real max_tokens, no temperature);
    the server's --max-output-tokens keeps the reply short."""
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "messages": [{"role": "user", "content": question}],
    }
    response = httpx.post(f"{server.base_url}/v1/messages", json=body, timeout=300)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def _repeat_reads_prompt_minus_one(server: RunningServer, question: str) -> None:
    first = _ask(server, question)
    assert first["content"][0]["text"]
    usage = first["usage"]
    prompt = (
        usage["input_tokens"]
        + usage["cache_read_input_tokens"]
        + usage["cache_creation_input_tokens"]
    )
    again = _ask(server, question)["usage"]
    assert again["cache_read_input_tokens"] == prompt - 1, again
    assert again["input_tokens"] + again["cache_creation_input_tokens"] == 1, again


@pytest.fixture(scope="module")
def users_server(quantized: LoadedModel) -> Iterator[RunningServer]:
    running = start_server(quantized, dtype="quantized", max_output_tokens=3)
    yield running
    running.stop()


def test_the_server_answers_repeats_from_cache_and_reports_its_weights(
    users_server: RunningServer,
) -> None:
    question = "What is the capital of France?"
    _repeat_reads_prompt_minus_one(users_server, question)
    # The OpenAI API, as its SDK sends it by default: the same prompt, read from the cache.
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": question}]}
    response = httpx.post(f"{users_server.base_url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    status = httpx.get(f"{users_server.base_url}/v1/status").json()
    assert status["weights"] == USERS_PATH_WEIGHTS
    # K/V hold the activations' float type, not the weights' "quantized-4bit".
    assert status["kv_cache"]["dtype"] == "float32"
    assert status["kv_cache"]["bytes_per_token"] == 30 * 2 * 3 * 64 * 4  # layers, K+V, heads
    (listed,) = status["models"]
    assert listed["weights"] == USERS_PATH_WEIGHTS
    (ps,) = httpx.get(f"{users_server.base_url}/api/ps").json()["models"]
    assert ps["weights"] == USERS_PATH_WEIGHTS
    (shown,) = httpx.get(f"{users_server.base_url}/v1/dashboard").json()["models"]
    assert shown["weights"] == USERS_PATH_WEIGHTS


def test_eight_bit_kv_answers_and_repeats_from_cache(quantized: LoadedModel) -> None:
    running = start_server(quantized, dtype="quantized", kv_bits=8, max_output_tokens=3)
    try:
        _repeat_reads_prompt_minus_one(running, "Name a large ocean.")
        status = httpx.get(f"{running.base_url}/v1/status").json()
        assert status["kv_cache"]["bits"] == 8
        assert status["weights"] == USERS_PATH_WEIGHTS
    finally:
        running.stop()


def test_a_restarted_engine_reads_eight_bit_blocks_from_disk(
    quantized: LoadedModel, tmp_path: Path
) -> None:
    prompt = chat_ids(quantized, "Which planet is red?")
    request = EngineRequest("w", prompt, greedy(3))
    writer = started(quantized, kv_format=Q8, cache_dir=str(tmp_path))
    try:
        written = asyncio.run(tokens_of(writer, request))
        assert writer.prefix is not None and writer.prefix.disk is not None
        assert writer.prefix.disk.flush()
    finally:
        writer.shutdown()
    restarted = started(quantized, kv_format=Q8, cache_dir=str(tmp_path))
    try:
        events = asyncio.run(_events(restarted, EngineRequest("r", prompt, greedy(3))))
        usage = events[-1].usage
        assert usage is not None and usage.cached_tokens == len(prompt) - 1  # all from disk
        produced = [t for e in events for t in e.token_ids]
        assert_same_or_near_tie(
            quantized, prompt, written, produced, tolerance=Q8_KV_TIE, kv_format=Q8
        )
    finally:
        restarted.shutdown()


async def _events(engine: Engine, request: EngineRequest) -> list[EngineEvent]:
    return [event async for event in engine.submit(request)]
