"""Type stubs for the Rust extension `compat_serve._native` (checked by mypy.stubtest)."""

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, TypeAlias, final

__all__ = [
    "Admission",
    "ChatTemplate",
    "DecodeBlock",
    "GrammarError",
    "GrammarMatcher",
    "NewBlock",
    "PrefixCache",
    "PrefixCacheStats",
    "Scheduler",
    "SchedulerError",
    "StepPlan",
    "TemplateError",
    "TokenTable",
    "__version__",
    "attention_decode",
    "fill_masks",
    "image_hash",
    "matmul_kernel",
    "matmul_nt",
    "swiglu_mlp",
]

__version__: str

class TemplateError(Exception):
    """A chat template failed to compile, failed to render, or called raise_exception()."""

class SchedulerError(Exception):
    """The scheduler was misused: unknown or duplicate request id, invalid status
    transition, or a step result that does not match its plan."""

class GrammarError(ValueError):
    """A grammar (JSON schema, Lark, regex) failed to compile, or generation left it."""

@final
class TokenTable:
    """One model's vocabulary as the grammar engine (llguidance) sees it."""

    def __new__(
        cls, tokenizer_json: str, eos_token_ids: list[int], logits_width: int
    ) -> TokenTable: ...
    @staticmethod
    def from_token_bytes(
        tokens: list[bytes], eos_token_ids: list[int], logits_width: int
    ) -> TokenTable: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def mask_words(self) -> int: ...
    def special_token(self, name: str) -> int | None: ...
    def token_bytes(self, token: int) -> bytes: ...
    def compile(self, kind: str, source: str) -> GrammarMatcher:
        """`kind`: json_schema, lark or regex. Raises `GrammarError`."""

@final
class GrammarMatcher:
    """One request's grammar state."""

    def mask(self) -> bytes:
        """Allowed next tokens: `mask_words` little-endian u32 words."""
    def consume(self, token: int) -> None: ...
    def validate(self, tokens: list[int]) -> int: ...
    def rollback(self, n: int) -> None: ...
    def is_stopped(self) -> bool: ...
    def is_accepting(self) -> bool: ...
    @property
    def consumed(self) -> int: ...
    @property
    def mask_words(self) -> int: ...

def image_hash(data: bytes) -> bytes:
    """xxh3-128 (the block hasher's seed) of an image's bytes: 16 bytes, big-endian."""

def fill_masks(matchers: list[GrammarMatcher | None], words: int) -> tuple[bytes, list[str | None]]:
    """One mask row per matcher (None: all allowed) and each row's error."""

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
        decode_prefill_chunk: int | None = None,
    ) -> Scheduler: ...
    def add_request(
        self,
        id: str,
        prompt_len: int,
        max_tokens: int,
        stop_token_ids: Sequence[int] = ...,
        cached_tokens: int = 0,
    ) -> None:
        """Queues a request (FIFO). `id` must not belong to a live request. The first
        `cached_tokens` prompt tokens are a prefix-cache hit: prefill starts after them
        (a preempted request recomputes from 0)."""

    def schedule(self) -> StepPlan:
        """Plans the next step; `update()` must follow before the next `schedule()`."""

    def update(
        self, prefilled: Sequence[tuple[str, int]], sampled: Sequence[tuple[str, int]]
    ) -> list[tuple[str, str]]:
        """Reports the step: `prefilled` = `(id, tokens computed)` for every planned
        prefill, `sampled` = `(id, token)` for every decode and last chunk (a decoding
        request may report several tokens in order: accepted speculated tokens, each
        but the last leaving it running). Returns `(id, reason)` for each request that
        finished; they are forgotten."""

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
    @property
    def kv_tokens_free(self) -> int:
        """Tokens of KV still free: room for speculated tokens beyond the plan."""

    @property
    def token_limit(self) -> int:
        """Prompt plus output tokens at which a request ends with `context_full`."""

    def snapshot(self) -> list[tuple[str, str, int, int]]:
        """`(id, status, computed, generated)` per live request, running first."""

    def check_invariants(self) -> None:
        """Raises `SchedulerError` if an internal invariant is broken (for tests)."""

# --- prefix cache -------------------------------------------------------------------

@final
class Admission:
    """What `admit` found: the first `cached_tokens` prompt tokens are served by the K/V of
    `block_ids`, in order, `block_size` tokens each."""

    @property
    def cached_tokens(self) -> int: ...
    @property
    def block_ids(self) -> list[int]: ...

@final
class NewBlock:
    """A block `append` filled: the request's tokens `[start_token, start_token +
    block_size)`, block number `index` of its table. Store its K/V under `block_id` if
    `is_new`; otherwise the same content is cached there already."""

    @property
    def block_id(self) -> int: ...
    @property
    def index(self) -> int: ...
    @property
    def start_token(self) -> int: ...
    @property
    def is_new(self) -> bool: ...

@final
class PrefixCacheStats:
    """Counters and gauges of a `PrefixCache`."""

    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def cached_blocks(self) -> int:
        """Blocks holding cached K/V, in use or free."""

    @property
    def in_use_blocks(self) -> int:
        """Blocks some request holds."""

    @property
    def free_blocks(self) -> int:
        """Blocks nobody holds (cached or empty)."""

    @property
    def num_requests(self) -> int:
        """Open request tables."""

    @property
    def query_tokens(self) -> int:
        """Prompt tokens passed to `admit`, and how many of them hit."""

    @property
    def hit_tokens(self) -> int: ...
    @property
    def stored_blocks(self) -> int:
        """Blocks `append` stored, found already cached, or could not cache (all in use)."""

    @property
    def deduplicated_blocks(self) -> int: ...
    @property
    def uncached_blocks(self) -> int: ...
    @property
    def evictions(self) -> int:
        """Cached blocks whose content was dropped (reallocation or `clear`)."""

    @property
    def hit_rate(self) -> float:
        """The share of admitted prompt tokens served from cache (0.0 before any)."""

@final
class PrefixCache:
    """Prefix-cache bookkeeping over `num_blocks` blocks of `block_size` tokens: chained
    block hashes, refcounts, an LRU of free blocks, lazy eviction."""

    def __new__(cls, block_size: int, num_blocks: int, hash_kind: str = "xxh3") -> PrefixCache:
        """`hash_kind`: `"xxh3"` (xxh3-128, fixed seed) or `"sha256"`."""

    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def hash_kind(self) -> str: ...
    def lookup(
        self,
        tokens: Sequence[int],
        extra: bytes | None = None,
        images: Sequence[tuple[int, int, bytes]] | None = None,
    ) -> int:
        """Prompt tokens `admit` would serve from cache now (capped the same way);
        acquires nothing."""

    def admit(
        self,
        id: str,
        tokens: Sequence[int],
        extra: bytes | None = None,
        images: Sequence[tuple[int, int, bytes]] | None = None,
    ) -> Admission:
        """Opens request `id`'s table with the longest cached prefix of `tokens` (capped to
        leave at least one token to compute) and holds its blocks. `extra` (image
        hashes, a per-key cache salt) separates chains. `images`: `(start, length,
        hash)` of each image's placeholder tokens, keys of every block they overlap."""

    def append(self, id: str, tokens: Sequence[int]) -> list[NewBlock]:
        """Records request `id`'s next computed tokens (after those admitted or appended
        before) and returns each block they fill. Drain `take_evicted()` before storing
        the new blocks: one may reuse an id this call evicted."""

    def release(self, id: str) -> bool:
        """Closes request `id`'s table; its blocks stay cached until evicted. `False` if
        no such table is open."""

    def take_evicted(self) -> list[int]:
        """Block ids whose cached content was evicted since the last call, oldest first:
        drop their K/V."""

    def clear(self) -> None:
        """Evicts every cached block no request holds (listed by `take_evicted`)."""

    def num_tokens(self, id: str) -> int | None:
        """Tokens request `id` has (admitted from cache plus appended), `None` if its
        table is not open."""

    def stats(self) -> PrefixCacheStats: ...
    def set_pin_fraction(self, fraction: float) -> None:
        """The share of the pool `cache_control` pins may cover (`--cache-pin-fraction`,
        0 to 1): past it, RAM lets go of the pins that expire first."""

    def pin(self, id: str, pins: Sequence[tuple[int, int]], now: float) -> int:
        """Pins, for each `(end_token, ttl_secs)` breakpoint, the full blocks request `id`
        holds up to `end_token` until `now + ttl_secs` (refreshing a pin already there,
        and holding it in RAM again if RAM had let go of it). Pinned blocks are evicted
        only after every unpinned one. Returns how many pins were created or
        refreshed."""

    def expire_pins(self, now: float) -> int:
        """Drops the pins expired at `now`, in RAM and for the disk tier; returns how
        many."""

    def pins(self) -> list[tuple[bytes, int, int, float]]:
        """The live pins RAM holds, earliest expiry first: `(hash of the last block,
        tokens, ttl_secs, expires_at)`."""

    def pinned_blocks(self) -> list[tuple[bytes, float]]:
        """Every block a live pin covers, held in RAM or not (a pin RAM let go of still
        holds in the disk tier until it expires): `(chained hash, latest expiry of the
        pins covering it)`, earliest expiry first and, within one expiry, the chain's
        last block first."""

    def pin_generation(self) -> int:
        """Changes whenever what `pinned_blocks` lists may change (a pin made, refreshed
        or dropped)."""

    def pin_counts(self) -> tuple[int, int]:
        """Pool blocks covered by at least one pin, and pins RAM let go of before expiry
        to make room."""

    def block_hashes(
        self,
        tokens: Sequence[int],
        extra: bytes | None = None,
        images: Sequence[tuple[int, int, bytes]] | None = None,
    ) -> list[bytes]:
        """The chained hash of every full block of `tokens` (16 bytes for xxh3, 32 for
        sha256), as `admit` computes them."""

    def check_invariants(self) -> None:
        """Raises `SchedulerError` if an internal invariant is broken (for tests)."""

# ---- CPU decode kernels (compat-kernels) ------------------------------------------------

# Any object with the buffer protocol (MLX arrays do not declare it to type checkers).
_Buffer: TypeAlias = Any

# Operands are any buffer-protocol objects (MLX or numpy arrays). Weights, keys and values
# are read in place; inputs are copied; the result is written into `out`. Wrong dtypes,
# shapes, strides or a read-only `out` raise ValueError.

def matmul_nt(x: _Buffer, w: _Buffer, out: _Buffer) -> None:
    """`out[m, n] = Σ_k x[m, k] · w[n, k]`: float32 `x` `[.., depth]`, C-contiguous `w`
    `[cols, depth]`, writable float32 `out` `[.., cols]`."""

def swiglu_mlp(x: _Buffer, w_gate: _Buffer, w_up: _Buffer, w_down: _Buffer, out: _Buffer) -> None:
    """`out = (silu(x · w_gateᵀ) ⊙ (x · w_upᵀ)) · w_downᵀ` for float32 `x` `[.., hidden]`."""

def attention_decode(
    queries: _Buffer,
    keys: _Buffer,
    values: _Buffer,
    mask: _Buffer | None,
    scale: float,
    out: _Buffer,
) -> None:
    """One decode step's attention: `queries` `[batch, heads, 1, dim]`, `keys`/`values`
    `[batch, kv_heads, positions, dim]` (strided views allowed, last axis contiguous),
    `mask` uint8 `[batch, 1, 1, positions]` (nonzero = visible) or None."""

@final
class DecodeBlock:
    """One llama-style decoder block's decode step in two calls, around the KV cache
    update: weights are read in place from the buffers given here (shapes checked once)."""

    def __new__(
        cls,
        norms: tuple[_Buffer, float, _Buffer, float],
        attention: tuple[_Buffer, _Buffer, _Buffer, _Buffer],
        mlp: tuple[_Buffer, _Buffer, _Buffer],
        head_dim: int,
        rope: tuple[int, float, float, bool],
    ) -> DecodeBlock: ...
    def project(
        self,
        x: _Buffer,
        positions: list[int],
        outputs: tuple[_Buffer, _Buffer, _Buffer],
    ) -> None:
        """Input norm, q/k/v products and RoPE of one new position per row of `x`
        `[rows, 1, hidden]`, into (queries, keys, values) `[rows, heads, 1, head_dim]`."""
    def finish(
        self,
        x: _Buffer,
        queries: _Buffer,
        keys: _Buffer,
        values: _Buffer,
        mask: _Buffer | None,
        scale: float,
        out: _Buffer,
    ) -> None:
        """Attention over the cached keys/values, output product, residual, norm, SwiGLU
        and residual, into `out` shaped like `x`."""
    def finish_attended(self, x: _Buffer, attention: _Buffer, out: _Buffer) -> None:
        """After an attention computed elsewhere (`[rows, heads, 1, head_dim]`): output
        product, residual, norm, SwiGLU feed-forward and residual, into `out` (like `x`)."""

def matmul_kernel() -> str:
    """`"avx512"` when the kernels have a SIMD path on this CPU, else `"scalar"`."""
