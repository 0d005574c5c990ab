"""The engine's settings (`EngineConfig`): batching, chunking, KV and prefix-cache
budgets, speculation and the KV format, with the checks between them."""

from __future__ import annotations

from dataclasses import dataclass, field

from compat_serve.engine.kv_quant import KVFormat
from compat_serve.engine.speculation import SpeculationConfig


@dataclass(frozen=True)
class EngineConfig:
    prefill_chunk: int = 512
    # Prompt tokens a request prefills in a step where others also decode; None = half a
    # chunk (whole blocks), so running streams wait about half a chunk, not a whole one.
    decode_prefill_chunk: int | None = None
    max_queue: int = 256
    # Most requests decoding together (one batched forward per step).
    max_num_seqs: int = 16
    # Most tokens one step computes; None = one prefill chunk plus a token per sequence,
    # so a step never computes more than one chunk of prompt.
    max_num_batched_tokens: int | None = None
    # KV memory of running requests, in bytes of the stored format (--kv-bits); None = a
    # share of what the device has left after the weights (engine/memory.py).
    kv_memory_bytes: int | None = None
    # Prefix cache: on by default; blocks of `block_size` tokens, at most
    # `cache_memory_bytes` of cached K/V in the stored format (None = a share of the
    # device's spare memory).
    prefix_cache: bool = True
    block_size: int = 16
    cache_memory_bytes: int | None = None
    cache_hash: str = "xxh3"
    # The share of the prefix cache `cache_control` pins may cover; past it the pin that
    # expires first goes (engine/prefix/pins.py).
    cache_pin_fraction: float = 0.5
    # Disk tier of the prefix cache (engine/prefix/disk.py): a directory, and its size
    # cap in bytes (None = a share of the free disk). Off when `cache_dir` is None.
    cache_dir: str | None = None
    cache_disk_bytes: int | None = None
    # KV events for cache-aware routers (engine/kv_events.py); None = off.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    # Log prefill progress at most this often for long prompts.
    progress_interval_s: float = 5.0
    # Speculative decoding (engine/speculation.py); off by default.
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    # How attention K/V is stored (engine/kv_quant.py): the model's dtype, or quantized.
    kv_format: KVFormat = field(default_factory=KVFormat)
    # Serve min(the model's window, what one sequence's KV can hold in --kv-memory).
    auto_context: bool = False

    @property
    def prefill_chunk_while_decoding(self) -> int:
        if self.decode_prefill_chunk is not None:
            return self.decode_prefill_chunk
        half = self.prefill_chunk // 2
        if self.prefix_cache:
            half -= half % self.block_size
        return max(half, self.block_size if self.prefix_cache else 1)

    @property
    def batched_tokens(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return self.prefill_chunk + self.max_num_seqs

    def validate(self) -> None:
        """Settings that contradict each other; messages name the CLI flags. Called by
        the CLI before the model loads and by the Engine for direct users."""
        if self.cache_dir is not None and not self.prefix_cache:
            raise ValueError("--cache-dir needs the prefix cache (drop --no-prefix-cache)")
        if self.block_size < 1:
            raise ValueError("--block-size must be at least 1")
        if self.prefix_cache and self.prefill_chunk % self.block_size:
            raise ValueError(
                f"--prefill-chunk ({self.prefill_chunk}) must be a multiple of --block-size "
                f"({self.block_size})"
            )
        decode_chunk = self.prefill_chunk_while_decoding
        if self.decode_prefill_chunk is not None and decode_chunk < 1:
            raise ValueError("--decode-prefill-chunk must be at least 1")
        if self.prefix_cache and decode_chunk % self.block_size:
            raise ValueError(
                f"--decode-prefill-chunk ({decode_chunk}) must be a multiple of --block-size "
                f"({self.block_size})"
            )
        if self.cache_hash not in ("xxh3", "sha256"):
            raise ValueError("--cache-hash must be xxh3 or sha256")
        if self.batched_tokens < self.max_num_seqs:
            raise ValueError("--max-num-batched-tokens must be at least --max-num-seqs")
        check_kv_events_config(self)
        self.speculation.validate()
        self.kv_format.validate()


def check_kv_events_config(config: EngineConfig) -> None:
    """The KV event settings (engine/kv_events.py): flag errors, before the model loads."""
    endpoint = config.kv_events_endpoint
    if endpoint is None:
        if config.kv_events_replay_endpoint is not None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        return
    if not config.prefix_cache:
        raise ValueError("--kv-events-endpoint needs the prefix cache (drop --no-prefix-cache)")
    for flag, value in (
        ("--kv-events-endpoint", endpoint),
        ("--kv-events-replay-endpoint", config.kv_events_replay_endpoint),
    ):
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"{flag} must be tcp://HOST:PORT, ipc://PATH or inproc://NAME")
