"""Threads that ran MLX free its per-thread state before they end (engine/mlx_threads.py).

Without that, a process whose worker thread ran a compiled MLX function (mlx-lm compiles
its activations and samplers) aborts at exit about half the time on MLX 0.32 ("terminate
called without an active exception", exit 134): the thread's compile cache is freed
after `join()` has returned, while the interpreter finalizes. Session 19 saw it in 3 of 8
runs of an engine with a 40-token prompt, and 9 of 20 runs of the script below without
the release."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import TYPE_CHECKING

import pytest

from compat_serve.engine import engine as engine_module
from compat_serve.engine import host as host_module
from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.host import EngineHost

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

COMPILE_ON_A_THREAD = """
import threading
import mlx.core as mx
from compat_serve.engine.mlx_threads import release_thread_mlx

double = mx.compile(lambda x: x * 2 + 1)

def work():
    mx.eval(double(mx.ones(4)))
    release_thread_mlx()

thread = threading.Thread(target=work)
thread.start()
thread.join()
print("exited its thread")
"""


def test_a_thread_that_compiled_then_released_lets_the_process_exit_cleanly() -> None:
    for _ in range(10):  # each exit races the thread's teardown: several tries
        done = subprocess.run(
            [sys.executable, "-c", COMPILE_ON_A_THREAD],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "terminate called" not in done.stderr
        assert done.stdout.strip() == "exited its thread"


@pytest.fixture
def releases(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that released their MLX state."""
    names: list[str] = []

    def record() -> None:
        names.append(threading.current_thread().name)

    monkeypatch.setattr(engine_module, "release_thread_mlx", record)
    monkeypatch.setattr(host_module, "release_thread_mlx", record)
    return names


def test_an_engine_thread_releases_mlx_as_it_ends(
    tiny_llama_model: LoadedModel, releases: list[str]
) -> None:
    engine = Engine(tiny_llama_model, EngineConfig(prefix_cache=False))
    engine.start()
    assert releases == []
    engine.shutdown()
    assert releases == ["compat-engine"]


def test_a_host_thread_releases_mlx_when_its_last_engine_leaves(
    tiny_llama_model: LoadedModel, releases: list[str]
) -> None:
    host = EngineHost(name="compat-host-release-test")
    first, second = (Engine(tiny_llama_model, EngineConfig(prefix_cache=False)) for _ in range(2))
    first.start(host)
    second.start(host)
    thread = first._thread
    assert thread is not None
    first.shutdown()
    assert releases == []  # the thread goes on stepping the other engine
    second.shutdown()
    thread.join(30)
    assert not thread.is_alive()
    assert releases == ["compat-host-release-test"]
