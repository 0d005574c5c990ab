"""A model load as a sequence of steps, so a server of several models can keep every MLX
evaluation on its one engine thread (#27 item 3) while a resident model goes on stepping.

A loader is a generator. Each `yield Step(...)` ends one slice of the load and says where
the next slice runs: `WORKER` (reading files, JSON, tokenizers: no MLX) may run on any
thread; a `host(label)` step builds or evaluates MLX arrays and runs on the thread that
steps the engines (engine/host.py `EngineHost.run_steps`), between other models' steps
(after each step, slices for about as long as that step took). The weights are
evaluated `SLICE_BYTES` at a time (`evaluate_in_slices`), so one slice costs at most
about one decode step.

`run_inline` runs every step on the calling thread, one after the other: single-model
start-up, the CLI's converters and the tests load exactly as before.

Every load-time evaluation goes through `evaluate`, which tells the `watch_evaluations`
observers (tests) which thread ran it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import mlx.core as mx
    from mlx.nn.layers.base import Module

__all__ = [
    "SLICE_BYTES",
    "WORKER",
    "Evaluation",
    "LoadSteps",
    "Step",
    "evaluate",
    "evaluate_in_slices",
    "host",
    "run_inline",
    "watch_evaluations",
]

T = TypeVar("T")
logger = logging.getLogger(__name__)

# Bytes of parameters one host slice evaluates (a larger single array is a slice of its
# own). 16 MiB of dense float32 dequantized from Q4 is ~20-90 ms on this CPU: about one
# decode step of a small model; a few milliseconds on a GPU.
SLICE_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Step:
    """Where the next slice of a load runs: on the engine host's thread or anywhere."""

    on_host: bool
    label: str


WORKER = Step(on_host=False, label="files")


def host(label: str) -> Step:
    return Step(on_host=True, label=label)


LoadSteps = Generator[Step, None, T]


def run_inline(steps: Generator[Step, None, T]) -> T:
    """Run every step of a load on this thread; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            result: T = stop.value
            return result


@dataclass(frozen=True)
class Evaluation:
    label: str
    thread: str
    arrays: int


_observers: list[Callable[[Evaluation], None]] = []
_observers_lock = threading.Lock()


@contextlib.contextmanager
def watch_evaluations() -> Iterator[list[Evaluation]]:
    """Every load-time evaluation (from any thread) while the block runs."""
    seen: list[Evaluation] = []
    with _observers_lock:
        _observers.append(seen.append)
    try:
        yield seen
    finally:
        with _observers_lock:
            _observers.remove(seen.append)


def evaluate(arrays: list[mx.array], label: str) -> None:
    """`mx.eval` of a load's arrays, reported to the observers."""
    import mlx.core as mx

    mx.eval(arrays)
    note_evaluation(label, len(arrays))


def note_evaluation(label: str, arrays: int) -> None:
    """Tell the observers this thread evaluated MLX work for a load (for evaluations that
    run inside code that is not the loader's, such as the engine's start-up forwards)."""
    with _observers_lock:
        observers = list(_observers)
    if observers:
        event = Evaluation(label, threading.current_thread().name, arrays)
        for observer in observers:
            observer(event)


def byte_slices(arrays: list[mx.array], limit: int) -> list[list[mx.array]]:
    """Consecutive groups of at most `limit` bytes (one larger array is a group alone)."""
    groups: list[list[mx.array]] = []
    current: list[mx.array] = []
    size = 0
    for array in arrays:
        nbytes = int(array.nbytes)
        if current and size + nbytes > limit:
            groups.append(current)
            current, size = [], 0
        current.append(array)
        size += nbytes
    if current:
        groups.append(current)
    return groups


def evaluate_in_slices(
    model: Module, label: str, *, log: logging.Logger = logger, limit: int | None = None
) -> LoadSteps[None]:
    """Materialize a model's parameters `limit` (default `SLICE_BYTES`) bytes per host
    slice, logging progress about every 25%."""
    from compat_serve.models.weights import model_arrays

    groups = byte_slices(list(model_arrays(model).values()), limit or SLICE_BYTES)
    total = len(groups)
    every = max(1, total // 4)
    for i, group in enumerate(groups, 1):
        yield host(f"{label} {i}/{total}")
        evaluate(group, label)
        if i % every == 0 or i == total:
            log.info("%s: %d/%d slices ready", label, i, total)


def advance(steps: Generator[Step, None, Any]) -> tuple[bool, Any]:
    """One slice of `steps`: (False, the next Step) or (True, the load's result).
    StopIteration cannot cross a Future, hence the pair."""
    try:
        return False, next(steps)
    except StopIteration as stop:
        return True, stop.value
