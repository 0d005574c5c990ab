"""Session-wide test setup.

The fast BLAS must be loaded before anything imports mlx.core, so it happens here at
import time. The embedded model is loaded once per session and served by a real
uvicorn server on a free loopback port, in a background thread.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

from compat_serve.models.blas import ensure_fast_blas

ensure_fast_blas()

# Tiny embedding/reranker model directories and loads (#37), shared by tests/python and
# tests/http.
pytest_plugins = ["tests.embedding_fixtures"]

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

# The users'-path lane (`make test-users-path`) sets this to "quantized": the session models
# keep their weights quantized (the embedded GGUF as shipped, the tiny llama through
# `mlx.nn.quantize`) and run stock mlx-lm modules, as on Metal and CUDA.
TEST_DTYPE_ENV = "COMPAT_SERVE_TEST_DTYPE"
TEST_DTYPE = os.environ.get(TEST_DTYPE_ENV, "auto")
USERS_PATH = TEST_DTYPE == "quantized"


def pytest_collection_finish(session: pytest.Session) -> None:
    """What exists once the tests are collected (the imported libraries, the test items)
    lives to the end: move it out of the garbage collector's sight (`gc.freeze`). Every
    full collection then walks only what the tests made since: `load_model` collects after
    each load (models/device_memory.py `collect_memory`), which walked the whole heap of a test
    process each time (~0.2-0.4 CPU s a load; test_families.py loads 18 models)."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests listed in tests/users_path_lane.py get the `users_path` marker (the lane
    runs `pytest -m users_path`). Tests marked `quantized_only` assert what only the users'
    path does (its weights stay quantized): they run in that lane and are deselected
    elsewhere. Tests marked `extended` run only in the extended run (tests/extended.py).
    The heaviest files go first (tests/heavy_files.py)."""
    from tests.heavy_files import heavy_first
    from tests.users_path_lane import USERS_PATH_TESTS

    items[:] = [items[i] for i in heavy_first([item.nodeid for item in items])]

    lane = set(USERS_PATH_TESTS)
    collected = {item.nodeid.split("[")[0] for item in items}
    for item in items:
        if item.nodeid.split("[")[0] in lane:
            item.add_marker(pytest.mark.users_path)
    whole_files = not config.option.keyword and all("::" not in a for a in config.args)
    if USERS_PATH and whole_files:
        # A renamed test would silently leave the lane: name it instead.
        files = {nodeid.split("::")[0] for nodeid in collected}
        missing = sorted(t for t in lane - collected if t.split("::")[0] in files)
        if missing:
            raise pytest.UsageError(f"tests/users_path_lane.py lists unknown tests: {missing}")
    if USERS_PATH:
        return
    from tests.extended import EXTENDED, EXTENDED_ONLY

    _mark_extended_only(items, EXTENDED_ONLY, whole_files)
    dropped = [
        item
        for item in items
        if item.get_closest_marker("quantized_only") is not None
        or (not EXTENDED and item.get_closest_marker("extended") is not None)
    ]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = set(map(id, dropped))
        items[:] = [item for item in items if id(item) not in gone]


def _mark_extended_only(items: list[pytest.Item], ids: tuple[str, ...], whole: bool) -> None:
    """Marks `extended` the tests tests/extended.py lists by id (exact, or the name without
    parameters); a listed id in a collected file that matches nothing is an error."""
    listed, matched = set(ids), set()
    for item in items:
        for key in (item.nodeid, item.nodeid.split("[")[0]):
            if key in listed:
                item.add_marker(pytest.mark.extended)
                matched.add(key)
    if whole:
        files = {item.nodeid.split("::")[0] for item in items}
        stale = sorted(k for k in listed - matched if k.split("::")[0] in files)
        if stale:
            raise pytest.UsageError(f"tests/extended.py lists unknown tests: {stale}")


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


@pytest.fixture
def kept_log_handlers() -> Iterator[None]:
    """The command's `main` run in this process attaches the dashboard's log ring to the
    server's loggers: take it off again."""
    from compat_serve.server.dashboard.log_ring import LOGGERS

    before = {name: list(logging.getLogger(name).handlers) for name in LOGGERS}
    yield
    for name, handlers in before.items():
        logging.getLogger(name).handlers[:] = handlers


@pytest.fixture(scope="session")
def embedded_model() -> LoadedModel:
    from compat_serve.models.loader import load_model

    return load_model(None, dtype=TEST_DTYPE)


@pytest.fixture(scope="session")
def tiny_llama_model(embedded_model: LoadedModel) -> LoadedModel:
    """A randomly initialised two-layer llama with the embedded model's tokenizer and chat
    template (tests/tiny_models.py): the same engine and server paths at a fraction of the
    compute, for tests whose checks do not depend on what the model says (protocol shapes,
    usage and prefix-cache accounting). Quantized in the users'-path lane."""
    from tests.tiny_models import quantize_tiny, tiny_model

    tiny = tiny_model("llama", embedded_model)
    return quantize_tiny(tiny) if USERS_PATH else tiny


@pytest.fixture(scope="session")
def server(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    running = start_server(embedded_model)
    yield running
    running.stop()
