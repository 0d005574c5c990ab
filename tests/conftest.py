"""Session-wide test setup.

The fast BLAS must be loaded before anything imports mlx.core, so it happens here at
import time. The embedded model is loaded once per session and served by a real
uvicorn server on a free loopback port, in a background thread.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

from compat_serve.models.blas import ensure_fast_blas

ensure_fast_blas()

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class RunningServer:
    base_url: str
    state: object
    thread: threading.Thread
    server: object

    def stop(self) -> None:
        self.server.should_exit = True  # type: ignore[attr-defined]
        self.thread.join(30)


def start_server(loaded: LoadedModel, **options: object) -> RunningServer:
    from compat_serve.bootstrap import ServeOptions, build_state
    from compat_serve.server.app import create_app

    state = build_state(ServeOptions(**options), loaded=loaded)  # type: ignore[arg-type]
    return run_app(create_app(state), state)


def run_app(app: object, state: object) -> RunningServer:
    """Serve an app on a free loopback port from a background thread."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="on",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.05)
    return RunningServer(f"http://127.0.0.1:{port}", state, thread, server)


@pytest.fixture(scope="module")
def info_logs() -> Iterator[None]:
    """The server's INFO lines reach the log ring (the CLI sets INFO; tests leave WARNING)."""
    logger = logging.getLogger("compat_serve")
    level = logger.level
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(level)


@pytest.fixture(scope="session")
def embedded_model() -> LoadedModel:
    from compat_serve.models.loader import load_model

    return load_model(None)


@pytest.fixture(scope="session")
def tiny_llama_model(embedded_model: LoadedModel) -> LoadedModel:
    """A randomly initialised two-layer llama with the embedded model's tokenizer and chat
    template (tests/tiny_models.py): the same engine and server paths at a fraction of the
    compute, for tests whose checks do not depend on what the model says (protocol shapes,
    usage and prefix-cache accounting)."""
    from tests.tiny_models import tiny_model

    return tiny_model("llama", embedded_model)


@pytest.fixture(scope="session")
def server(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    running = start_server(embedded_model)
    yield running
    running.stop()
