"""The metrics registry and its Prometheus text exposition (no model)."""

from __future__ import annotations

import math
import re
import threading

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from compat_serve import __version__
from compat_serve.engine.metrics import (
    DURATION_BUCKETS,
    ITL_BUCKETS,
    TTFT_BUCKETS,
    Counter,
    EngineMetrics,
    Gauge,
    Histogram,
    escape_label_value,
    format_value,
    kv_bytes_per_token,
)
from compat_serve.engine.types import FinishReason

SAMPLE_LINE = re.compile(
    r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\[\\"n])*",?)*\})? '
    r"(-?[0-9.e+-]+|[+-]Inf|NaN)$"
)


def families(text: str) -> dict[str, list[Sample]]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def types(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [s.value for s in samples if s.name == name and s.labels == labels]
    assert len(found) == 1, (name, labels, samples)
    return found[0]


def check_exposition(text: str) -> None:
    """Stricter than prometheus_client's lax parser: line syntax and HELP/TYPE order."""
    assert text.endswith("\n")
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in {"counter", "gauge", "histogram"}
            assert name not in typed, f"{name} typed twice"
            typed.add(name)
            continue
        assert SAMPLE_LINE.match(line), line
        base = re.sub(r"(_bucket|_sum|_count)$", "", line.split("{")[0].split(" ")[0])
        assert base in typed or line.split("{")[0].split(" ")[0] in typed, line


def check_histogram(samples: list[Sample], name: str) -> None:
    buckets = [s for s in samples if s.name == f"{name}_bucket"]
    bounds = [float(s.labels["le"]) for s in buckets]
    assert bounds == sorted(bounds) and math.isinf(bounds[-1])
    counts = [s.value for s in buckets]
    assert counts == sorted(counts), "buckets must be cumulative"
    assert counts[-1] == value(samples, f"{name}_count")


# ---- primitives -------------------------------------------------------------------------


def test_format_value() -> None:
    assert format_value(3) == "3"
    assert format_value(0.25) == "0.25"
    assert format_value(1.0) == "1.0"
    assert format_value(math.inf) == "+Inf"
    assert format_value(-math.inf) == "-Inf"
    assert format_value(math.nan) == "NaN"
    assert escape_label_value('a"b\\c\nd') == 'a\\"b\\\\c\\nd'


def test_counter_labels_and_rendering() -> None:
    c = Counter("x_requests_total", "Requests.\nSecond line \\ done.", ("outcome",))
    c.touch(outcome="ok")
    c.inc(outcome="ok")
    c.inc(2, outcome='we"ird\n')
    assert c.value(outcome="ok") == 1
    with pytest.raises(ValueError):
        c.inc(-1, outcome="ok")
    with pytest.raises(ValueError):
        c.inc(outcome="ok", extra="no")
    with pytest.raises(ValueError):
        Counter("x_requests", "no suffix")
    text = "\n".join(c.render()) + "\n"
    check_exposition(text)
    fam = next(iter(text_string_to_metric_families(text)))
    assert (fam.name, fam.type) == ("x_requests", "counter")
    assert fam.documentation == "Requests.\nSecond line \\ done."
    assert value(fam.samples, "x_requests_total", outcome="ok") == 1
    assert value(fam.samples, "x_requests_total", outcome='we"ird\n') == 2


def test_histogram_buckets_are_cumulative_with_inf() -> None:
    h = Histogram("x_seconds", "Latency.", (0.1, 1, 10))
    for v in (0.05, 0.1, 0.5, 5, 50, 500):
        h.observe(v)
    assert h.count == 6 and h.sum == pytest.approx(555.65)
    text = "\n".join(h.render()) + "\n"
    check_exposition(text)
    samples = families(text)["x_seconds"]
    assert [(s.labels["le"], s.value) for s in samples if s.name == "x_seconds_bucket"] == [
        ("0.1", 2),
        ("1.0", 3),
        ("10.0", 4),
        ("+Inf", 6),
    ]
    assert value(samples, "x_seconds_sum") == pytest.approx(555.65)
    check_histogram(samples, "x_seconds")
    with pytest.raises(ValueError):
        Histogram("bad", "unsorted", (1, 0.5))


def test_gauge_with_labels() -> None:
    g = Gauge("x_info", "Info.", {"model": "m", "version": "1"})
    g.set(1)
    text = "\n".join(g.render()) + "\n"
    check_exposition(text)
    assert value(families(text)["x_info"], "x_info", model="m", version="1") == 1


def test_bucket_ranges_suit_a_slow_cpu() -> None:
    assert TTFT_BUCKETS[-1] >= 300  # prefilling a long agent prompt can take minutes
    assert ITL_BUCKETS[0] <= 0.01 and ITL_BUCKETS[-1] >= 5
    assert DURATION_BUCKETS[-1] >= 1800


# ---- KV size ----------------------------------------------------------------------------


def test_kv_bytes_per_token_from_real_caches() -> None:
    layers, kv_heads, head_dim = 3, 2, 8
    caches = [KVCache() for _ in range(layers)]
    assert kv_bytes_per_token(caches) == 0  # nothing allocated yet
    for c in caches:
        k = mx.zeros((1, kv_heads, 5, head_dim), dtype=mx.float16)
        c.update_and_fetch(k, k)  # allocates 256 positions; per-position size is what counts
    assert kv_bytes_per_token(caches) == 2 * layers * kv_heads * head_dim * 2

    # Recurrent (SSM) layers have no per-token K/V and add nothing.
    ssm = ArraysCache(2)
    ssm[0] = mx.zeros((1, 4, 16))
    assert kv_bytes_per_token([*caches, ssm]) == 2 * layers * kv_heads * head_dim * 2

    # Quantized caches: packed data plus scales and biases, per position.
    q = QuantizedKVCache(group_size=32, bits=8)
    k = mx.zeros((1, kv_heads, 4, 64), dtype=mx.float16)
    q.update_and_fetch(k, k)
    per_tensor = kv_heads * (64 * 8 // 8 + 2 * (64 // 32) * 2)  # data bytes + scales/biases
    assert kv_bytes_per_token([q]) == 2 * per_tensor


# ---- the engine registry ----------------------------------------------------------------


def test_engine_metrics_request_lifecycle() -> None:
    m = EngineMetrics("tiny-model", version="9.9")
    text = m.render()
    check_exposition(text)
    fams = families(text)
    # Every outcome series exists from the start, at 0.
    for reason in FinishReason:
        assert value(fams["compat_requests"], "compat_requests_total", outcome=reason.value) == 0
    assert value(fams["compat_info"], "compat_info", model="tiny-model", version="9.9") == 1
    assert types(text) == {
        "compat_info": "gauge",
        "compat_requests": "counter",
        "compat_prompt_tokens": "counter",
        "compat_generation_tokens": "counter",
        "compat_time_to_first_token_seconds": "histogram",
        "compat_inter_token_latency_seconds": "histogram",
        "compat_request_duration_seconds": "histogram",
        "compat_queue_depth": "gauge",
        "compat_running_requests": "gauge",
        "compat_kv_cache_bytes": "gauge",
        "compat_decode_batch_size": "gauge",
        "compat_decode_step_batch_size": "histogram",
        "compat_preemptions": "counter",
        "compat_kv_tokens_reserved": "gauge",
        "compat_kv_tokens_capacity": "gauge",
        "compat_grammar_compile_seconds": "histogram",
        "compat_grammar_mask_seconds": "histogram",
    }

    m.on_submit("a", 10, now=100.0)
    m.on_submit("b", 4, now=100.5)
    assert m.counts() == (2, 0)
    m.on_start("a")
    assert m.counts() == (1, 1)
    cache = [KVCache()]
    cache[0].update_and_fetch(*(2 * [mx.zeros((1, 1, 6, 4), dtype=mx.float32)]))
    m.on_prefill("a", 6, cache)
    assert m.kv_bytes_per_token == 2 * 4 * 4
    assert m.kv_bytes_in_use() == 6 * 32
    fams = families(m.render())
    assert value(fams["compat_prompt_tokens"], "compat_prompt_tokens_total") == 0  # not done yet
    assert value(fams["compat_kv_cache_bytes"], "compat_kv_cache_bytes") == 6 * 32
    m.on_prefill("a", 10, cache)
    m.on_prefill("a", 10, cache)  # a repeated report counts the prompt once
    for t in (102.0, 102.5, 103.5):
        m.on_token("a", now=t)
    assert m.progress()["a"] == {
        "computed_tokens": 10,
        "generated_tokens": 3,
        "decode_tokens_per_s": 1.33,
    }
    assert m.kv_bytes_in_use() == 13 * 32
    m.on_finish("a", FinishReason.LENGTH, now=104.0)
    m.on_finish("a", FinishReason.ERROR, now=105.0)  # a second finish is ignored
    m.on_finish("b", FinishReason.ABORTED, now=101.0)  # aborted while queued
    m.on_token("gone", now=1.0)  # unknown ids are ignored
    assert m.counts() == (0, 0) and m.kv_bytes_in_use() == 0

    text = m.render()
    check_exposition(text)
    fams = families(text)
    requests = fams["compat_requests"]
    assert value(requests, "compat_requests_total", outcome="length") == 1
    assert value(requests, "compat_requests_total", outcome="aborted") == 1
    assert value(requests, "compat_requests_total", outcome="error") == 0
    assert value(fams["compat_prompt_tokens"], "compat_prompt_tokens_total") == 10
    assert value(fams["compat_generation_tokens"], "compat_generation_tokens_total") == 3
    ttft = fams["compat_time_to_first_token_seconds"]
    assert value(ttft, "compat_time_to_first_token_seconds_count") == 1
    assert value(ttft, "compat_time_to_first_token_seconds_sum") == pytest.approx(2.0)
    assert value(ttft, "compat_time_to_first_token_seconds_bucket", le="1.0") == 0
    assert value(ttft, "compat_time_to_first_token_seconds_bucket", le="2.5") == 1
    itl = fams["compat_inter_token_latency_seconds"]
    assert value(itl, "compat_inter_token_latency_seconds_count") == 2
    assert value(itl, "compat_inter_token_latency_seconds_sum") == pytest.approx(1.5)
    duration = fams["compat_request_duration_seconds"]
    assert value(duration, "compat_request_duration_seconds_count") == 2
    assert value(duration, "compat_request_duration_seconds_sum") == pytest.approx(4.5)
    for name in (
        "compat_time_to_first_token_seconds",
        "compat_inter_token_latency_seconds",
        "compat_request_duration_seconds",
    ):
        check_histogram(fams[name], name)
    assert value(fams["compat_queue_depth"], "compat_queue_depth") == 0
    assert value(fams["compat_running_requests"], "compat_running_requests") == 0


def test_engine_metrics_default_version_and_escaped_model_name() -> None:
    m = EngineMetrics('odd "name"\\x')
    fams = families(m.render())
    assert value(fams["compat_info"], "compat_info", model='odd "name"\\x', version=__version__)


def test_engine_metrics_are_thread_safe() -> None:
    m = EngineMetrics("m")
    per_thread = 500

    def worker(k: int) -> None:
        for i in range(per_thread):
            rid = f"{k}-{i}"
            m.on_submit(rid, 3)
            m.on_start(rid)
            m.on_prefill(rid, 3)
            m.on_token(rid)
            m.on_token(rid)
            m.on_finish(rid, FinishReason.STOP_TOKEN)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        check_exposition(m.render())  # readers never see a torn histogram
        fams = families(m.render())
        check_histogram(
            fams["compat_inter_token_latency_seconds"], "compat_inter_token_latency_seconds"
        )
    for t in threads:
        t.join()
    total = 4 * per_thread
    fams = families(m.render())
    assert value(fams["compat_requests"], "compat_requests_total", outcome="stop_token") == total
    assert value(fams["compat_prompt_tokens"], "compat_prompt_tokens_total") == 3 * total
    assert value(fams["compat_generation_tokens"], "compat_generation_tokens_total") == 2 * total
    assert m.ttft.count == total and m.inter_token.count == total
    assert m.counts() == (0, 0)
