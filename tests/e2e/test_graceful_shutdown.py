"""SIGTERM on a real `compat-serve` process: admission stops, in-flight requests finish
(or end with a terminal error at `--shutdown-timeout`), and the process exits 0.

Each run drives four requests at once — streamed and non-streamed, through both APIs —
then signals the server while they generate.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.conftest import free_port
from tests.tiny_models import write_model_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

SERVE = Path(sys.executable).with_name("compat-serve")
# A JSON array that cannot end within the token budget: these requests run until cut.
ENDLESS = {"type": "array", "items": {"type": "integer"}, "minItems": 5000}


@dataclass
class Outcome:
    status: int
    body: str


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Any] = []

    def start(shutdown_timeout: float, *model: str) -> tuple[str, subprocess.Popen[bytes]]:
        port = free_port()
        log = (tmp_path / f"server-{port}.log").open("wb")
        logs.append(log)
        proc = subprocess.Popen(
            [str(SERVE), "--port", str(port), "--shutdown-timeout", str(shutdown_timeout), *model],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    return base, proc
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError("server did not start")

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for log in logs:
        log.close()


def bodies(endless: bool) -> list[tuple[str, dict[str, Any]]]:
    ask = [{"role": "user", "content": "Count from one to fifty."}]
    openai: dict[str, Any] = {"model": "m", "messages": ask, "temperature": 0, "max_tokens": 12}
    anthropic: dict[str, Any] = {"model": "m", "messages": ask, "max_tokens": 12}
    if endless:
        openai.update(
            max_tokens=4000,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": ENDLESS},
            },
        )
        anthropic.update(
            max_tokens=4000, output_config={"format": {"type": "json_schema", "schema": ENDLESS}}
        )
    return [
        ("/v1/chat/completions", {**openai, "stream": True}),
        ("/v1/chat/completions", openai),
        ("/v1/messages", {**anthropic, "stream": True}),
        ("/v1/messages", anthropic),
    ]


async def drive(base: str, proc: subprocess.Popen[bytes], endless: bool) -> list[Outcome]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:

        async def one(path: str, body: dict[str, Any]) -> Outcome:
            if body.get("stream"):
                async with client.stream("POST", path, json=body) as response:
                    text = "".join([chunk async for chunk in response.aiter_text()])
                    return Outcome(response.status_code, text)
            response = await client.post(path, json=body)
            return Outcome(response.status_code, response.text)

        tasks = [asyncio.create_task(one(path, body)) for path, body in bodies(endless)]
        # Signal once all four are generating.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = (await client.get("/v1/status")).json()
            if sum(r.get("phase") == "decode" for r in status.get("requests", [])) >= 4:
                break
            await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        # Draining: nothing new is admitted, and /health tells routers so.
        refused_openai = await client.post("/v1/chat/completions", json=bodies(False)[1][1])
        refused_anthropic = await client.post("/v1/messages", json=bodies(False)[3][1])
        health = await client.get("/health")
        assert health.status_code == 503, health.text
        for refused in (refused_openai, refused_anthropic):
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"]
        assert refused_openai.json()["error"]["message"].startswith("the server is shutting down")
        assert refused_anthropic.json()["type"] == "error"
        return list(await asyncio.gather(*tasks))


def test_sigterm_lets_in_flight_requests_finish(serve: Any) -> None:
    base, proc = serve(60)
    openai_stream, openai_whole, anthropic_stream, anthropic_whole = asyncio.run(
        drive(base, proc, endless=False)
    )
    assert openai_stream.status == 200 and openai_stream.body.rstrip().endswith("data: [DONE]")
    assert '"finish_reason":' in openai_stream.body.replace('":"', '": "')
    assert openai_whole.status == 200
    assert json.loads(openai_whole.body)["choices"][0]["finish_reason"] in ("length", "stop")
    assert anthropic_stream.status == 200 and "event: message_stop" in anthropic_stream.body
    assert anthropic_whole.status == 200
    assert json.loads(anthropic_whole.body)["stop_reason"] in ("max_tokens", "end_turn")
    assert proc.wait(timeout=60) == 0


def test_sigterm_ends_what_is_left_at_the_timeout(serve: Any) -> None:
    base, proc = serve(1)
    openai_stream, openai_whole, anthropic_stream, anthropic_whole = asyncio.run(
        drive(base, proc, endless=True)
    )
    # Streams end with a terminal error event; OpenAI's then closes with [DONE].
    assert openai_stream.status == 200
    last_data = [line for line in openai_stream.body.splitlines() if line.startswith("data: ")]
    assert last_data[-1] == "data: [DONE]"
    assert "shutting down" in json.loads(last_data[-2][6:])["error"]["message"]
    assert anthropic_stream.status == 200
    assert (
        "event: error" in anthropic_stream.body
        and "event: message_stop" not in anthropic_stream.body
    )
    assert "overloaded_error" in anthropic_stream.body
    # Non-streamed requests answer 503 in their API's shape.
    assert openai_whole.status == 503, openai_whole.body
    assert "shutting down" in json.loads(openai_whole.body)["error"]["message"]
    assert anthropic_whole.status == 503, anthropic_whole.body
    assert json.loads(anthropic_whole.body)["type"] == "error"
    assert proc.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, embedded_model: LoadedModel) -> Path:
    path = tmp_path_factory.mktemp("shutdown-model") / "llama"
    write_model_dir(path, "llama", embedded_model)
    return path


def test_a_second_signal_exits_at_once(serve: Any, tiny_llama_dir: Path) -> None:
    # A tiny random llama directory: the endless request's text does not matter, and its
    # load is a fraction of the embedded model's.
    base, proc = serve(600, "--model", str(tiny_llama_dir))

    async def run() -> None:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            path, body = bodies(True)[1]
            task = asyncio.create_task(client.post(path, json=body))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                status = (await client.get("/v1/status")).json()
                if any(r.get("phase") == "decode" for r in status.get("requests", [])):
                    break
                await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            assert proc.poll() is None  # draining, up to 600 s
            proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            proc.wait(timeout=30)
            assert time.monotonic() - started < 15
            task.cancel()

    asyncio.run(run())
