"""The engine's load and cache pressure under vLLM's metric names, beside our own.

Endpoint pickers (SMG, llm-d's inference scheduler, the Gateway API Inference
Extension, Dynamo) read these names from a vLLM worker's `/metrics`:

- `vllm:num_requests_running`, `vllm:num_requests_waiting` (gauges);
- `vllm:kv_cache_usage_perc`: the share (0-1) of the running requests' KV room in use
  (`--kv-memory`), i.e. how close the scheduler is to preempting;
- `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`: prompt tokens
  looked up in / served from the prefix cache (counters);
- `vllm:cache_config_info`: block size, cache blocks and hash as labels, value 1.

Samples carry vLLM's `model_name` and `engine` labels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from compat_serve.engine.metrics import EngineMetrics, escape_help, format_labels, format_value

if TYPE_CHECKING:
    from compat_serve.engine.config import EngineConfig
    from compat_serve.engine.prefix.cache import PrefixCaching


@dataclass
class VllmMetrics:
    metrics: EngineMetrics
    model_name: str
    block_size: int
    prefix_caching: bool
    cache_hash: str
    # Prefix cache counters (`PrefixCaching.metrics`), None without a prefix cache.
    prefix_source: Callable[[], dict[str, float]] | None = None
    num_cache_blocks: int = 0

    def render(self) -> list[str]:
        m = self.metrics
        waiting, running = m.counts()
        capacity = m.kv_tokens_capacity.value()
        usage = min(1.0, m.kv_tokens_reserved.value() / capacity) if capacity > 0 else 0.0
        prefix = self.prefix_source() if self.prefix_source is not None else {}
        labels = [("model_name", self.model_name), ("engine", "0")]
        lines: list[str] = []

        def sample(
            name: str,
            kind: str,
            help_text: str,
            value: float,
            extra: list[tuple[str, str]] | None = None,
        ) -> None:
            lines.append(f"# HELP {name} {escape_help(help_text)}")
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name}{format_labels(labels + (extra or []))} {format_value(value)}")

        sample(
            "vllm:num_requests_running", "gauge", "Requests in model execution batches.", running
        )
        sample("vllm:num_requests_waiting", "gauge", "Requests waiting to be processed.", waiting)
        sample(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage of running requests: 1 means full (share of --kv-memory).",
            float(usage),
        )
        sample(
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in prompt tokens.",
            int(prefix.get("query_tokens", 0)),
        )
        sample(
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in prompt tokens.",
            int(prefix.get("hit_tokens", 0)),
        )
        sample(
            "vllm:cache_config_info",
            "gauge",
            "Information of the prefix cache configuration.",
            1,
            [
                ("block_size", str(self.block_size)),
                ("num_gpu_blocks", str(self.num_cache_blocks)),
                ("enable_prefix_caching", str(self.prefix_caching)),
                ("prefix_caching_hash_algo", self.cache_hash),
                ("cache_dtype", "auto"),
            ],
        )
        return lines


def attach_vllm_metrics(
    metrics: EngineMetrics, config: EngineConfig, prefix: PrefixCaching | None, model_name: str
) -> VllmMetrics:
    """Render the vLLM-named families after ours in `metrics.render()`."""
    vllm = VllmMetrics(
        metrics,
        model_name,
        config.block_size,
        prefix is not None,
        config.cache_hash,
        prefix.metrics if prefix is not None else None,
        prefix.cache.num_blocks if prefix is not None else 0,
    )
    metrics.extra_renderers.append(vllm.render)
    return vllm
