"""KV cache events for cache-aware routers (llm-d, Dynamo), in vLLM's wire format.

Every block the prefix cache stores is announced (`BlockStored`), every block it evicts
is withdrawn (`BlockRemoved`), and `AllBlocksCleared` opens the stream, so a subscriber
can mirror which prefixes this instance holds. Only full blocks are announced, parents
before children; a request ending does not remove its blocks (they stay cached).

Wire format (vLLM's `vllm/distributed/kv_events.py` since its map encoding, #42892):
multipart ZMQ messages `[topic, sequence (8 bytes, big-endian), payload]` on a PUB
socket; the payload is msgpack `[ts, [event, ...], data_parallel_rank]`, each event a
map tagged by `"type"`:

- `{"type": "BlockStored", "block_hashes": [u64, ...], "parent_block_hash": u64 | None,
  "token_ids": [...], "block_size": n, "lora_id": None, "medium": "GPU", "lora_name": None}`
  (`block_hashes` is a chain: each block's parent is the one before it);
- `{"type": "BlockRemoved", "block_hashes": [u64, ...], "medium": "GPU"}`;
- `{"type": "AllBlocksCleared"}`.

Block hashes are opaque unsigned 64-bit integers: the first 8 bytes (big-endian) of our
chained block hash. A ROUTER replay socket answers a request `[b"", start_seq]` with
every buffered batch from `start_seq` on, as `[b"", seq, payload]`, then `[b"", -1, b""]`.

The engine thread only appends to a bounded queue; a background thread encodes, sends
and serves replays. When the queue is full a batch is dropped (counted in /metrics) and
its sequence number is skipped, so subscribers see the gap.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

from compat_serve.engine.metrics import format_labels

if TYPE_CHECKING:
    from compat_serve.engine.config import EngineConfig
    from compat_serve.engine.metrics import EngineMetrics

log = logging.getLogger("compat_serve.kv_events")

# vLLM's name for the primary KV tier; routers weigh other media (CPU, disk) lower.
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_QUEUE_BATCHES = 10_000
DEFAULT_REPLAY_BATCHES = 10_000
_SHUTDOWN_TIMEOUT_S = 2.0
_POLL_S = 0.05

Event = dict[str, Any]


def external_hash(block_hash: bytes) -> int:
    """The unsigned 64-bit id a router sees for one of our chained block hashes."""
    return int.from_bytes(block_hash[:8], "big")


@dataclass(frozen=True)
class StoredBlock:
    """A full block newly stored in the prefix cache under `block_id`."""

    block_id: int
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: Sequence[int]


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host, IPv6 `::`, ipc:// or inproc:// binds; anything else
    connects (to a subscriber that binds, as llm-d's indexer does)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Turns prefix-cache store/evict notifications into vLLM KV event batches.

    `stored`, `removed` and `flush` are called on the engine thread and never block;
    counters are read by `/metrics` from any thread."""

    def __init__(
        self,
        endpoint: str,
        *,
        block_size: int,
        replay_endpoint: str | None = None,
        topic: str = "",
        max_queue_batches: int = DEFAULT_QUEUE_BATCHES,
        replay_batches: int = DEFAULT_REPLAY_BATCHES,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.block_size = block_size
        self._topic = topic.encode()
        self._queue: queue.Queue[tuple[int, float, list[Event]] | None] = queue.Queue(
            max_queue_batches
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=replay_batches)
        self._seq = count()
        self._pending: list[Event] = []
        # Block id -> the hash announced for it (a BlockRemoved needs the hash).
        self._announced: dict[int, int] = {}
        self._lock = threading.Lock()
        self.published_batches = 0
        self.published_events = 0
        self.dropped_batches = 0
        self.dropped_events = 0
        self.replays = 0
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, 100_000)
            self._pub.setsockopt(zmq.LINGER, 0)
            if binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"--kv-events-endpoint: cannot open {endpoint}: {exc}") from exc
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._pending.append({"type": "AllBlocksCleared"})
        self.flush()
        log.info(
            "KV events: %s %s%s",
            "publishing on" if binds(endpoint) else "connecting to",
            endpoint,
            f", replay on {replay_endpoint}" if replay_endpoint else "",
        )

    # ---- engine thread ------------------------------------------------------------------

    def stored(self, blocks: Sequence[StoredBlock]) -> None:
        """Blocks just stored, in chain order: runs of consecutive blocks become one
        `BlockStored` each (a run's parent is announced already, or is the root)."""
        run: list[StoredBlock] = []
        for block in blocks:
            if run and block.parent_hash != run[-1].block_hash:
                self._stored_run(run)
                run = []
            run.append(block)
        if run:
            self._stored_run(run)

    def _stored_run(self, run: list[StoredBlock]) -> None:
        hashes = []
        tokens: list[int] = []
        for block in run:
            value = external_hash(block.block_hash)
            self._announced[block.block_id] = value
            hashes.append(value)
            tokens.extend(block.token_ids)
        parent = run[0].parent_hash
        self._pending.append(
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": None if parent is None else external_hash(parent),
                "token_ids": tokens,
                "block_size": self.block_size,
                "lora_id": None,
                "medium": MEDIUM,
                "lora_name": None,
            }
        )

    def removed(self, block_ids: Sequence[int]) -> None:
        """Blocks evicted (their ids may be reused right after)."""
        hashes = [h for h in (self._announced.pop(b, None) for b in block_ids) if h is not None]
        if hashes:
            self._pending.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM})

    def flush(self) -> None:
        """Queue what was noted since the last flush as one batch; never blocks."""
        if not self._pending:
            return
        events, self._pending = self._pending, []
        seq = next(self._seq)
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            with self._lock:
                self.dropped_batches += 1
                self.dropped_events += len(events)

    @property
    def announced_blocks(self) -> int:
        return len(self._announced)

    # ---- any thread ---------------------------------------------------------------------

    def render_metrics(self) -> list[str]:
        with self._lock:
            values = [
                (
                    "compat_kv_events_published_total",
                    "KV events sent to subscribers.",
                    self.published_events,
                ),
                (
                    "compat_kv_events_dropped_total",
                    "KV events dropped because the publish queue was full (their batch's "
                    "sequence number is skipped).",
                    self.dropped_events,
                ),
                ("compat_kv_event_replays_total", "Replay requests served.", self.replays),
            ]
        labels = format_labels([("endpoint", self.endpoint)])
        lines: list[str] = []
        for name, help_text, value in values:
            lines += [
                f"# HELP {name} {help_text}",
                f"# TYPE {name} counter",
                f"{name}{labels} {value}",
            ]
        return lines

    def shutdown(self) -> None:
        """Send what is queued (for up to ~2 s), then close the sockets."""
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=_SHUTDOWN_TIMEOUT_S)
        self._thread.join(_SHUTDOWN_TIMEOUT_S)
        if not self._thread.is_alive():
            self._close_sockets()

    # ---- the publisher thread -----------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except zmq.ZMQError:
                    log.exception("KV events: replay failed")
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                # Let the PUB socket take in new subscriptions while idle, so the next
                # batch reaches a subscriber that just connected.
                self._pub.getsockopt(zmq.EVENTS)
                continue
            if item is None:
                return
            seq, ts, events = item
            try:
                payload = msgpack.packb([ts, events, 0])
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except (zmq.ZMQError, ValueError, TypeError):
                log.exception("KV events: could not publish batch %d", seq)
                with self._lock:
                    self.dropped_batches += 1
                    self.dropped_events += len(events)
                continue
            self._buffer.append((seq, payload))
            with self._lock:
                self.published_batches += 1
                self.published_events += len(events)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
        with self._lock:
            self.replays += 1

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()


# ---- wiring (called by the Engine) ----------------------------------------------------------


def open_kv_events(config: EngineConfig, metrics: EngineMetrics) -> KVEventPublisher | None:
    """The publisher for the prefix cache's store/evict notifications, if configured (the
    Engine hands it to the prefix cache it builds)."""
    if config.kv_events_endpoint is None:
        return None
    publisher = KVEventPublisher(
        config.kv_events_endpoint,
        block_size=config.block_size,
        replay_endpoint=config.kv_events_replay_endpoint,
        topic=config.kv_events_topic,
    )
    metrics.extra_renderers.append(publisher.render_metrics)
    return publisher
