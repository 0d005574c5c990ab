"""One measurement each way, on the same weights: compat-serve's Engine (its thread, its
scheduler, its caches) and mlx-lm's own generators (`BatchGenerator`, which
mlx_lm.server batches with, and `generate_step`, behind `mlx_lm.generate`).

Decode tok/s is the same formula on both sides: tokens after each stream's first, summed,
over the span from the first stream's first token to the last stream's last token.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache

from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.types import EngineRequest, SamplingParams
from compat_serve.models.types import LoadedModel

_ids = itertools.count()


@dataclass(frozen=True)
class Timed:
    """One stream: its tokens and when they came."""

    tokens: list[int]
    submitted: float
    first: float
    last: float
    cached: int = 0

    @property
    def ttft(self) -> float:
        return self.first - self.submitted


def decode_rate(streams: Sequence[Timed]) -> float:
    live = [s for s in streams if len(s.tokens) > 1]
    if not live:
        return 0.0
    span = max(s.last for s in live) - min(s.first for s in live)
    return sum(len(s.tokens) - 1 for s in live) / span if span > 0 else 0.0


@contextlib.contextmanager
def running_engine(loaded: LoadedModel, config: EngineConfig) -> Iterator[Engine]:
    engine = Engine(loaded, config)
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


async def _stream(engine: Engine, prompt: tuple[int, ...], max_tokens: int) -> Timed:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, stop_at_eos=False)
    request = EngineRequest(f"gpu-{next(_ids)}", prompt, sampling)
    submitted = time.perf_counter()
    first = last = 0.0
    tokens: list[int] = []
    cached = 0
    async for event in engine.submit(request):
        if event.error:
            raise RuntimeError(f"engine error: {event.error}")
        if event.token_ids:
            last = time.perf_counter()
            first = first or last
            tokens += event.token_ids
        if event.usage is not None:
            cached = event.usage.cached_tokens
    return Timed(tokens, submitted, first, last, cached)


def engine_streams(
    engine: Engine, prompts: Sequence[tuple[int, ...]], max_tokens: int
) -> list[Timed]:
    """All prompts submitted at once, greedy, EOS ignored: `max_tokens` each."""

    async def go() -> list[Timed]:
        return list(await asyncio.gather(*(_stream(engine, p, max_tokens) for p in prompts)))

    return asyncio.run(go())


def mlx_lm_streams(
    model: object, prompts: Sequence[tuple[int, ...]], max_tokens: int
) -> list[Timed]:
    """The same through mlx-lm's `BatchGenerator`, its decode batch as wide as the prompts
    (mlx_lm.server `--decode-concurrency`), its prefill batch its default."""
    generator = BatchGenerator(
        model,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        completion_batch_size=len(prompts),
    )
    submitted = time.perf_counter()
    try:
        uids = generator.insert([list(p) for p in prompts], [max_tokens] * len(prompts))
        tokens: dict[int, list[int]] = {uid: [] for uid in uids}
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        while responses := generator.next_generated():
            now = time.perf_counter()
            for response in responses:
                tokens[response.uid].append(int(response.token))
                first.setdefault(response.uid, now)
                last[response.uid] = now
    finally:
        generator.close()
    return [Timed(tokens[u], submitted, first[u], last[u]) for u in uids if u in first]


def engine_ttft(engine: Engine, prompt: tuple[int, ...]) -> Timed:
    """One request, one token: time to first token and the tokens read from cache."""
    return engine_streams(engine, [prompt], 1)[0]


def mlx_lm_ttft(
    model: object, prompt: tuple[int, ...], cache: list[object] | None = None
) -> tuple[float, list[object]]:
    """`generate_step`'s first token on a fresh cache, or on a copy of `cache` (a prefix
    already prefilled, copied as mlx_lm.server's prompt cache does): (seconds, the cache
    after the prompt)."""
    started = time.perf_counter()
    work = make_prompt_cache(model) if cache is None else copy.deepcopy(cache)  # type: ignore[arg-type]
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=1, prompt_cache=work):  # type: ignore[arg-type]
        int(token)
        break
    return time.perf_counter() - started, work


def mlx_lm_prefill(model: object, prompt: tuple[int, ...]) -> list[object]:
    """A cache holding exactly `prompt` (no token generated past it)."""
    cache = make_prompt_cache(model)  # type: ignore[arg-type]
    for start in range(0, len(prompt), 2048):
        model(mx.array(prompt[start : start + 2048])[None], cache=cache)  # type: ignore[operator]
        mx.eval([c.state for c in cache])  # type: ignore[attr-defined]
    return cache


def mlx_lm_greedy(model: object, prompt: tuple[int, ...], n: int) -> list[int]:
    """`mlx_lm.generate`'s greedy tokens (its `generate_step`, argmax sampler)."""
    steps = generate_step(mx.array(prompt), model, max_tokens=n)  # type: ignore[arg-type]
    return [int(token) for token, _ in steps]


def top2_gap(model: object, ids: Sequence[int]) -> float:
    """The reference's margin between its two best logits after `ids`."""
    logits = model(mx.array([list(ids)]), cache=make_prompt_cache(model))[0, -1]  # type: ignore[operator, arg-type]
    top = mx.sort(logits.astype(mx.float32))[-2:].tolist()
    return float(top[1] - top[0])


@dataclass(frozen=True)
class Agreement:
    """Tie-aware greedy comparison: equal up to the first position where the reference's
    top-two margin is under the tolerance (a near tie, which float order may flip)."""

    same: int  # leading tokens equal
    length: int
    gap: float | None  # the reference's top-2 margin where they part, None if they don't
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.gap is None or self.gap < self.tolerance

    def describe(self) -> str:
        if self.gap is None:
            return f"equal {self.same}/{self.length}"
        verdict = "near tie" if self.ok else "MISMATCH"
        return f"{verdict} at {self.same}/{self.length} (top-2 gap {self.gap:.4f})"


def agreement(
    model: object, prompt: tuple[int, ...], ours: list[int], theirs: list[int], tolerance: float
) -> Agreement:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return Agreement(i, len(theirs), top2_gap(model, [*prompt, *theirs[:i]]), tolerance)
    if len(ours) != len(theirs):
        return Agreement(min(len(ours), len(theirs)), len(theirs), float("inf"), tolerance)
    return Agreement(len(ours), len(theirs), None, tolerance)
