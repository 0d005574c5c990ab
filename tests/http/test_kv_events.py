"""KV events (vLLM's wire format over ZMQ), vLLM-named metrics, `/version` and the render
endpoints, against the real server on the tiny llama (`tiny_llama_model`: the embedded
model's tokenizer and template; what is checked is cache bookkeeping and protocol, not
what the model says).

A subscriber binds a SUB socket the server's publisher connects to (llm-d's topology),
decodes every batch with msgpack in vLLM's layout, replays the stream from sequence 0
over the ROUTER socket, and mirrors the cache: what the events say is cached must be
what the cache's own metrics say, after evictions too.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from compat_serve.engine.kv_events import END_SEQ, KVEventPublisher, StoredBlock
from tests.conftest import free_port, start_server

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

# One client for the module: `httpx.post` builds a client, and its TLS context from the
# CA bundle (~50 ms of CPU), per request.
HTTP = httpx.Client()

BLOCK = 16
TOPIC = b"kv@127.0.0.1@smollm2"
STORED_FIELDS = {
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
}


@dataclass
class Subscriber:
    """Receives every message on a bound SUB socket in a background thread."""

    context: zmq.Context[zmq.Socket[bytes]]
    port: int
    messages: list[tuple[int, bytes]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def run(self, socket: zmq.Socket[bytes]) -> None:
        while not self.stop.is_set():
            if socket.poll(20):
                topic, seq, payload = socket.recv_multipart()
                assert topic == TOPIC
                self.messages.append((int.from_bytes(seq, "big"), payload))
        socket.close(linger=0)


@dataclass
class EventServer:
    running: RunningServer
    subscriber: Subscriber
    replay_port: int


@pytest.fixture(scope="module")
def events_server(tiny_llama_model: LoadedModel) -> Iterator[EventServer]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = context.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    subscriber = Subscriber(context, port)
    subscriber.thread = threading.Thread(target=subscriber.run, args=(sub,), daemon=True)
    subscriber.thread.start()
    replay_port = free_port()
    args: Any = tiny_llama_model.model.args
    kv_bytes_per_token = 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * 4
    running = start_server(
        tiny_llama_model,
        block_size=BLOCK,
        max_output_tokens=2,
        default_temperature=0.0,
        # 10 blocks of float32 K/V: the fourth distinct prompt evicts.
        cache_memory=str(10 * BLOCK * kv_bytes_per_token),
        kv_events_endpoint=f"tcp://127.0.0.1:{port}",
        kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        kv_events_topic=TOPIC.decode(),
    )
    yield EventServer(running, subscriber, replay_port)
    running.stop()
    subscriber.stop.set()
    subscriber.thread.join(5)
    context.term()


def scrape(base_url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = HTTP.get(f"{base_url}/metrics", timeout=30).text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    (only,) = samples[name]
    return only[1]


def replay(port: int, start: int) -> list[tuple[int, bytes]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            assert dealer.poll(5000), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)
        context.term()


def chat(base_url: str, content: str) -> dict[str, Any]:
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    response = HTTP.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def prompt(i: int) -> str:
    return f"Document {i}. " + " ".join(f"item{i}-{j}" for j in range(30))


def settled(
    server: EventServer,
) -> tuple[dict[str, list[tuple[dict[str, str], float]]], list[tuple[int, bytes]]]:
    """Metrics and the replayed stream once the last published batch was received live
    (batches sent before the connection settled are lost to the live stream, PUB/SUB's
    slow joiner, and come back through replay)."""
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(server.running.base_url)
        batches = replay(server.replay_port, 0)
        published = value(samples, "compat_kv_events_published_total")
        live = [seq for seq, _ in list(server.subscriber.messages)]
        in_replay = sum(len(msgpack.unpackb(p)[1]) for _, p in batches)
        if live and published == in_replay and max(live) == batches[-1][0]:
            return samples, batches
        assert time.monotonic() < deadline, "events did not settle"
        time.sleep(0.1)


def test_events_mirror_the_prefix_cache_and_replay_fills_the_gaps(
    events_server: EventServer,
) -> None:
    base = events_server.running.base_url
    render = HTTP.post(
        f"{base}/v1/chat/completions/render",
        json={"model": "m", "messages": [{"role": "user", "content": prompt(0)}]},
        timeout=30,
    ).json()
    first = chat(base, prompt(0))
    assert first["usage"]["prompt_tokens"] == len(render["token_ids"])
    after_first = len(replay(events_server.replay_port, 0))
    for i in range(1, 6):
        chat(base, prompt(i))
    again = chat(base, prompt(5))  # the latest prompt is still cached: a hit, no new blocks
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4 * BLOCK
    samples, batches = settled(events_server)
    seqs = [seq for seq, _ in batches]
    assert seqs == list(range(len(batches))), "sequence numbers are consecutive from 0"
    live = dict(events_server.subscriber.messages)
    assert live, "the live stream delivered batches"
    for seq, payload in live.items():
        assert payload == batches[seq][1], f"replayed batch {seq} differs from the live one"
    # Replay from the middle starts there.
    middle = len(batches) // 2
    assert [s for s, _ in replay(events_server.replay_port, middle)] == seqs[middle:]

    cached: dict[int, list[int]] = {}
    removed = stored = 0
    for index, (_, payload) in enumerate(batches):
        ts, events, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and rank == 0 and events
        for event in events:
            kind = event["type"]
            if index == 0:
                assert event == {"type": "AllBlocksCleared"}
                continue
            assert kind != "AllBlocksCleared"
            if kind == "BlockStored":
                assert set(event) == STORED_FIELDS
                assert event["block_size"] == BLOCK and event["medium"] == "GPU"
                hashes, tokens = event["block_hashes"], event["token_ids"]
                assert len(tokens) == BLOCK * len(hashes)
                parent = event["parent_block_hash"]
                assert parent is None or parent in cached, "parent announced before child"
                for j, h in enumerate(hashes):
                    assert 0 <= h < 2**64 and h not in cached
                    cached[h] = tokens[j * BLOCK : (j + 1) * BLOCK]
                stored += len(hashes)
            else:
                assert kind == "BlockRemoved" and set(event) == {"type", "block_hashes", "medium"}
                if index < after_first:
                    pytest.fail("a request ending removed blocks: only eviction may")
                for h in event["block_hashes"]:
                    assert h in cached, "only announced blocks are removed"
                    del cached[h]
                removed += len(event["block_hashes"])

    # The first request's first blocks are its rendered prompt, root block first.
    _, first_events, _ = msgpack.unpackb(batches[1][1])
    root = first_events[0]
    assert root["parent_block_hash"] is None
    n = len(root["token_ids"])
    assert root["token_ids"] == render["token_ids"][:n]

    assert removed > 0, "the small cache evicted"
    assert len(cached) == value(samples, "compat_prefix_cache_blocks")
    assert removed == value(samples, "compat_prefix_cache_evictions")
    assert stored - removed == len(cached)
    assert value(samples, "compat_kv_events_dropped_total") == 0


def test_vllm_metric_names_and_version(events_server: EventServer) -> None:
    base = events_server.running.base_url
    chat(base, "Hello there")
    samples = scrape(base)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        ((labels, count),) = samples[name]
        assert labels == {"model_name": "tiny-llama", "engine": "0"}
        assert count == 0
    assert 0.0 <= value(samples, "vllm:kv_cache_usage_perc") <= 1.0
    queries = value(samples, "vllm:prefix_cache_queries_total")
    assert queries == value(samples, "compat_prefix_cache_query_tokens") > 0
    assert value(samples, "vllm:prefix_cache_hits_total") == value(
        samples, "compat_prefix_cache_hit_tokens"
    )
    ((info, one),) = samples["vllm:cache_config_info"]
    assert one == 1 and info["block_size"] == str(BLOCK)
    assert int(info["num_gpu_blocks"]) == value(samples, "compat_prefix_cache_capacity_blocks")
    version = HTTP.get(f"{base}/version", timeout=10)
    assert version.status_code == 200 and set(version.json()) == {"version"}


def test_render_endpoints_return_the_served_prompt_ids(events_server: EventServer) -> None:
    base = events_server.running.base_url
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
    ]
    rendered = HTTP.post(
        f"{base}/v1/chat/completions/render",
        json={"model": "m", "messages": messages, "max_tokens": 7, "temperature": 0.5},
        timeout=30,
    )
    assert rendered.status_code == 200
    body = rendered.json()
    assert body["request_id"].startswith("chatcmpl-")
    assert body["sampling_params"]["max_tokens"] == 7
    assert body["sampling_params"]["temperature"] == 0.5
    served = HTTP.post(
        f"{base}/v1/chat/completions",
        json={"model": "m", "messages": messages, "max_tokens": 1},
        timeout=60,
    ).json()
    assert served["usage"]["prompt_tokens"] == len(body["token_ids"])

    (text,) = HTTP.post(
        f"{base}/v1/completions/render", json={"model": "m", "prompt": "Once upon"}, timeout=30
    ).json()
    assert text["request_id"].startswith("cmpl-") and text["token_ids"]
    (ids,) = HTTP.post(
        f"{base}/v1/completions/render", json={"model": "m", "prompt": [1, 2, 3]}, timeout=30
    ).json()
    assert ids["token_ids"] == [1, 2, 3]
    # max_tokens -1 is "up to the context window" on /v1/completions, and in its render.
    (unbounded,) = HTTP.post(
        f"{base}/v1/completions/render",
        json={"model": "m", "prompt": [1, 2, 3], "max_tokens": -1},
        timeout=30,
    ).json()
    window = HTTP.get(f"{base}/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    assert unbounded["sampling_params"]["max_tokens"] == window
    bad = HTTP.post(
        f"{base}/v1/chat/completions/render",
        json={"model": "m", "messages": "not a list"},
        timeout=30,
    )
    assert bad.status_code == 400
    assert json.loads(bad.text)["error"]["type"] == "invalid_request_error"


def test_a_full_queue_drops_batches_counts_them_and_skips_their_sequence() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = context.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    publisher = KVEventPublisher(f"tcp://127.0.0.1:{port}", block_size=2, max_queue_batches=1)
    try:
        publisher.shutdown()  # nobody drains the queue from here on
        started = time.monotonic()
        for i in range(5):
            block = StoredBlock(i, bytes([i]) * 16, None, [i, i])
            publisher.stored([block])
            publisher.flush()
        assert time.monotonic() - started < 0.5, "flush never blocks"
        assert publisher.dropped_batches == 4 and publisher.dropped_events == 4
        assert 'compat_kv_events_dropped_total{endpoint="tcp://127.0.0.1:' in "\n".join(
            publisher.render_metrics()
        )
    finally:
        sub.close(linger=0)
        context.term()


def test_bad_endpoints_fail_fast(embedded_model: LoadedModel) -> None:
    with pytest.raises(ValueError, match="--kv-events-endpoint"):
        start_server(embedded_model, kv_events_endpoint="127.0.0.1:5557")
    with pytest.raises(ValueError, match="prefix cache"):
        start_server(embedded_model, kv_events_endpoint="tcp://*:5557", prefix_cache=False)
    with pytest.raises(ValueError, match="needs --kv-events-endpoint"):
        start_server(embedded_model, kv_events_replay_endpoint="tcp://*:5558")
