"""`GET /metrics` and `GET /v1/status` against the real server and model."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from compat_serve.engine.types import FinishReason
from tests.conftest import start_server

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
HISTOGRAMS = (
    "compat_time_to_first_token_seconds",
    "compat_inter_token_latency_seconds",
    "compat_request_duration_seconds",
    "compat_decode_step_batch_size",
)
# One client for the module: `httpx.post` builds a client, and its TLS context from the
# CA bundle (~50 ms of CPU), per request.
HTTP = httpx.Client()

KEY = "observability-secret"


def scrape(base_url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, str], float]:
    """Every sample of /metrics as {(name, sorted labels as JSON): value}."""
    response = HTTP.get(f"{base_url}/metrics", headers=headers, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            key = (sample.name, json.dumps(sample.labels, sort_keys=True))
            assert key not in out, f"duplicate sample {key}"
            out[key] = sample.value
    return out


def get(samples: dict[tuple[str, str], float], name: str, **labels: str) -> float:
    return samples[(name, json.dumps(labels, sort_keys=True))]


def delta(
    after: dict[tuple[str, str], float],
    before: dict[tuple[str, str], float],
    name: str,
    **labels: str,
) -> float:
    return get(after, name, **labels) - get(before, name, **labels)


def check_histograms(samples: dict[tuple[str, str], float]) -> None:
    for name in HISTOGRAMS:
        buckets = sorted(
            (float(json.loads(labels)["le"]), v)
            for (n, labels), v in samples.items()
            if n == f"{name}_bucket"
        )
        counts = [v for _, v in buckets]
        assert buckets[-1][0] == float("inf")
        assert counts == sorted(counts), f"{name} buckets are not cumulative"
        assert get(samples, f"{name}_bucket", le="+Inf") == get(samples, f"{name}_count")


def stream_then_disconnect(base_url: str, body: dict[str, Any], deltas: int) -> None:
    """Read until `deltas` content pieces arrived, then drop the connection."""
    seen = 0
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if any(c["delta"].get("content") for c in chunk["choices"]):
                seen += 1
                if seen >= deltas:
                    break
    assert seen >= deltas


def test_metrics_count_requests_tokens_and_latencies(server: RunningServer) -> None:
    before = scrape(server.base_url)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="m", messages=QUESTION, temperature=0, max_tokens=5
    )
    assert reply.usage is not None and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5

    # The same prompt again, streamed and abandoned after a few tokens.
    body = {
        "model": "m",
        "messages": QUESTION,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    stream_then_disconnect(server.base_url, body, deltas=3)
    deadline = time.monotonic() + 30
    after = scrape(server.base_url)
    while delta(after, before, "compat_requests_total", outcome="aborted") < 1:
        assert time.monotonic() < deadline, "the abort never reached the metrics"
        time.sleep(0.1)
        after = scrape(server.base_url)

    outcomes = {
        r.value: delta(after, before, "compat_requests_total", outcome=r.value)
        for r in FinishReason
    }
    assert outcomes == {r.value: 0 for r in FinishReason} | {"length": 1, "aborted": 1}
    # Both requests had the same prompt, and both finished prefilling.
    prompt = reply.usage.prompt_tokens
    assert delta(after, before, "compat_prompt_tokens_total") == 2 * prompt
    generated = delta(after, before, "compat_generation_tokens_total")
    aborted_tokens = generated - 5
    assert 3 <= aborted_tokens < 2000
    # One TTFT per request, one inter-token gap per further token, one duration each.
    assert delta(after, before, "compat_time_to_first_token_seconds_count") == 2
    assert delta(after, before, "compat_inter_token_latency_seconds_count") == generated - 2
    assert delta(after, before, "compat_request_duration_seconds_count") == 2
    assert delta(after, before, "compat_time_to_first_token_seconds_sum") > 0
    assert delta(after, before, "compat_request_duration_seconds_sum") > 0
    check_histograms(after)
    # Nothing is left in flight.
    assert get(after, "compat_queue_depth") == 0
    assert get(after, "compat_running_requests") == 0
    assert get(after, "compat_kv_cache_bytes") == 0
    assert get(after, "compat_kv_tokens_reserved") == 0
    assert get(after, "compat_decode_batch_size") == 0
    assert get(after, "compat_kv_tokens_capacity") == server.state.engine.kv_capacity_tokens  # type: ignore[attr-defined]
    # Each of the 2 requests decoded alone: one single-row forward per token after the first.
    assert delta(after, before, "compat_decode_step_batch_size_count") == generated - 2
    assert delta(after, before, "compat_decode_step_batch_size_sum") == generated - 2
    assert delta(after, before, "compat_preemptions_total") == 0
    version = next(json.loads(labels) for n, labels in after if n == "compat_info")["version"]
    assert get(after, "compat_info", model="SmolLM2-135M-Instruct", version=version) == 1
    # Bytes per token, measured from the real cache after the first prefill:
    # 2 (K, V) x layers x kv_heads x head_dim x dtype bytes.
    engine = server.state.engine  # type: ignore[attr-defined]
    args = engine.model.model.args
    head_dim = args.head_dim or args.hidden_size // args.num_attention_heads
    dtype_bytes = 4 if engine.model.dtype == "float32" else 2
    assert engine.metrics.kv_bytes_per_token == (
        2 * args.num_hidden_layers * args.num_key_value_heads * head_dim * dtype_bytes
    )


@pytest.fixture(scope="module")
def keyed_server(tiny_llama_model: LoadedModel) -> Iterator[RunningServer]:
    """Small prefill chunks, so a prompt takes several visible steps, and an API key. On
    the tiny llama: what is checked is the status rows and the key, not the model's text."""
    running = start_server(tiny_llama_model, prefill_chunk=32, api_key=KEY)
    yield running
    running.stop()


@pytest.fixture
def paced_runner(keyed_server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prefill chunk takes at least 250 ms more and every decode step 50 ms, so that
    polling sees each step even where the model runs in milliseconds (the tiny llama) and
    a loaded CI machine slows each poll."""
    runner = keyed_server.state.engine._runner  # type: ignore[attr-defined]
    for name, delay in (("prefill", 0.25), ("decode_logits", 0.05)):
        real = getattr(runner, name)

        def paced(*args: Any, _real: Any = real, _delay: float = delay) -> Any:
            time.sleep(_delay)
            return _real(*args)

        monkeypatch.setattr(runner, name, paced)


@pytest.mark.usefixtures("paced_runner")
def test_status_follows_a_running_request(keyed_server: RunningServer) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    base = keyed_server.base_url
    idle = HTTP.get(f"{base}/v1/status", headers=auth, timeout=10).json()
    assert idle["model"] == "tiny-llama"
    assert idle["requests"] == [] and idle["queue_depth"] == 0 and idle["running"] == 0
    assert idle["uptime_s"] >= 0

    result: dict[str, Any] = {}

    def run() -> None:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "word " * 120}],
            "max_tokens": 24,
            "ignore_eos": True,
            "temperature": 0,
        }
        r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=auth, timeout=300)
        result["response"] = r

    worker = threading.Thread(target=run)
    worker.start()
    snapshots: list[dict[str, Any]] = []
    with httpx.Client(headers=auth, timeout=10) as poller:  # one connection for every poll
        while worker.is_alive():
            status = poller.get(f"{base}/v1/status").json()
            if status["requests"]:
                snapshots.append(status)
            time.sleep(0.02)
    worker.join()
    response = result["response"]
    assert response.status_code == 200
    usage = response.json()["usage"]

    assert snapshots, "the request never showed up in /v1/status"
    rows = [s["requests"][0] for s in snapshots]
    assert all(len(s["requests"]) == 1 for s in snapshots)
    assert set(rows[0]) >= {
        "request_id",
        "phase",
        "prompt_tokens",
        "computed_tokens",
        "generated_tokens",
        "cached_tokens",
        "ttft_s",
        "decode_tokens_per_s",
        "age_s",
    }
    assert len({r["request_id"] for r in rows}) == 1
    assert {r["phase"] for r in rows} <= {"queued", "prefill", "decode"}
    assert "prefill" in {r["phase"] for r in rows}
    assert all(r["prompt_tokens"] == usage["prompt_tokens"] for r in rows)
    assert all(r["cached_tokens"] == 0 for r in rows)
    computed = [r["computed_tokens"] for r in rows]
    assert computed == sorted(computed), "computed_tokens went backwards"
    partial = {c for c in computed if 0 < c < usage["prompt_tokens"]}
    assert len(partial) >= 2, f"prefill progress not visible: {computed}"
    generated = [r["generated_tokens"] for r in rows]
    assert generated == sorted(generated) and generated[-1] <= usage["completion_tokens"]
    for s, r in zip(snapshots, rows, strict=True):
        if r["phase"] in ("prefill", "decode"):
            assert s["running"] == 1 and s["queue_depth"] == 0
    decoding = [r for r in rows if r["phase"] == "decode" and r["generated_tokens"] > 0]
    assert decoding, "no snapshot during decode"
    assert all(r["ttft_s"] is not None and r["ttft_s"] > 0 for r in decoding)
    ages = [r["age_s"] for r in rows]
    assert ages == sorted(ages)

    after = HTTP.get(f"{base}/v1/status", headers=auth, timeout=10).json()
    assert after["requests"] == [] and after["running"] == 0 and after["queue_depth"] == 0


def test_metrics_and_status_require_the_api_key(keyed_server: RunningServer) -> None:
    base = keyed_server.base_url
    for path in ("/metrics", "/v1/status"):
        assert HTTP.get(f"{base}{path}", timeout=10).status_code == 401
        wrong = HTTP.get(f"{base}{path}", headers={"x-api-key": "nope"}, timeout=10)
        assert wrong.status_code == 401
        assert HTTP.get(f"{base}{path}", headers={"x-api-key": KEY}, timeout=10).status_code == 200
    assert HTTP.get(f"{base}/health", timeout=10).status_code == 200
    samples = scrape(base, headers={"authorization": f"Bearer {KEY}"})
    check_histograms(samples)
