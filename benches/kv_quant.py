"""Quantized KV (`--kv-bits`) vs the model's dtype on the embedded model.

For each KV format (none, 8-bit, 4-bit; group 64):

- **tokens per GiB** of live KV, from the real arrays' bytes after a prefill (the
  request's own cache, capacity included);
- **perplexity** over fixed text (`--ppl-tokens`, default 2,048; a fixed deterministic
  passage generated below), teacher-forced in chunks through the same cache class the
  engine uses, so every chunk attends to the earlier ones' stored (quantized) K/V;
- **decode tok/s** at 1 and 8 concurrent greedy streams (engine, prefix cache off), and
  at 8 streams after a shared `--long-context` preamble (default 1,024 tokens, read from
  the prefix cache, so the rounds time decode over long rows, as in an agent session);
- **repeat-prompt cache reads** under one fixed `--cache-memory` (`--cache-mib`, default
  sized to about half the prompt unquantized): prompt tokens the second identical
  request reads from cache;
- **greedy agreement**: how many of 5 short prompts give the same 16 tokens as
  unquantized, and as mlx-lm's own cache of the same format (`KVCache` /
  `QuantizedKVCache`, one sequence), the reference implementation.

Decode runs alternate between formats (`--repeats` rounds, default 3); the table shows
medians and the min-max spread. The load average is printed before and after: the
machine may be shared.

Run: `.venv/bin/python benches/kv_quant.py [--repeats 3] [--ppl-tokens 2048]`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import time
from pathlib import Path

from compat_serve.models.blas import ensure_fast_blas

ensure_fast_blas()

import mlx.core as mx  # noqa: E402

from compat_serve.engine.config import EngineConfig  # noqa: E402
from compat_serve.engine.engine import Engine  # noqa: E402
from compat_serve.engine.kv_quant import KVFormat  # noqa: E402
from compat_serve.engine.runner import ModelRunner  # noqa: E402
from compat_serve.engine.types import EngineRequest, SamplingParams  # noqa: E402
from compat_serve.models.loader import load_model  # noqa: E402
from compat_serve.models.types import LoadedModel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.python.kv_quant_reference import SHORT_PROMPTS, mlx_lm_greedy  # noqa: E402

FORMATS = {"none": KVFormat(), "8-bit": KVFormat(8, 64), "4-bit": KVFormat(4, 64)}
# Chat-formatted, so the model writes an answer instead of ending at once.
STREAM_PROMPTS = [
    f"<|im_start|>user\nTell me a long story about a fox and the number {i}.<|im_end|>\n"
    "<|im_start|>assistant\n"
    for i in range(8)
]


def fixed_text() -> str:
    """Deterministic English prose (no randomness, no files): a town's daily records."""
    towns = ["Ashford", "Brookvale", "Cedar Point", "Dunmore", "Elmstead", "Fairhaven"]
    goods = ["wheat", "barley", "wool", "timber", "salt", "copper", "apples", "cloth"]
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    lines = []
    for i in range(400):
        town, good, day = towns[i % 6], goods[(i * 3) % 8], days[(i * 5) % 7]
        lines.append(
            f"On {day} the market of {town} sold {10 + (i * 7) % 90} carts of {good}, "
            f"and the traders said the price was {'higher' if i % 3 else 'lower'} than "
            f"the week before because the roads from the river were "
            f"{'open' if i % 4 else 'flooded'}."
        )
    return " ".join(lines)


def perplexity(loaded: LoadedModel, kv_format: KVFormat, tokens: list[int]) -> float:
    """exp(mean NLL) of tokens[1:] given the earlier ones, in chunks of 256 through one
    cache of `kv_format`."""
    runner = ModelRunner(loaded, kv_format)
    cache = runner.new_cache()
    model = loaded.model
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - 1, 256):
        chunk = tokens[start : min(start + 256, len(tokens) - 1)]
        targets = mx.array(tokens[start + 1 : start + 1 + len(chunk)])
        logits = model(mx.array(chunk, dtype=mx.uint32)[None], cache=cache)[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(logprobs, targets[:, None], axis=-1)
        nll -= float(picked.sum().item())
        count += len(chunk)
    return math.exp(nll / count)


def tokens_per_gib(loaded: LoadedModel, kv_format: KVFormat, length: int = 1024) -> float:
    runner = ModelRunner(loaded, kv_format)
    cache = runner.new_cache()
    runner.prefill(cache, list(range(1000, 1000 + length)))
    used = sum(layer.nbytes for layer in cache)
    positions = max(
        int(layer.keys[0].shape[2] if isinstance(layer.keys, tuple) else layer.keys.shape[2])
        for layer in cache
    )
    return positions / used * 2**30


_ids = iter(range(10**9))


async def _generate(
    engine: Engine, prompt: tuple[int, ...], max_tokens: int
) -> tuple[list[int], float, float, int]:
    request = EngineRequest(
        f"b{next(_ids)}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0)
    )
    first = last = 0.0
    tokens: list[int] = []
    cached = 0
    async for event in engine.submit(request):
        if event.token_ids:
            now = time.perf_counter()
            first = first or now
            last = now
            tokens += event.token_ids
        if event.usage is not None:
            cached = event.usage.cached_tokens
    return tokens, first, last, cached


def decode_rate(engine: Engine, prompts: list[tuple[int, ...]], max_tokens: int) -> float:
    async def go() -> list[tuple[list[int], float, float, int]]:
        return list(await asyncio.gather(*(_generate(engine, p, max_tokens) for p in prompts)))

    results = [r for r in asyncio.run(go()) if len(r[0]) > 1]
    start = min(r[1] for r in results)
    end = max(r[2] for r in results)
    generated = sum(len(r[0]) - 1 for r in results)
    return generated / (end - start)


def greedy(engine: Engine, prompts: list[tuple[int, ...]]) -> list[list[int]]:
    async def go() -> list[list[int]]:
        done = await asyncio.gather(*(_generate(engine, p, 16) for p in prompts))
        return [d[0] for d in done]

    return asyncio.run(go())


def cache_reads(
    loaded: LoadedModel, kv_format: KVFormat, prompt: tuple[int, ...], mib: float
) -> int:
    engine = Engine(loaded, EngineConfig(cache_memory_bytes=int(mib * 2**20), kv_format=kv_format))
    engine.start()
    try:
        asyncio.run(_generate(engine, prompt, 1))
        return asyncio.run(_generate(engine, prompt, 1))[3]
    finally:
        engine.shutdown()


def long_context_rates(
    loaded: LoadedModel, context: int, repeats: int, max_tokens: int
) -> dict[str, list[float]]:
    """8 greedy streams decoding after a shared `context`-token preamble each engine
    prefilled once (prefix cache on): decode over long rows."""
    encode = loaded.tokenizer.encode
    preamble = tuple(encode(fixed_text()))[:context]
    streams = [preamble + tuple(encode(p)) for p in STREAM_PROMPTS]
    engines = {name: Engine(loaded, EngineConfig(kv_format=f)) for name, f in FORMATS.items()}
    rates: dict[str, list[float]] = {}
    try:
        for engine in engines.values():
            engine.start()
            asyncio.run(_generate(engine, preamble, 1))
        for _ in range(repeats):
            for name, engine in engines.items():
                rates.setdefault(name, []).append(decode_rate(engine, streams, max_tokens))
    finally:
        for engine in engines.values():
            engine.shutdown()
    return rates


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ppl-tokens", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--cache-mib", type=float, default=None)
    parser.add_argument("--long-context", type=int, default=1024)
    parser.add_argument(
        "--decode-only", action="store_true", help="only greedy agreement and decode speed"
    )
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}")
    loaded = load_model(None)
    encode = loaded.tokenizer.encode
    text_tokens = encode(fixed_text())[: args.ppl_tokens + 1]
    assert len(text_tokens) > args.ppl_tokens, len(text_tokens)
    rows: dict[str, dict[str, str]] = {name: {} for name in FORMATS}

    per_gib = {name: tokens_per_gib(loaded, f) for name, f in FORMATS.items()}
    for name in FORMATS:
        ratio = per_gib[name] / per_gib["none"]
        rows[name]["tokens/GiB"] = f"{per_gib[name]:,.0f} ({ratio:.2f}x)"

    ppl = {
        name: 1.0 if args.decode_only else perplexity(loaded, f, text_tokens)
        for name, f in FORMATS.items()
    }
    for name in FORMATS if not args.decode_only else ():
        change = (ppl[name] / ppl["none"] - 1) * 100
        rows[name][f"ppl ({args.ppl_tokens} tok)"] = f"{ppl[name]:.3f} ({change:+.2f}%)"

    engines = {
        name: Engine(loaded, EngineConfig(prefix_cache=False, kv_format=f))
        for name, f in FORMATS.items()
    }
    for engine in engines.values():
        engine.start()
    try:
        short = [tuple(encode(p)) for p in SHORT_PROMPTS]
        reference = greedy(engines["none"], short)
        for name, engine in engines.items():
            tokens = greedy(engine, short)
            same = sum(a == b for a, b in zip(reference, tokens, strict=True))
            rows[name]["greedy = none"] = f"{same}/5"
            mlx_lm = [mlx_lm_greedy(loaded, FORMATS[name], p, 16) for p in short]
            same = sum(a == b for a, b in zip(mlx_lm, tokens, strict=True))
            rows[name]["greedy = mlx-lm same format"] = f"{same}/5"
        streams = [tuple(encode(p)) for p in STREAM_PROMPTS]
        rates: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.repeats):
            for width in (1, 8):
                for name, engine in engines.items():  # alternating formats each round
                    rate = decode_rate(engine, streams[:width], args.decode_tokens)
                    rates.setdefault((name, width), []).append(rate)
    finally:
        for engine in engines.values():
            engine.shutdown()
    long_rates = long_context_rates(loaded, args.long_context, args.repeats, args.decode_tokens)
    rates.update({(name, -8): values for name, values in long_rates.items()})
    for name in FORMATS:
        for width, label in ((1, "x1"), (8, "x8"), (-8, f"x8 @{args.long_context}")):
            ratio = statistics.median(rates[(name, width)]) / statistics.median(
                rates[("none", width)]
            )
            rows[name][f"decode tok/s {label}"] = f"{spread(rates[(name, width)])} {ratio:.2f}x"

    prompt = tuple(encode(fixed_text()))[:600]
    per_token_none = 2**30 / per_gib["none"]
    mib = args.cache_mib or len(prompt) * per_token_none / 2 / 2**20
    for name, f in FORMATS.items() if not args.decode_only else ():
        rows[name][f"repeat reads ({mib:.1f} MiB cache)"] = (
            f"{cache_reads(loaded, f, prompt, mib)}/{len(prompt) - 1}"
        )

    columns = list(rows["none"])
    print(
        f"\nembedded model ({loaded.name}, {loaded.dtype}); medians of {args.repeats} "
        "runs (min-max)"
    )
    print("| KV | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(row[c] for c in columns) + " |")
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
