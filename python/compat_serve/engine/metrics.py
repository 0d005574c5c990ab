"""Engine metrics, exposed in the Prometheus text format (version 0.0.4) by `GET /metrics`.

The engine thread reports what happens to each request through the `EngineMetrics.on_*`
hooks (`on_submit` also runs on HTTP handler threads); HTTP handlers read `render()` and
`progress()`. Every method is thread-safe. The exposition format is written here, so
`prometheus_client` is only a test dependency (its parser checks this output).

KV memory in use (`compat_kv_cache_bytes`) is an estimate: the sum over live requests of
(prompt tokens computed + tokens generated) x bytes per token. Bytes per token are
measured once, from the first real cache after a prefill chunk (`kv_bytes_per_token`):
the per-position size of every layer's K and V arrays, which is
2 x layers x kv_heads x head_dim x dtype bytes for plain attention and also right for
quantized or sliding-window caches. Constant-size recurrent state (SSM layers) is not
per token and is left out.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from compat_serve import __version__
from compat_serve.engine.types import FinishReason

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds. A slow CPU takes minutes to prefill a long agent prompt; a GPU takes ms.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Seconds to compile a grammar, and to compute one step's grammar masks (all rows).
GRAMMAR_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
BATCH_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
DURATION_BUCKETS = (
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1200.0,
    1800.0,
    3600.0,
)


# ---- exposition format ------------------------------------------------------------------


def format_value(value: float) -> str:
    """A sample value or `le` bound as Prometheus writes it (`+Inf`, `NaN`, `1.0`, `3`)."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_labels(labels: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{name}="{escape_label_value(value)}"' for name, value in labels)
    return f"{{{inner}}}" if inner else ""


def _header(name: str, help_text: str, kind: str) -> list[str]:
    return [f"# HELP {name} {escape_help(help_text)}", f"# TYPE {name} {kind}"]


class Counter:
    """A monotonically increasing count, optionally split by labels."""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name!r} must end in _total")
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._values: dict[tuple[str, ...], float] = {} if self.labelnames else {(): 0}

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {sorted(labels)}")
        return tuple(labels[n] for n in self.labelnames)

    def inc(self, amount: float = 1, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def touch(self, **labels: str) -> None:
        """Make a labelled series exist (at 0) before its first increment."""
        self.inc(0, **labels)

    def value(self, **labels: str) -> float:
        key = self._key(labels)
        with self._lock:
            return self._values.get(key, 0)

    def total(self) -> float:
        """The sum over every label set."""
        with self._lock:
            return sum(self._values.values())

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        lines = _header(self.name, self.help, "counter")
        for key, value in items:
            labels = format_labels(zip(self.labelnames, key, strict=True))
            lines.append(f"{self.name}{labels} {format_value(value)}")
        return lines


class Gauge:
    """A value that goes up and down (set by its owner, usually right before a render)."""

    def __init__(self, name: str, help_text: str, labels: dict[str, str] | None = None) -> None:
        self.name = name
        self.help = help_text
        self.labels = dict(labels or {})
        self._value: float = 0
        self._lock = threading.Lock()

    def set(self, value: float) -> None:
        with self._lock:
            self._value = value

    def value(self) -> float:
        with self._lock:
            return self._value

    def render(self) -> list[str]:
        return [
            *_header(self.name, self.help, "gauge"),
            f"{self.name}{format_labels(self.labels.items())} {format_value(self.value())}",
        ]


class Histogram:
    """Observations counted into cumulative `le` buckets, plus their sum and count."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        bounds = [float(b) for b in buckets]
        if not bounds or bounds != sorted(set(bounds)):
            raise ValueError("histogram buckets must be distinct and increasing")
        if not math.isinf(bounds[-1]):
            bounds.append(math.inf)
        self.name = name
        self.help = help_text
        self.bounds = tuple(bounds)
        self._counts = [0] * len(bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            for i, bound in enumerate(self.bounds):
                if value <= bound:
                    self._counts[i] += 1
                    break
            self._sum += value

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    @property
    def sum(self) -> float:
        with self._lock:
            return self._sum

    def render(self) -> list[str]:
        with self._lock:
            counts = list(self._counts)
            total = self._sum
        lines = _header(self.name, self.help, "histogram")
        cumulative = 0
        for bound, n in zip(self.bounds, counts, strict=True):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{format_value(bound)}"}} {cumulative}')
        lines.append(f"{self.name}_sum {format_value(total)}")
        lines.append(f"{self.name}_count {cumulative}")
        return lines


# ---- KV size ----------------------------------------------------------------------------


def _arrays(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in _arrays(v)]
    return [value] if hasattr(value, "nbytes") and hasattr(value, "shape") else []


def kv_bytes_per_token(cache: Iterable[Any]) -> int:
    """Bytes of K and V one sequence position takes across all layers of an mlx-lm cache.

    Reads each layer's `keys`/`values` (arrays shaped [batch, kv_heads, positions, ...],
    or tuples of them for quantized caches) and divides their size by batch x allocated
    positions; shapes and dtypes only, so lazy arrays are never evaluated. Layers without
    K/V (recurrent state) count 0; nested caches (`caches`) are walked. 0 when the cache
    holds nothing yet.
    """
    total = 0
    for layer in cache:
        nested = getattr(layer, "caches", None)
        if isinstance(nested, (list, tuple)):
            total += kv_bytes_per_token(nested)
            continue
        for attr in ("keys", "values"):
            for array in _arrays(getattr(layer, attr, None)):
                shape = tuple(array.shape)
                if len(shape) >= 3 and shape[0] > 0 and shape[-2] > 0:
                    total += int(array.nbytes) // (shape[0] * shape[-2])
    return total


# ---- the engine's registry --------------------------------------------------------------


@dataclass
class _Live:
    prompt_tokens: int
    submitted: float
    running: bool = False
    computed: int = 0
    generated: int = 0
    prompt_counted: bool = False
    first_token: float | None = None
    last_token: float | None = None


class EngineMetrics:
    """Counters, histograms and gauges for one engine, fed by its hooks."""

    def __init__(self, model: str, version: str = __version__) -> None:
        self.model = model
        self.started_at = time.monotonic()
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}
        self._kv_bytes_per_token: int | None = None

        self.requests = Counter(
            "compat_requests_total",
            "Finished requests by outcome (the engine's finish reason).",
            ("outcome",),
        )
        for reason in FinishReason:
            self.requests.touch(outcome=reason.value)
        self.prompt_tokens = Counter(
            "compat_prompt_tokens_total",
            "Prompt tokens of requests whose prompt was fully processed (cached ones included).",
        )
        self.generation_tokens = Counter(
            "compat_generation_tokens_total", "Tokens generated, counted as they are produced."
        )
        self.ttft = Histogram(
            "compat_time_to_first_token_seconds",
            "Seconds from submission to the first generated token.",
            TTFT_BUCKETS,
        )
        self.inter_token = Histogram(
            "compat_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of a request.",
            ITL_BUCKETS,
        )
        self.duration = Histogram(
            "compat_request_duration_seconds",
            "Seconds from submission to finish, every outcome.",
            DURATION_BUCKETS,
        )
        self.queue_depth = Gauge(
            "compat_queue_depth", "Requests submitted and waiting to start (not yet prefilling)."
        )
        self.running = Gauge(
            "compat_running_requests", "Requests being prefilled or decoded right now."
        )
        self.kv_cache_bytes = Gauge(
            "compat_kv_cache_bytes",
            "Estimated KV cache memory of live requests: "
            "(computed + generated tokens) x measured bytes per token.",
        )
        self.batch_size = Gauge(
            "compat_decode_batch_size", "Requests in the running decode batch after the last step."
        )
        self.decode_step_batch = Histogram(
            "compat_decode_step_batch_size",
            "Rows of each batched decode forward pass.",
            BATCH_BUCKETS,
        )
        self.preemptions = Counter(
            "compat_preemptions_total",
            "Running requests preempted because KV memory was full (recomputed later).",
        )
        self.kv_tokens_reserved = Gauge(
            "compat_kv_tokens_reserved", "KV tokens the scheduler holds for running requests."
        )
        self.kv_tokens_capacity = Gauge(
            "compat_kv_tokens_capacity", "KV tokens the scheduler may hand out (--kv-memory)."
        )
        self.grammar_compile_seconds = Histogram(
            "compat_grammar_compile_seconds",
            "Seconds to compile a request's grammar (JSON schema, tool calls, Lark, regex).",
            GRAMMAR_BUCKETS,
        )
        self.grammar_mask_seconds = Histogram(
            "compat_grammar_mask_seconds",
            "Seconds to compute the grammar masks of one sampling step (all constrained rows).",
            GRAMMAR_BUCKETS,
        )
        self.prefix_blocks = Gauge(
            "compat_prefix_cache_blocks", "Blocks holding cached prompt K/V (in use or free)."
        )
        self.prefix_bytes = Gauge(
            "compat_prefix_cache_bytes", "Bytes of cached K/V blocks and state snapshots."
        )
        self.prefix_capacity = Gauge(
            "compat_prefix_cache_capacity_blocks", "Blocks the prefix cache may hold."
        )
        self.prefix_query_tokens = Gauge(
            "compat_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hit_tokens = Gauge(
            "compat_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache."
        )
        self.prefix_hit_ratio = Gauge(
            "compat_prefix_cache_hit_ratio", "hit tokens / query tokens since start."
        )
        self.prefix_evictions = Gauge(
            "compat_prefix_cache_evictions", "Cached blocks evicted since start."
        )
        self.prefix_faults = Gauge(
            "compat_prefix_cache_faults",
            "Cache faults (missing or unassemblable tensors) that fell back to recompute.",
        )
        disk = {
            "disk_files": "Files in the prefix cache's disk tier (--cache-dir).",
            "disk_bytes": "Bytes of the prefix cache's disk tier.",
            "disk_capacity_bytes": "Size cap of the prefix cache's disk tier.",
            "disk_hit_tokens": "Prompt tokens served from the disk tier (also in hit_tokens).",
            "disk_read_bytes": "Bytes read from the disk tier since start.",
            "disk_read_seconds": "Seconds spent reading the disk tier since start.",
            "disk_writes": "Blocks and tails written to the disk tier since start.",
            "disk_write_drops": "Disk writes dropped (queue full or a write error).",
            "disk_faults": "Disk files skipped as unreadable, truncated or corrupted.",
            "disk_writing": "1 while the disk tier writes; 0 after a full disk stopped it.",
        }
        self.prefix_disk = [Gauge(f"compat_prefix_cache_{k}", h) for k, h in disk.items()]
        self.prefix_source: Callable[[], dict[str, float]] | None = None
        # More families in exposition lines (vLLM-named gauges, KV event counters).
        self.extra_renderers: list[Callable[[], list[str]]] = []
        self.info = Gauge(
            "compat_info",
            "The served model and compat-serve version.",
            {"model": model, "version": version},
        )
        self.info.set(1)

    # ---- hooks (engine thread; on_submit from any thread) --------------------------------

    def on_submit(self, request_id: str, prompt_tokens: int, now: float | None = None) -> None:
        with self._lock:
            self._live[request_id] = _Live(prompt_tokens, time.monotonic() if now is None else now)

    def on_start(self, request_id: str) -> None:
        """The request left the queue: it is prefilling (then decoding)."""
        with self._lock:
            live = self._live.get(request_id)
            if live is not None:
                live.running = True

    def on_prefill(
        self, request_id: str, computed: int, cache: Iterable[Any] | None = None
    ) -> None:
        """`computed` prompt tokens are now in the request's cache (cumulative)."""
        if self._kv_bytes_per_token is None and cache is not None:
            measured = kv_bytes_per_token(cache)
            if measured > 0:
                self._kv_bytes_per_token = measured
        with self._lock:
            live = self._live.get(request_id)
            if live is None:
                return
            live.running = True
            live.computed = computed
            done = computed >= live.prompt_tokens and not live.prompt_counted
            if done:
                live.prompt_counted = True
        if done:
            self.prompt_tokens.inc(live.prompt_tokens)

    def on_token(self, request_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            live = self._live.get(request_id)
            if live is None:
                return
            previous = live.last_token
            live.generated += 1
            live.last_token = now
            if previous is None:
                live.first_token = now
            submitted = live.submitted
        self.generation_tokens.inc()
        if previous is None:
            self.ttft.observe(now - submitted)
        else:
            self.inter_token.observe(now - previous)

    def on_decode_step(self, rows: int) -> None:
        self.decode_step_batch.observe(rows)

    def on_step(self, batch_size: int, kv_tokens_reserved: int) -> None:
        self.batch_size.set(batch_size)
        self.kv_tokens_reserved.set(kv_tokens_reserved)

    def on_preempt(self, request_id: str) -> None:
        self.preemptions.inc()
        with self._lock:
            live = self._live.get(request_id)
            if live is not None:
                live.computed = 0

    def on_finish(self, request_id: str, reason: FinishReason, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            live = self._live.pop(request_id, None)
        if live is None:
            return
        self.requests.inc(outcome=reason.value)
        self.duration.observe(now - live.submitted)

    # ---- readers (HTTP handlers) ---------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int | None:
        return self._kv_bytes_per_token

    def counts(self) -> tuple[int, int]:
        """(queued, running) requests."""
        with self._lock:
            running = sum(1 for live in self._live.values() if live.running)
            return len(self._live) - running, running

    def kv_bytes_in_use(self) -> int:
        per_token = self._kv_bytes_per_token or 0
        with self._lock:
            tokens = sum(live.computed + live.generated for live in self._live.values())
        return tokens * per_token

    def progress(self) -> dict[str, dict[str, Any]]:
        """Exact per-request token counts (the status board updates some of them lazily)."""
        out: dict[str, dict[str, Any]] = {}
        with self._lock:
            for request_id, live in self._live.items():
                row: dict[str, Any] = {
                    "computed_tokens": live.computed,
                    "generated_tokens": live.generated,
                }
                if live.first_token is not None and live.last_token is not None:
                    span = live.last_token - live.first_token
                    if live.generated > 1 and span > 0:
                        row["decode_tokens_per_s"] = round((live.generated - 1) / span, 2)
                out[request_id] = row
        return out

    def render(self) -> str:
        queued, running = self.counts()
        self.queue_depth.set(queued)
        self.running.set(running)
        self.kv_cache_bytes.set(self.kv_bytes_in_use())
        prefix: list[Counter | Gauge | Histogram] = []
        if self.prefix_source is not None:
            values = self.prefix_source()
            prefix = [
                self.prefix_blocks,
                self.prefix_bytes,
                self.prefix_capacity,
                self.prefix_query_tokens,
                self.prefix_hit_tokens,
                self.prefix_hit_ratio,
                self.prefix_evictions,
                self.prefix_faults,
                *self.prefix_disk,
            ]
            for gauge in prefix:
                assert isinstance(gauge, Gauge)
                gauge.set(values[gauge.name.removeprefix("compat_prefix_cache_")])
        metrics: list[Counter | Gauge | Histogram] = [
            self.info,
            self.requests,
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.inter_token,
            self.duration,
            self.queue_depth,
            self.running,
            self.batch_size,
            self.decode_step_batch,
            self.preemptions,
            self.kv_cache_bytes,
            self.kv_tokens_reserved,
            self.kv_tokens_capacity,
            self.grammar_compile_seconds,
            self.grammar_mask_seconds,
            *prefix,
        ]
        lines = [line for metric in metrics for line in metric.render()]
        lines += [line for extra in self.extra_renderers for line in extra()]
        return "\n".join(lines) + "\n"
