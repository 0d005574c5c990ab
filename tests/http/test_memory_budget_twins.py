"""Two names for the same model under a memory budget (#34, defect 1): admission, eviction
and the never-fits refusal read one estimate, made before loading from the weights the
loader will make (float32 on the CPU: about 6x the 4-bit GGUF), so both names get the
same answer. Before, the first name was admitted at its file's size, loaded at float32
(200), and its twin refused (400) at the measured size.

The server runs in this process, so its RSS is this process's: sampled during the swaps,
its growth over the idle server must stay under the budget plus `LOAD_HEADROOM`."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from compat_serve.bootstrap import ServeOptions
from compat_serve.models.embedded import embedded_model_path
from compat_serve.registry.hub import ModelHub
from compat_serve.serve_models import ModelFlags, build_hub
from compat_serve.server.app import create_app
from tests.conftest import RunningServer, run_app
from tests.http.test_kv_quant_http import rss_bytes

# One client for the module: `httpx.post` builds a client, and its TLS context from the
# CA bundle (~50 ms of CPU), per request.
HTTP = httpx.Client()

MIB = 2**20
TWINS = ("main", "fast")
# What a load holds beyond the model it makes resident: the GGUF's quantized tensors
# (94 MiB for the embedded model) while they are dequantized, and the allocator's slack.
LOAD_HEADROOM = 160 * MIB


def _twins_server(tmp_path: Path, budget: str) -> RunningServer:
    for name in TWINS:
        (tmp_path / f"{name}.gguf").symlink_to(embedded_model_path())
    hub = build_hub(
        ServeOptions(kv_memory="64MiB", cache_memory="32MiB"),
        ModelFlags(models_dir=str(tmp_path), memory_budget=budget),
    )
    return run_app(create_app(hub), hub)


def _ask(base: str, model: str) -> httpx.Response:
    return HTTP.post(
        f"{base}/v1/messages",
        json={
            "model": model,
            "max_tokens": 2,  # an answer; the loads are what is measured
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        },
        timeout=120,
    )


@contextmanager
def _peak_rss() -> Iterator[list[int]]:
    """[baseline, peak] RSS of this process while the block runs (sampled every 5 ms)."""
    seen = [rss_bytes(), rss_bytes()]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            seen[1] = max(seen[1], rss_bytes())
            done.wait(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join()


def test_twins_under_a_budget_neither_fits_are_both_refused_at_once(tmp_path: Path) -> None:
    running = _twins_server(tmp_path, "150MiB")
    base = running.base_url
    try:
        messages = []
        for model in (*TWINS, *TWINS):
            started = time.monotonic()
            reply = _ask(base, model)
            assert time.monotonic() - started < 5
            assert reply.status_code == 400, reply.text
            messages.append(reply.json()["error"]["message"])
        # The same estimate for both: float32 (513 MiB) would not fit, so `--dtype auto`
        # keeps the weights as stored (94 MiB) + the tokenizer (49,152 x 350 B) + KV 64 +
        # cache 32.
        for model, message in zip((*TWINS, *TWINS), messages, strict=True):
            assert message == (
                f"model {model!r} needs about 206 MiB (weights, KV and prefix cache, estimated "
                "before loading) and can never fit the memory budget of 150 MiB (--memory-budget)"
            )
        assert HTTP.get(f"{base}/api/ps").json()["models"] == []  # nothing was loaded
    finally:
        running.stop()


def test_twins_under_a_budget_that_fits_one_both_answer_and_swap(tmp_path: Path) -> None:
    budget = 700 * MIB
    running = _twins_server(tmp_path, str(budget))
    hub = running.state
    assert isinstance(hub, ModelHub)
    base = running.base_url
    try:
        estimates = {model: hub.estimate(hub.slots[model]) for model in TWINS}
        assert estimates["main"] == estimates["fast"] <= budget < 2 * estimates["main"]
        with _peak_rss() as rss:
            for model in TWINS:  # the second load evicts the first
                reply = _ask(base, model)
                assert reply.status_code == 200, reply.text
                assert reply.json()["content"][0]["text"]
                resident = [m["name"] for m in HTTP.get(f"{base}/api/ps").json()["models"]]
                assert resident == [f"{model}:latest"]
                # What the load measured is what was estimated before it.
                assert hub.slots[model].measured_bytes == estimates[model]
        grown = rss[1] - rss[0]
        print(f"RSS: idle {rss[0] / MIB:.0f} MiB, peak +{grown / MIB:.0f} MiB, budget 700 MiB")
        assert grown <= budget + LOAD_HEADROOM, grown
    finally:
        running.stop()
