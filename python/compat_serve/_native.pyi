"""Type stubs for the Rust extension `compat_serve._native` (checked by mypy.stubtest)."""

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, final

__all__ = [
    "ChatTemplate",
    "Scheduler",
    "SchedulerError",
    "StepPlan",
    "TemplateError",
    "__version__",
]

__version__: str

class TemplateError(Exception):
    """A chat template failed to compile, failed to render, or called raise_exception()."""

class SchedulerError(Exception):
    """The scheduler was misused: unknown or duplicate request id, invalid status
    transition, or a step result that does not match its plan."""

@final
class ChatTemplate:
    """A compiled Hugging Face chat template, rendered like transformers does."""

    def __new__(cls, source: str, *, now: datetime | None = None) -> ChatTemplate: ...
    @property
    def source(self) -> str:
        """The template source as given."""

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        bos_token: str | None = None,
        eos_token: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders `messages` (plus `tools`, `documents` and any extra variables)."""

@final
class StepPlan:
    """One engine step: what to prefill, what to decode, what was evicted."""

    @property
    def prefill(self) -> list[tuple[str, int, int, bool]]:
        """`(id, start, len, is_last_chunk)`: compute tokens `[start, start + len)`; sample
        after a last chunk."""

    @property
    def decode(self) -> list[str]:
        """Requests that feed their last sampled token."""

    @property
    def preempted(self) -> list[str]:
        """Requests whose KV must be dropped; they are prefilled again from 0 later."""

    @property
    def num_tokens(self) -> int:
        """Tokens the step computes."""

@final
class Scheduler:
    """Continuous-batching scheduler: FIFO admission, chunked prefill, decode first,
    LIFO preemption with recompute under KV pressure."""

    def __new__(
        cls,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_chunk: int,
        kv_capacity_tokens: int,
        context_length: int,
    ) -> Scheduler: ...
    def add_request(
        self, id: str, prompt_len: int, max_tokens: int, stop_token_ids: Sequence[int] = ...
    ) -> None:
        """Queues a request (FIFO). `id` must not belong to a live request."""

    def schedule(self) -> StepPlan:
        """Plans the next step; `update()` must follow before the next `schedule()`."""

    def update(
        self, prefilled: Sequence[tuple[str, int]], sampled: Sequence[tuple[str, int]]
    ) -> list[tuple[str, str]]:
        """Reports the step: `prefilled` = `(id, tokens computed)` for every planned
        prefill, `sampled` = `(id, token)` for every decode and last chunk. Returns
        `(id, reason)` for each request that finished; they are forgotten."""

    def abort(self, id: str) -> bool:
        """Ends a request as aborted; `False` if it already ended or never existed."""

    def finish(self, id: str, reason: str) -> bool:
        """Ends a request for a reason decided in Python (`"external"` for a stop string or
        an error; also `"stop_token"`, `"max_tokens"`, `"context_full"`, `"aborted"`);
        `False` if it already ended or never existed."""

    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def kv_tokens_used(self) -> int: ...
    def snapshot(self) -> list[tuple[str, str, int, int]]:
        """`(id, status, computed, generated)` per live request, running first."""

    def check_invariants(self) -> None:
        """Raises `SchedulerError` if an internal invariant is broken (for tests)."""
