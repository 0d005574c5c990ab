"""Several models in one server (#27), real servers: the embedded model and a tiny random
llama directory under `--models-dir`, a `--models` file with Claude Code's names as
aliases, and a budget no model fits. The embedded model loads in a few seconds and serves
where its size matters (unload frees memory, load durations); the tiny one (a load in a
fraction of a second) where only the load's life cycle does. Prompts are short."""

from __future__ import annotations

import calendar
import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from compat_serve.bootstrap import ServeOptions
from compat_serve.models.device_memory import weights_nbytes
from compat_serve.models.embedded import embedded_model_path
from compat_serve.serve_models import ModelFlags, build_hub
from compat_serve.server.app import create_app
from tests.conftest import RunningServer, run_app
from tests.http.test_kv_quant_http import rss_bytes
from tests.tiny_models import write_model_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

# A repeated prompt of ~200 tokens: 12 blocks of 16 tokens for the disk tier to hold.
LONG_PROMPT = (
    "Here is a list of facts about the solar system. "
    + " ".join(f"Fact {i}: planet number {i % 8 + 1} orbits the sun." for i in range(18))
    + " Which planet is the largest?"
)


def _serve(options: ServeOptions, flags: ModelFlags) -> RunningServer:
    hub = build_hub(options, flags)
    return run_app(create_app(hub), hub)


def _loads(base: str, model: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    needle = f'compat_model_loads_total{{model="{model}"}} '
    (line,) = [line for line in text.splitlines() if line.startswith(needle)]
    return float(line.removeprefix(needle))


def _states(base: str) -> dict[str, str]:
    return {card["id"]: card["state"] for card in httpx.get(f"{base}/v1/models").json()["data"]}


def _message(base: str, model: str, text: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/messages",
        json={
            "model": model,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}],
        },
        timeout=120,
    )


def _prompt_tokens(usage: dict[str, int]) -> int:
    """Anthropic's usage splits the prompt: uncached, read from cache, written to it."""
    return (
        usage["input_tokens"]
        + usage["cache_read_input_tokens"]
        + usage["cache_creation_input_tokens"]
    )


def _stream_events(base: str, model: str, api: str = "anthropic") -> list[str]:
    """The event names of a streamed Anthropic message (`:` for an SSE comment line);
    for api="openai", the `data:` payloads' first characters and comments."""
    path = "/v1/messages" if api == "anthropic" else "/v1/chat/completions"
    body = {
        "model": model,
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    names = []
    with httpx.stream("POST", f"{base}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith(":"):
                names.append(":" if api == "openai" else "comment")
            elif line.startswith("event: "):
                names.append(line.removeprefix("event: "))
            elif api == "openai" and line.startswith("data: "):
                names.append(line.removeprefix("data: "))
    return names


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, embedded_model: LoadedModel) -> Path:
    """A random two-layer llama as a user's download (config.json, safetensors, the
    embedded tokenizer and template): a real load of a real mlx-lm class, in a fraction of
    the embedded model's time."""
    out = tmp_path_factory.mktemp("tiny") / "llama"
    write_model_dir(out, "llama", embedded_model)
    return out


@pytest.fixture(scope="module")
def dir_server(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[RunningServer]:
    # alpha (tiny) loads cold on every route; beta (the embedded GGUF) is the model whose
    # unload must free memory and whose load takes measurable time.
    root = tmp_path_factory.mktemp("models")
    (root / "alpha").symlink_to(tiny_dir, target_is_directory=True)
    (root / "beta.gguf").symlink_to(embedded_model_path())
    cache = tmp_path_factory.mktemp("cache")
    running = _serve(
        ServeOptions(cache_dir=str(cache), kv_memory="64MB", cache_memory="64MB"),
        ModelFlags(models_dir=str(root)),
    )
    yield running
    running.stop()


def test_models_dir_lists_every_model_and_polling_loads_none(dir_server: RunningServer) -> None:
    base = dir_server.base_url
    for _ in range(2):
        assert httpx.get(f"{base}/health").status_code == 200
        assert _states(base) == {"alpha": "unloaded", "beta": "unloaded"}
        assert httpx.get(f"{base}/api/ps").json() == {"models": []}
        status = httpx.get(f"{base}/v1/status").json()
        assert [(m["id"], m["state"]) for m in status["models"]] == [
            ("alpha", "unloaded"),
            ("beta", "unloaded"),
        ]
        tags = httpx.get(f"{base}/api/tags").json()["models"]
        assert [t["name"] for t in tags] == ["alpha:latest", "beta:latest"]
        lmstudio = httpx.get(f"{base}/api/v0/models").json()["data"]
        assert [m["state"] for m in lmstudio] == ["not-loaded", "not-loaded"]
        llama = httpx.get(f"{base}/models").json()["data"]
        assert [m["status"]["value"] for m in llama] == ["unloaded", "unloaded"]
        assert _loads(base, "alpha") == 0 and _loads(base, "beta") == 0


def test_concurrent_requests_share_one_load_then_unload_keeps_the_disk_cache(
    dir_server: RunningServer,
) -> None:
    base = dir_server.base_url
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda i: _message(base, "beta", f"Say {i}."), range(6)))
    assert [r.status_code for r in replies] == [200] * 6, replies[0].text
    assert _loads(base, "beta") == 1
    assert _states(base) == {"alpha": "unloaded", "beta": "loaded"}
    assert [m["name"] for m in httpx.get(f"{base}/api/ps").json()["models"]] == ["beta:latest"]

    first = _message(base, "beta", LONG_PROMPT)
    assert first.status_code == 200
    assert _prompt_tokens(first.json()["usage"]) > 150

    (resident,) = [m["size"] for m in httpx.get(f"{base}/api/ps").json()["models"]]
    loaded_rss = rss_bytes()  # the server runs in this process
    unloaded = httpx.post(f"{base}/models/unload", json={"model": "beta"}, timeout=60)
    assert unloaded.json() == {"success": True}
    assert httpx.get(f"{base}/api/ps").json() == {"models": []}
    # Unload frees memory for real: the process gives back at least half of what the
    # model held (weights, KV and cache budgets, not all of which were touched).
    freed = loaded_rss - rss_bytes()
    assert freed >= resident / 2, (freed, resident)
    assert _states(base)["beta"] == "unloaded"
    metrics = httpx.get(f"{base}/metrics").text
    assert 'compat_model_evictions_total{model="beta",reason="request"} 1' in metrics

    again = _message(base, "beta", LONG_PROMPT).json()["usage"]
    assert _loads(base, "beta") == 2
    assert again["cache_read_input_tokens"] >= 0.9 * _prompt_tokens(again), again


def test_control_calls_name_models_by_id_and_refuse_unknown_ones(
    dir_server: RunningServer,
) -> None:
    base = dir_server.base_url
    missing = httpx.post(f"{base}/models/load", json={"model": "gamma"})
    assert missing.status_code == 404
    assert "alpha, beta" in missing.json()["error"]["message"]
    assert httpx.post(f"{base}/models/load", json={}).status_code == 400
    assert httpx.post(f"{base}/models/load", content=b"[").status_code == 400
    assert (
        httpx.post(f"{base}/api/v1/models/load", json={"model": "alpha", "ttl": -1}).status_code
        == 400
    )
    # Unloading a model that is not resident succeeds and changes nothing.
    assert httpx.post(f"{base}/api/v1/models/unload", json={"model": "alpha"}).json()["success"]
    assert _states(base)["alpha"] == "unloaded"


def test_cold_streams_on_every_route_keep_alive_then_answer(dir_server: RunningServer) -> None:
    base = dir_server.base_url
    dir_server.state.keepalive_s = 0.02  # type: ignore[attr-defined]
    # /v1/completions wraps its handler in the same `stream_when_ready` as /v1/responses
    # (one cold load less); /v1/messages' own cold stream is tested with the aliases below.
    routes = [
        # The cap ends the response as `incomplete` unless the model stops first.
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 16}, ("completed", "incomplete")),
        # A cap here too: without one a chat completion may run to the context window.
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16},
            ("[DONE]",),
        ),
    ]
    for path, fields, last in routes:
        assert _states(base)["alpha"] == "unloaded"
        body = {"model": "alpha", "stream": True, **fields}
        with httpx.stream("POST", f"{base}{path}", json=body, timeout=120) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line]
        assert lines[0].startswith(":"), (path, lines[:3])  # a keep-alive comment first
        assert any(end in lines[-1] for end in last), (path, lines[-3:])
        assert httpx.post(f"{base}/models/unload", json={"model": "alpha"}).json()["success"]


def _ollama_ps(base: str) -> dict[str, str]:
    return {m["name"]: m["expires_at"] for m in httpx.get(f"{base}/api/ps").json()["models"]}


def _ndjson(base: str, path: str, body: dict[str, object]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{base}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line) for line in response.iter_lines() if line]


def test_ollama_keep_alive_loads_pins_and_unloads(dir_server: RunningServer) -> None:
    """Ollama's idioms: no messages loads (kept `keep_alive`), no messages with
    keep_alive 0 unloads, -1 pins, 0 on a generation unloads once it is over. Beta is
    resident after the tests above (loaded here if the test runs alone)."""
    base = dir_server.base_url
    # A bad body for a cold model is refused without loading it.
    bad = {"model": "alpha", "messages": [{"role": "user", "content": "Hi"}], "format": "xml"}
    refused = httpx.post(f"{base}/api/chat", json=bad, timeout=60)
    assert refused.status_code == 400 and "format" in refused.json()["error"]
    assert _states(base)["alpha"] == "unloaded"
    preload = {"model": "beta", "messages": [], "keep_alive": "5m"}
    loaded = httpx.post(f"{base}/api/chat", json=preload, timeout=120).json()
    assert loaded["done"] is True and loaded["done_reason"] == "load", loaded
    expires = calendar.timegm(time.strptime(_ollama_ps(base)["beta:latest"], "%Y-%m-%dT%H:%M:%SZ"))
    assert 240 < expires - time.time() <= 301

    unload = {"model": "beta:latest", "messages": [], "keep_alive": 0}
    unloaded = httpx.post(f"{base}/api/chat", json=unload, timeout=60).json()
    assert unloaded["done_reason"] == "unload" and unloaded["message"]["content"] == ""
    assert _ollama_ps(base) == {}
    loads = _loads(base, "beta")

    # Streamed (the default): a cold generation loads the model, pinned by -1.
    pin = {"model": "beta", "prompt": "Say hi.", "keep_alive": -1, "options": {"num_predict": 4}}
    final = _ndjson(base, "/api/generate", pin)[-1]
    assert final["done"] is True and 0 < final["eval_count"] <= 4, final
    assert final["load_duration"] > 50_000_000  # the load, in nanoseconds
    assert _ollama_ps(base)["beta:latest"].startswith("2318")

    ask = {"model": "beta", "messages": [{"role": "user", "content": "Hi"}], "keep_alive": 0}
    final = _ndjson(base, "/api/chat", {**ask, "options": {"num_predict": 4}})[-1]
    assert final["done"] is True and final["load_duration"] < 50_000_000, final
    deadline = time.monotonic() + 5
    while _ollama_ps(base) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ollama_ps(base) == {}
    assert _loads(base, "beta") == loads + 1
    assert (
        'compat_model_evictions_total{model="beta",reason="ttl"}'
        in httpx.get(f"{base}/metrics").text
    )


CLAUDE_MODELS = """\
models:
  - id: main
    path: {path}
    aliases: ["claude-*sonnet*", "claude-*opus*"]
    default: true
    kv_memory: 64MB
    cache_memory: 64MB
  - id: fast
    path: {path}
    aliases: ["claude-*haiku*"]
    kv_memory: 64MB
    cache_memory: 64MB
"""


def test_claude_code_names_route_to_their_models(tmp_path: Path) -> None:
    file = tmp_path / "models.yaml"
    file.write_text(CLAUDE_MODELS.format(path=embedded_model_path()))
    running = _serve(ServeOptions(), ModelFlags(models_file=str(file)))
    base = running.base_url
    try:
        reply = _message(base, "claude-haiku-4-5-20251001", "Title: hello")
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "claude-haiku-4-5-20251001"
        assert _states(base) == {"main": "unloaded", "fast": "loaded"}
        # Claude Code streams: pings while the cold model loads, then the message.
        running.state.keepalive_s = 0.05  # type: ignore[attr-defined]
        events = _stream_events(base, "claude-sonnet-4-5-20250929")
        assert events[0] == "ping", events
        first_real = next(e for e in events if e != "ping")
        assert first_real == "message_start" and events[-1] == "message_stop", events
        assert _states(base) == {"main": "loaded", "fast": "loaded"}
        assert (_loads(base, "main"), _loads(base, "fast")) == (1, 1)
        # One thread steps both models.
        hub = running.state
        threads = {s.state.engine._thread for s in hub.resident()}  # type: ignore[attr-defined]
        assert len(threads) == 1 and None not in threads
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            names = ["claude-sonnet-4-5", "claude-haiku-4-5"] * 2
            replies = list(pool.map(lambda m: _message(base, m, "Say yes."), names))
        assert [r.status_code for r in replies] == [200] * 4
        # /metrics: both engines' series, one family each, labelled by model; a valid
        # exposition (prometheus_client's parser rejects a family given twice).
        families = {
            f.name: f for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
        }
        requests = [s for s in families["compat_requests"].samples if s.value]
        assert {s.labels["model"] for s in requests} == {"main", "fast"}
        assert sum(s.value for s in requests) == 6  # every request above, once
    finally:
        running.stop()


def test_a_model_larger_than_the_budget_fails_fast_and_the_server_lives(
    tmp_path: Path,
) -> None:
    (tmp_path / "only.gguf").symlink_to(embedded_model_path())
    running = _serve(
        ServeOptions(kv_memory="64MB", cache_memory="64MB"),
        ModelFlags(models_dir=str(tmp_path), memory_budget="1MB"),
    )
    base = running.base_url
    try:
        for _ in range(2):  # remembered: the second answer is the same 400
            started = time.monotonic()
            reply = _message(base, "only", "Hi")
            assert time.monotonic() - started < 5
            assert reply.status_code == 400
            message = reply.json()["error"]["message"]
            assert "can never fit the memory budget of 1 MiB" in message, message
        # Streamed, the refusal is the stream's error event, in each API's shape.
        events = _stream_events(base, "only")
        assert events == ["error"], events
        chunks = _stream_events(base, "only", api="openai")
        error = json.loads(chunks[0])["error"]
        assert "can never fit" in error["message"] and chunks[-1] == "[DONE]"
        body = {"model": "only", "stream": True, "input": "Hi"}
        with httpx.stream("POST", f"{base}/v1/responses", json=body, timeout=60) as response:
            frames = [line for line in response.iter_lines() if line.startswith("data: ")]
        failed = json.loads(frames[-1].removeprefix("data: "))
        assert failed["type"] == "response.failed"
        assert "can never fit" in failed["response"]["error"]["message"]
        assert httpx.get(f"{base}/health").status_code == 200
        assert _loads(base, "only") == 0
    finally:
        running.stop()


# Five loads of the embedded model (~60 s on CI's machine): CI keeps the swap under a
# one-model budget in tests/http/test_memory_budget_twins.py; this runs in the extended run.
@pytest.mark.extended
def test_alternating_requests_under_a_one_model_budget_all_answer(
    tmp_path: Path, embedded_model: LoadedModel
) -> None:
    for name in ("a", "b"):
        (tmp_path / f"{name}.gguf").symlink_to(embedded_model_path())
    one_model = weights_nbytes(embedded_model.model) + 2 * 64 * 10**6  # weights, KV, cache
    running = _serve(
        ServeOptions(kv_memory="64MB", cache_memory="64MB"),
        ModelFlags(models_dir=str(tmp_path), memory_budget=str(int(one_model * 1.5))),
    )
    base = running.base_url
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            # Two at once, one per model: the second waits for the first to finish.
            pair = list(pool.map(lambda m: _message(base, m, "Hi"), ["a", "b"]))
        assert [r.status_code for r in pair] == [200, 200], pair[0].text
        for model in ["a", "b", "a"]:
            reply = _message(base, model, "Hi")
            assert reply.status_code == 200, reply.text
            resident = [m["name"] for m in httpx.get(f"{base}/api/ps").json()["models"]]
            assert resident == [f"{model}:latest"]
        assert _loads(base, "a") + _loads(base, "b") >= 4
        evictions = [
            float(line.rsplit(" ", 1)[1])
            for line in httpx.get(f"{base}/metrics").text.splitlines()
            if line.startswith("compat_model_evictions_total{") and 'reason="lru"' in line
        ]
        # Every load after the first made room for itself.
        assert sum(evictions) == _loads(base, "a") + _loads(base, "b") - 1
    finally:
        running.stop()


def test_a_model_that_fails_to_load_answers_500_once_then_400(tmp_path: Path) -> None:
    (tmp_path / "broken.gguf").write_bytes(b"GGUF but not really")
    running = _serve(ServeOptions(), ModelFlags(models_dir=str(tmp_path)))
    base = running.base_url
    try:
        first = _message(base, "broken", "Hi")
        assert first.status_code == 500
        assert "failed to load" in first.json()["error"]["message"]
        second = _message(base, "broken", "Hi")
        assert second.status_code == 400
        assert "failed to load" in second.json()["error"]["message"]
        assert httpx.get(f"{base}/health").status_code == 200
        status = httpx.get(f"{base}/v1/status").json()["models"][0]
        assert status["state"] == "unloaded" and status["failure"]
    finally:
        running.stop()


def test_no_room_beside_a_pinned_model_is_overloaded_in_each_api(
    tmp_path: Path, tiny_dir: Path
) -> None:
    # Two entries of the tiny directory: the budget's arithmetic is the same at any size.
    file = tmp_path / "models.yaml"
    file.write_text(
        f"models:\n  - id: main\n    path: {tiny_dir}\n    pin: true\n"
        f"  - id: fast\n    path: {tiny_dir}\n"
    )
    weights = sum(f.stat().st_size for f in tiny_dir.glob("*.safetensors"))
    one_model = weights + 2 * 64 * 10**6  # weights, KV, cache
    running = _serve(
        ServeOptions(kv_memory="64MB", cache_memory="64MB"),
        ModelFlags(
            models_file=str(file), memory_budget=str(int(one_model * 1.5)), wait_timeout_s=0.3
        ),
    )
    base = running.base_url
    try:
        assert _states(base) == {"main": "loaded", "fast": "unloaded"}  # pinned: at start
        anthropic = _message(base, "fast", "Hi")
        assert anthropic.status_code == 529
        assert anthropic.json()["error"]["type"] == "overloaded_error"
        openai = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": "fast", "messages": [{"role": "user", "content": "Hi"}]},
            timeout=60,
        )
        assert openai.status_code == 503 and "retry-after" in openai.headers
        assert "no memory for model 'fast'" in openai.json()["error"]["message"]
        assert _message(base, "main", "Hi").status_code == 200  # the pinned one serves
    finally:
        running.stop()
