"""A configured model's place in the hub: its state and lease counts (`ModelSlot`), the
error a request gets when it cannot have its model, and the small helpers the hub and
its routes share (lifetimes in request bodies, resident sizes)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NoReturn, Protocol, TypeVar, cast

from compat_serve.registry.adapters import AdapterEntry
from compat_serve.registry.entries import ModelEntry

if TYPE_CHECKING:
    import asyncio

    from compat_serve.embeddings.state import EmbeddingState
    from compat_serve.engine.engine import Engine


class ChatState(Protocol):
    """What the hub reads and sets on a chat model's state (the server's `ServerState`):
    its engine, what a hub of that one model takes from it, and the draining flag."""

    draining: bool

    @property
    def engine(self) -> Engine: ...
    @property
    def served_model_name(self) -> str: ...
    @property
    def api_key(self) -> str | None: ...
    @property
    def strict_model_names(self) -> bool: ...
    @property
    def max_request_bytes(self) -> int: ...


# The chat models' state type a hub holds; a resident model is a `ChatT` or an
# embedding/reranker model's `EmbeddingState`.
ChatT = TypeVar("ChatT", bound=ChatState)


class ModelRequestError(Exception):
    """Why a request cannot have its model: `status` is the OpenAI-side HTTP status;
    `overloaded` marks a wait for memory that timed out (529 on Anthropic routes)."""

    def __init__(
        self, status: int, message: str, *, code: str | None = None, overloaded: bool = False
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.overloaded = status, message, code, overloaded


@dataclass
class ModelSlot(Generic[ChatT]):
    entry: ModelEntry
    state: ChatT | EmbeddingState | None = None
    loading: asyncio.Task[ChatT | EmbeddingState] | None = None
    unloading: bool = False
    last_used: float = 0.0
    loaded_at: float = 0.0
    resident_bytes: int = 0
    # Bytes measured at the last load (the next load's estimate).
    measured_bytes: int | None = None
    # Overrides from request bodies (Ollama keep_alive, LM Studio ttl).
    ttl_s: float | None = None
    pinned: bool = False
    failure: str | None = None
    failure_stamp: float | None = None
    # HTTP requests routed here whose responses have not ended.
    leases: int = 0

    @property
    def status(self) -> str:
        if self.state is not None and not self.unloading:
            return "loaded"
        return "loading" if self.loading is not None else "unloaded"

    @property
    def kind(self) -> str:
        """ "chat", "embedding" or "reranker": the resident model's, else read from its
        directory (config.json, sentence-transformers files) without loading it."""
        if self.state is not None:
            return model_kind_of(self.state)
        return path_kind(self.entry.path)

    @property
    def chat_state(self) -> ChatT | None:
        """The state if it is a chat model's (what chat routes and engine views read)."""
        from compat_serve.embeddings.state import EmbeddingState

        return None if isinstance(self.state, EmbeddingState) else self.state

    @property
    def in_flight(self) -> int:
        return 0 if self.state is None else self.state.engine.in_flight

    def busy(self) -> bool:
        return self.in_flight > 0 or self.leases > 0

    def expired(self, now: float) -> bool:
        return self.ttl_s is not None and now - self.last_used >= self.ttl_s


def files_stamp(path: str | None) -> float | None:
    """The newest modification time under a model path (None: the embedded model)."""
    if path is None:
        return None
    try:
        if os.path.isdir(path):
            return max((e.stat().st_mtime for e in os.scandir(path)), default=0.0)
        return os.stat(path).st_mtime
    except OSError:
        return None


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_lifetime(body: Mapping[str, Any]) -> float | None:
    """Seconds a request asks its model to stay resident when idle (negative: forever):
    Ollama's `keep_alive` (seconds, or a duration such as "5m"; 0 unloads once idle, -1
    pins) or LM Studio's `ttl` (seconds). None when the body sets neither or a value is
    not understood."""
    value = body.get("keep_alive", body.get("ttl"))
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        text = value.strip().lower()
        for unit in sorted(_DURATION_UNITS, key=len, reverse=True):
            if text.endswith(unit):
                try:
                    return float(text[: -len(unit)]) * _DURATION_UNITS[unit]
                except ValueError:
                    return None
        try:
            return float(text)
        except ValueError:
            return None
    return None


def cannot_reload(entry: ModelEntry) -> NoReturn:
    raise RuntimeError(f"model {entry.id!r} was built by its embedder and cannot be reloaded")


def model_kind_of(state: ChatState | EmbeddingState) -> str:
    from compat_serve.embeddings.state import EmbeddingState

    return state.kind if isinstance(state, EmbeddingState) else "chat"


_KINDS: dict[tuple[str, float | None], str] = {}


def path_kind(path: str | None) -> str:
    """The kind of model at `path` (None: the embedded chat model), cached per files'
    stamp; a directory that cannot be read is left to its load to report."""
    if path is None:
        return "chat"
    key = (path, files_stamp(path))
    if key not in _KINDS:
        from pathlib import Path

        from compat_serve.embeddings.detect import model_kind

        try:
            _KINDS[key] = model_kind(Path(path))
        except (OSError, ValueError):
            _KINDS[key] = "chat"
    return _KINDS[key]


def resident_bytes(state: ChatState | EmbeddingState) -> int:
    """What a model holds once loaded (models/resident_size.py): its weights, its
    tokenizer, and the KV and prefix-cache memory the command line set aside for it
    (--kv-memory / --cache-memory as sizes). The default KV and cache budgets are limits
    the engine fills as requests come: /v1/status reports them as limits."""
    from compat_serve.models.resident_size import held_bytes

    engine = state.engine
    memory = engine.memory
    tokenizer = getattr(getattr(engine, "model", None), "tokenizer", None)
    vocab = int(getattr(tokenizer, "vocab_size", 0) or 0)
    return held_bytes(memory.weights, vocab) + int(getattr(memory, "reserved", 0))


def add_adapters(state: ChatState | EmbeddingState, adapters: Sequence[AdapterEntry]) -> None:
    """Add to a model's engine the adapters it serves that it does not hold yet (blocks
    on the engine thread once started; AdapterError, a ValueError, for bad files or a
    model that is not a chat model)."""
    if not adapters:
        return
    kind = model_kind_of(state)
    if kind != "chat":
        raise ValueError(f"LoRA adapters apply to chat models; this is an {kind} model")
    engine = cast("ChatState", state).engine
    held = set(engine.adapter_names())
    for adapter in adapters:
        if adapter.name not in held:
            engine.add_adapter(adapter.name, adapter.path)


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"
