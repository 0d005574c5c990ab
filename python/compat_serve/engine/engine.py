"""The engine: one dedicated thread runs every MLX forward pass.

HTTP handlers call `submit()` from the event loop and read a `RequestStream`; the engine
thread takes commands from a thread-safe inbox and, between commands, runs steps. Each
step asks the Rust scheduler for a plan (`schedule()`), executes it with MLX
(`StepExecutor`: one batched decode forward for every running request, then chunked
prefills) and reports back (`update()`), which ends requests on stop tokens, max tokens
or a full context. Aborts are applied between steps, so a request leaves at most one step
(one prefill chunk) after its client goes away.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compat_serve._native import Scheduler
from compat_serve.adapters.bank import AdapterBank
from compat_serve.adapters.files import AdapterFiles, read_adapter
from compat_serve.engine.config import EngineConfig
from compat_serve.engine.constraints import GrammarMatcher, Grammars
from compat_serve.engine.detokenizer import IncrementalDetokenizer
from compat_serve.engine.draft_model import with_draft_model
from compat_serve.engine.errors import EngineOverloaded, EngineStopped, PromptTooLong
from compat_serve.engine.executor import StepExecutor
from compat_serve.engine.host import EngineHost, WakingInbox
from compat_serve.engine.kv_events import open_kv_events
from compat_serve.engine.kv_quant import KVFormat, check_head_dim
from compat_serve.engine.memory import MemoryBudget, auto_context_length, plan_memory
from compat_serve.engine.metrics import EngineMetrics, Gauge
from compat_serve.engine.mlx_threads import release_thread_mlx
from compat_serve.engine.mtp_setup import with_mtp_head
from compat_serve.engine.prefix.cache import PrefixCaching
from compat_serve.engine.prefix.disk import DiskStore, open_disk_tier
from compat_serve.engine.prefix.pins import pin_table
from compat_serve.engine.prefix.store import is_attention_cache
from compat_serve.engine.reasoning_budget import BudgetCounter
from compat_serve.engine.runner import ModelRunner
from compat_serve.engine.sequence import Sequence
from compat_serve.engine.status import RequestStatus, StatusBoard
from compat_serve.engine.stop_strings import StopStringMatcher
from compat_serve.engine.stream import RequestStream
from compat_serve.engine.types import EngineRequest, FinishReason, Grammar
from compat_serve.engine.vllm_metrics import attach_vllm_metrics
from compat_serve.models.device_memory import weights_nbytes
from compat_serve.models.types import LoadedModel

log = logging.getLogger("compat_serve.engine")

# Share of the device's memory left after the weights and the headroom (engine/memory.py)
# that the running requests' KV may take when --kv-memory is not given.
DEFAULT_KV_MEMORY_SHARE = 0.3
# The same for the prefix cache when --cache-memory is not given.
DEFAULT_CACHE_MEMORY_SHARE = 0.2
_STALL_WAIT_S = 0.01


@dataclass(frozen=True)
class _Submit:
    sequence: Sequence


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Stop:
    pass


@dataclass(frozen=True)
class _Call:
    """Work that must run on the engine thread between steps (adapters' MLX arrays)."""

    work: Callable[[], Any]
    future: Future[Any]


_Command = _Submit | _Abort | _Stop | _Call

# How long add_adapter / remove_adapter wait for the engine thread.
_CALL_TIMEOUT_S = 120.0


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.model = loaded
        self.config = config or EngineConfig()
        self.config.validate()
        self.status = StatusBoard()
        self.metrics = EngineMetrics(loaded.name)
        kv_format = self.config.kv_format
        self._runner = ModelRunner(loaded, kv_format)
        check_head_dim(self._runner.head_dims() if kv_format.quantized else [], kv_format)
        if self._runner.features is not None:
            self.metrics.extra_renderers.append(self._runner.features.render_metrics)
        tokenizer = loaded.tokenizer
        self._eos_ids = frozenset(tokenizer.eos_token_ids)
        self._special_ids = frozenset(tokenizer.special_token_ids)
        # Constrained decoding: the vocabulary as the grammar engine sees it, built on the
        # first request with a grammar (0.2 s for a 49k vocabulary).
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self._kv_bytes_per_token = self._runner.measure_kv_bytes_per_token()
        self.memory = self._plan_memory()
        self.kv_capacity_tokens = self._kv_capacity_tokens()
        if self.config.auto_context:
            loaded = self.model = dataclasses.replace(
                loaded,
                context_length=auto_context_length(loaded.context_length, self.kv_capacity_tokens),
            )
        self.metrics.extra_renderers.append(self._render_kv_format)
        self.prefix = self._prefix_caching()
        # Longest prompt that leaves room for one generated token.
        self.max_prompt_tokens = min(loaded.context_length, self.kv_capacity_tokens + 1) - 1
        self._scheduler = Scheduler(
            self.config.max_num_seqs,
            self.config.batched_tokens,
            self.config.prefill_chunk,
            self.kv_capacity_tokens,
            loaded.context_length,
            decode_prefill_chunk=self.config.prefill_chunk_while_decoding,
        )
        self.metrics.kv_tokens_capacity.set(self.kv_capacity_tokens)
        if self.prefix is not None:
            self.metrics.prefix_source = self.prefix.metrics
        self.kv_events = self.prefix.events if self.prefix is not None else None
        self.vllm_metrics = attach_vllm_metrics(self.metrics, self.config, self.prefix, loaded.name)
        self._executor = StepExecutor(
            self._runner,
            self._scheduler,
            self.status,
            self.metrics,
            self.config.progress_interval_s,
            on_finished=self._release_slot,
            prefix=self.prefix,
            prefill_chunk=self.config.prefill_chunk,
            speculation=with_mtp_head(with_draft_model(self.config.speculation, loaded), loaded),
        )
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._queued = 0  # submitted but not yet finished; read by submit() for backpressure
        self._queued_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.on_stopped: Callable[[], None] | None = None
        # Called on the engine thread when it has nothing to do; returns how long to wait
        # for a command before calling it again.
        self.on_idle: Callable[[], float] | None = None
        # Distributed mode, world size, rank and plan collectives (/v1/status, /metrics).
        self.distributed_status: Callable[[], dict[str, object]] | None = None

    def cache_pins_status(self) -> list[dict[str, object]]:
        """The prefix cache's live `cache_control` pins, for /v1/status (the Rust cache
        locks itself: safe from any thread)."""
        return [] if self.prefix is None else pin_table(self.prefix.cache)

    def speculation_status(self) -> dict[str, object]:
        """Drafted and accepted tokens (speculative decoding), for /v1/status."""
        return self._executor.spec_stats.status()

    @property
    def kv_memory_bytes(self) -> int:
        """The running requests' KV budget (--kv-memory, in bytes of the stored format)."""
        return self.memory.kv

    @property
    def cache_memory_bytes(self) -> int:
        """The prefix cache's RAM budget (--cache-memory)."""
        return self.memory.cache

    @property
    def kv_bytes_per_token(self) -> int:
        """K/V bytes one position takes across all layers (measured at startup)."""
        return self._kv_bytes_per_token

    @property
    def kv_layout(self) -> dict[str, object]:
        """The KV cache's layer kinds and element type, as measured at startup."""
        return self._runner.kv_layout

    @property
    def weights_bytes(self) -> int:
        """Bytes of the model's parameters (the draft model's not included)."""
        return self._runner.weights_bytes

    @property
    def kv_format(self) -> KVFormat:
        return self.config.kv_format

    def kv_format_status(self) -> dict[str, object]:
        """The KV format, for /v1/status and the startup log."""
        kv_format = self.config.kv_format
        return {
            "format": kv_format.tag,
            "bits": kv_format.bits,
            "group_size": kv_format.group_size if kv_format.quantized else None,
            "dtype": self._kv_value_dtype(),
            "bytes_per_token": self._kv_bytes_per_token,
        }

    def _kv_value_dtype(self) -> str:
        """The element type of unquantized K/V as measured at startup: with `--dtype
        quantized` the weights are "quantized-4bit" but K/V are the activations' float
        type. Quantized K/V report the model's dtype, as before."""
        measured = self.kv_layout.get("dtype")
        if not self.config.kv_format.quantized and isinstance(measured, str):
            return measured
        return self.model.dtype

    def _render_kv_format(self) -> list[str]:
        kv_format = self.config.kv_format
        info = Gauge(
            "compat_kv_cache_format_info",
            "How attention K/V is stored (--kv-bits, --kv-group-size): format, bits, group.",
            {
                "format": kv_format.tag,
                "bits": str(kv_format.bits or 0),
                "group_size": str(kv_format.group_size if kv_format.quantized else 0),
            },
        )
        info.set(1)
        per_token = Gauge(
            "compat_kv_bytes_per_token",
            "Bytes of K/V one position takes across all layers, in the stored format.",
        )
        per_token.set(self._kv_bytes_per_token)
        return [*info.render(), *per_token.render()]

    def _plan_memory(self) -> MemoryBudget:
        """The device's budget (engine/memory.py), logged; a start-up error if the given
        --kv-memory and --cache-memory do not fit beside the weights and the headroom."""
        config = self.config
        budget = plan_memory(
            weights_nbytes(self.model.model),
            config.kv_memory_bytes,
            config.cache_memory_bytes if config.prefix_cache else 0,
            DEFAULT_KV_MEMORY_SHARE,
            DEFAULT_CACHE_MEMORY_SHARE,
        )
        log.info("memory: %s", budget.describe())
        budget.check()
        return budget

    def _kv_capacity_tokens(self) -> int:
        per_token = self._kv_bytes_per_token
        budget = self.memory.kv
        if per_token <= 0:  # no attention KV at all (pure recurrent model)
            return max(budget, 1)
        return max(budget // per_token, 2)

    def _prefix_caching(self) -> PrefixCaching | None:
        config = self.config
        if not config.prefix_cache:
            return None
        budget = self.memory.cache
        per_block = max(self._kv_bytes_per_token, 1) * config.block_size
        hybrid = not all(is_attention_cache(c) for c in self._runner.new_cache())
        num_blocks = max(budget // per_block, 1)
        log.info(
            "prefix cache: %d blocks of %d tokens (%.0f MiB)%s",
            num_blocks,
            config.block_size,
            num_blocks * per_block / 2**20,
            ", state snapshots for hybrid layers" if hybrid else "",
        )
        return PrefixCaching(
            block_size=config.block_size,
            num_blocks=num_blocks,
            hybrid=hybrid,
            hash_kind=config.cache_hash,
            snapshot_budget_bytes=budget // 4,
            kv_format=config.kv_format,
            disk=self._disk_store(),
            pin_fraction=config.cache_pin_fraction,
            events=open_kv_events(config, self.metrics),
        )

    def _disk_store(self) -> DiskStore | None:
        return open_disk_tier(self.config, self.model, self._kv_bytes_per_token)

    # ---- called from other threads -------------------------------------------------

    def start(self, host: EngineHost | None = None) -> None:
        """Start stepping: on a thread of its own, or on `host`'s thread with the other
        engines it steps (engine/host.py). An engine with distributed hooks (`on_idle`)
        always runs its own loop: the beats to the other ranks live there."""
        if self.on_idle is not None:
            host = None
        if self._thread is None:
            if host is None:
                self._thread = threading.Thread(target=self._run, name="compat-engine", daemon=True)
                self._thread.start()
            else:
                self._host_wake = host.wake
                self._hosted_done = threading.Event()
                self._inbox = WakingInbox(host.wake)  # nothing is queued before start
                self._thread = host.attach(self)
            log.info(
                "engine: up to %d sequences per batch, %d tokens per step, prefill chunk %d, "
                "KV room for %d tokens, KV stored as %s (%d bytes per token)%s",
                self.config.max_num_seqs,
                self.config.batched_tokens,
                self.config.prefill_chunk,
                self.kv_capacity_tokens,
                self.config.kv_format.describe(self._kv_value_dtype()),
                self._kv_bytes_per_token,
                "" if host is None else f", on the shared engine thread ({host.engines} models)",
            )

    @property
    def running(self) -> bool:
        hosted_done = getattr(self, "_hosted_done", None)
        if hosted_done is not None and hosted_done.is_set():
            return False
        return self._thread is not None and self._thread.is_alive()

    @property
    def vision_encoder_runs(self) -> int:
        """Vision-encoder forward passes so far (0 for text-only models)."""
        return self._runner.features.encoder_runs if self._runner.features is not None else 0

    def submit(
        self, request: EngineRequest, loop: asyncio.AbstractEventLoop | None = None
    ) -> RequestStream:
        """Queue a request; returns its event stream. Raises on overload or oversize."""
        if self._stopping.is_set() or not self.running:
            raise EngineStopped("the engine is not running")
        max_prompt = self.max_prompt_tokens + (1 if request.sampling.max_tokens == 0 else 0)
        if len(request.prompt_ids) > max_prompt:
            raise PromptTooLong(len(request.prompt_ids), max_prompt)
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        if request.vision is not None and self._runner.features is None:
            raise ValueError("this model is text-only and cannot read images")
        if request.adapter is not None:
            request = self._with_adapter_salt(request)
        constraint = self.compile_grammar(request.grammar) if request.grammar else None
        with self._queued_lock:
            if self._queued >= self.config.max_queue:
                raise EngineOverloaded(self._queued, self.config.max_queue)
            self._queued += 1
        stream = RequestStream(request.request_id, loop or asyncio.get_running_loop(), self.abort)
        if self.prefix is not None:
            images = request.vision.cache_keys() if request.vision is not None else None
            stream.cache_preview = self.prefix.preview(
                request.prompt_ids, request.cache_salt, images
            )
        seq = Sequence(
            request=request,
            stream=stream,
            detokenizer=IncrementalDetokenizer(
                self.model.tokenizer, self._special_ids, request.visible_special_ids
            ),
            stops=StopStringMatcher(request.sampling.stop_strings),
            stop_ids=frozenset(request.sampling.stop_token_ids)
            | (self._eos_ids if request.sampling.stop_at_eos else frozenset()),
            constraint=constraint,
            budget=BudgetCounter(request.reasoning_budget)
            if request.reasoning_budget is not None
            else None,
        )
        self.status.put(
            RequestStatus(
                request.request_id,
                "queued",
                len(request.prompt_ids),
                submitted_at=seq.timings.submitted,
                client=request.client,
            )
        )
        self.metrics.on_submit(request.request_id, seq.prompt_len, seq.timings.submitted)
        self._inbox.put(_Submit(seq))
        return stream

    # ---- LoRA adapters (compat_serve/adapters) --------------------------------------

    @property
    def adapters(self) -> AdapterBank | None:
        """The adapters this model serves (None until the first is added)."""
        return self._runner.adapters

    def adapter_names(self) -> list[str]:
        bank = self._runner.adapters
        return [] if bank is None else bank.names()

    def add_adapter(self, name: str, path: str | Path) -> AdapterFiles:
        """Serve the adapter at `path` as `name` (replacing one of that name that no
        request uses): its files are read here, its MLX arrays made on the engine thread.
        AdapterError (a ValueError) says what is wrong with it. Blocks; call it off the
        event loop (`asyncio.to_thread`)."""
        weights = read_adapter(path, name)

        def work() -> AdapterFiles:
            users = self._executor.requests_with_adapter(name)
            if users:  # their rows must not change adapter halfway
                raise ValueError(f"the adapter {name!r} is in use by {users} request(s)")
            bank = self._runner.adapters or AdapterBank.install(self.model.model)
            bank.add(name, weights)
            self._runner.adapters = bank
            return bank.info(name)

        files: AdapterFiles = self._on_engine_thread(work)
        log.info("adapter %s: %s (%s, rank %d)", name, files.path, files.format, files.rank)
        return files

    def remove_adapter(self, name: str) -> None:
        """Stop serving `name`. ValueError while requests with it are in flight; KeyError
        for a name not loaded."""

        def work() -> None:
            bank = self._runner.adapters
            if bank is None or name not in bank.names():
                raise KeyError(f"no adapter named {name!r}")
            users = self._executor.requests_with_adapter(name)
            if users:
                raise ValueError(f"the adapter {name!r} is in use by {users} request(s)")
            bank.remove(name)

        self._on_engine_thread(work)

    def _on_engine_thread(self, work: Callable[[], Any]) -> Any:
        # Not started (or stopped): nothing else runs MLX for it; on its own thread
        # already (a host's load slice): waiting for the inbox would never return.
        if not self.running or threading.current_thread() is self._thread:
            return work()
        future: Future[Any] = Future()
        self._inbox.put(_Call(work, future))
        return future.result(timeout=_CALL_TIMEOUT_S)

    def _with_adapter_salt(self, request: EngineRequest) -> EngineRequest:
        """Refuse an unknown adapter; mix the adapter's fingerprint into the cache salt,
        so its KV blocks (RAM and disk) are never shared with the base model's or another
        adapter's, and an adapter whose files change stops matching its old blocks."""
        bank = self._runner.adapters
        name = request.adapter
        if bank is None or name not in bank.names():
            loaded = ", ".join(self.adapter_names()) or "none"
            raise ValueError(f"unknown adapter {name!r} (loaded: {loaded})")
        salt = (request.cache_salt or b"") + b"\0lora:" + bank.info(name).fingerprint.encode()
        return dataclasses.replace(request, cache_salt=salt)

    @property
    def logits_width(self) -> int:
        return self._runner.logits_width

    def compile_grammar(self, grammar: Grammar) -> GrammarMatcher:
        """A fresh matcher for `grammar`; GrammarError (a ValueError) says what is wrong."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.model.tokenizer, self._runner.logits_width)
        started = time.monotonic()
        matcher = self._grammars.compile(grammar)
        self.metrics.grammar_compile_seconds.observe(time.monotonic() - started)
        return matcher

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished."""
        with self._queued_lock:
            return self._queued

    def shutdown(self, timeout: float = 30.0) -> None:
        """End everything in flight (`FinishReason.SHUTDOWN`) and stop the thread (a
        host's thread goes on stepping its other engines)."""
        self._stopping.set()
        self._inbox.put(_Stop())
        hosted_done = getattr(self, "_hosted_done", None)
        if hosted_done is not None:
            self._host_wake.set()
            hosted_done.wait(timeout)
        elif self._thread is not None:
            self._thread.join(timeout)
        if self.kv_events is not None:
            self.kv_events.shutdown()
        if self.prefix is not None:
            self.prefix.close()

    def _release_slot(self) -> None:
        with self._queued_lock:
            self._queued -= 1

    # ---- the engine thread ---------------------------------------------------------

    def _run(self) -> None:
        executor = self._executor
        wait: float | None = None  # idle: sleep until a command arrives
        if self.on_idle is not None:
            wait = 0.0  # the idle beat starts at once
        try:
            while self._drain_inbox(wait):
                wait = None
                if executor.has_work and executor.step():
                    wait = 0.0
                elif self.on_idle is not None:  # distributed: a heartbeat to the other ranks
                    wait = self.on_idle()
                elif executor.has_work:
                    # A plan with nothing to compute (everyone waits for KV) must not spin.
                    wait = _STALL_WAIT_S
        except Exception:  # a scheduler bug: fail every request loudly, never hang them
            log.exception("the engine loop failed; aborting every request")
        self._end_leftovers()
        release_thread_mlx()
        log.info("engine thread stopped")

    def _end_leftovers(self) -> None:
        leftover = []
        while True:  # submissions that raced with the stop command
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Submit):
                leftover.append(command.sequence)
            elif isinstance(command, _Call):
                command.future.set_exception(EngineStopped("the engine stopped"))
        self._executor.abort_all(leftover, FinishReason.SHUTDOWN)
        if self.on_stopped is not None:  # distributed: tell the other ranks, from this thread
            self.on_stopped()

    # On a host's thread (engine/host.py): the same loop, one turn at a time.

    def _hosted_has_work(self) -> bool:
        return self._executor.has_work

    def _hosted_step(self) -> bool:
        """One step; False when nothing could be computed (everyone waits for KV)."""
        return self._executor.step()

    def _hosted_finish(self, *, failed: bool) -> None:
        """Stopped (or failed): end what is left, as `_run` does when its loop ends."""
        if failed:
            self._stopping.set()
        self._end_leftovers()
        self._hosted_done.set()
        log.info("engine of %s stopped", self.model.name)

    def _drain_inbox(self, wait: float | None) -> bool:
        """Apply queued commands, waiting up to `wait` seconds (None: forever) for the
        first; False once asked to stop."""
        while True:
            try:
                command = self._inbox.get(block=wait != 0.0, timeout=wait or None)
            except queue.Empty:
                return True
            wait = 0.0
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Submit):
                self._executor.admit(command.sequence)
            elif isinstance(command, _Call):
                _run_call(command)
            else:
                self._executor.abort(command.request_id)


def _run_call(call: _Call) -> None:
    if not call.future.set_running_or_notify_cancel():
        return
    try:
        result = call.work()
    except BaseException as exc:  # the caller's error, raised in the caller's thread
        call.future.set_exception(exc)
    else:
        call.future.set_result(result)
