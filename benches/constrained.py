"""Constrained decoding cost on the embedded model (issue 13's targets).

1. Mask time per token per row: a JSON-schema grammar (and a tool-call grammar in its
   lazy "auto" form) walked token by token over the embedded 49k vocabulary with seeded
   random logits; each step times `fill_masks` for one row (Rust, GIL released) and the
   whole `masked_logits` (mask + bits to a boolean row + `mx.where`). Target: <= 50 us
   for the Rust mask.
2. Decode throughput of a batch of 8: every row free vs half the rows under a JSON
   schema (long enough never to finish in the token budget, so every row decodes the
   same number of steps). Alternating runs in one process; medians with their spread.
   Target: >= 0.9x.

Run: `make bench-python` or `.venv/bin/python benches/constrained.py [--repeats N]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from compat_serve.models.blas import ensure_fast_blas

ensure_fast_blas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from compat_serve._native import fill_masks  # noqa: E402
from compat_serve.engine.config import EngineConfig  # noqa: E402
from compat_serve.engine.constraints import Grammars, masked_logits  # noqa: E402
from compat_serve.engine.engine import Engine  # noqa: E402
from compat_serve.engine.types import EngineRequest, Grammar, SamplingParams  # noqa: E402
from compat_serve.models.loader import load_model  # noqa: E402
from compat_serve.parsers.registry import TOOL_FORMATS  # noqa: E402
from compat_serve.parsers.request_tools import RequestTools  # noqa: E402
from compat_serve.parsers.tool_grammar import tool_call_grammar  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "emails": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "emails", "address"],
    "additionalProperties": False,
}
# Never completes within the decode budget: every constrained row decodes every step.
LONG = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 200}},
    "required": ["notes"],
    "additionalProperties": False,
}
BASH = {
    "type": "object",
    "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
    "required": ["command"],
}
# What a Hermes-format request with tools in `auto` runs under: free text until
# `<tool_call>`, then a constrained call.
TOOL_AUTO = tool_call_grammar(TOOL_FORMATS["hermes"], RequestTools({"Bash": BASH}), mode="auto")
assert TOOL_AUTO is not None


def mask_times(grammars: Grammars, grammar: Grammar, steps: int, seed: int) -> dict[str, float]:
    matcher = grammars.compile(grammar)
    rng = np.random.default_rng(seed)
    width = grammars.logits_width
    rust: list[float] = []
    total: list[float] = []
    for _ in range(steps):
        if matcher.is_stopped():
            break
        started = time.perf_counter()
        fill_masks([matcher], matcher.mask_words)
        rust.append(time.perf_counter() - started)
        logits = mx.array(rng.normal(size=(1, width)).astype(np.float32))
        mx.eval(logits)
        started = time.perf_counter()
        masked, _ = masked_logits(logits, [matcher])
        mx.eval(masked)
        total.append(time.perf_counter() - started)
        token = int(mx.argmax(masked, axis=-1).item())
        if token in grammars.eos_ids:
            break
        matcher.consume(token)
    return {
        "tokens": len(rust),
        "rust_us_median": statistics.median(rust) * 1e6,
        "rust_us_p90": float(np.percentile(rust, 90)) * 1e6,
        "apply_us_median": statistics.median(total) * 1e6,
    }


def decode_rate(engine: Engine, ids: tuple[int, ...], constrained: int, tokens: int) -> float:
    grammar = Grammar("json_schema", json.dumps(LONG))

    async def run() -> float:
        streams = [
            engine.submit(
                EngineRequest(
                    f"b{constrained}-{i}-{time.monotonic_ns()}",
                    ids,
                    SamplingParams(max_tokens=tokens, temperature=0, stop_at_eos=False),
                    grammar=grammar if i < constrained else None,
                )
            )
            for i in range(8)
        ]
        counts = 0

        async def drain(stream: Any) -> None:
            nonlocal counts
            async for event in stream:
                counts += len(event.token_ids)

        started = time.perf_counter()
        await asyncio.gather(*(drain(s) for s in streams))
        return counts / (time.perf_counter() - started)

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    loaded = load_model(None)
    engine = Engine(loaded, EngineConfig(prefill_chunk=512, max_num_seqs=8))
    engine.start()
    grammars = Grammars(loaded.tokenizer, engine.logits_width)
    print(f"vocabulary: {grammars.table.vocab_size} tokens, mask {grammars.table.mask_words} words")
    for name, grammar in (
        ("json_schema (person)", Grammar("json_schema", json.dumps(PERSON))),
        ("tool call, auto (lazy)", Grammar("lark", TOOL_AUTO)),
    ):
        stats = [mask_times(grammars, grammar, 120, seed) for seed in range(3)]
        rust = [s["rust_us_median"] for s in stats]
        apply = [s["apply_us_median"] for s in stats]
        print(
            f"mask per token per row, {name}: Rust {statistics.median(rust):.0f} us "
            f"(runs {', '.join(f'{r:.0f}' for r in rust)}; p90 "
            f"{statistics.median(s['rust_us_p90'] for s in stats):.0f}), "
            f"with MLX apply {statistics.median(apply):.0f} us, "
            f"{sum(int(s['tokens']) for s in stats)} tokens"
        )
    prompt = "<|im_start|>user\nList notes about Paris.<|im_end|>\n<|im_start|>assistant\n"
    ids = tuple(loaded.tokenizer.encode(prompt))
    decode_rate(engine, ids, 0, 8)  # warm-up
    free: list[float] = []
    half: list[float] = []
    for _ in range(args.repeats):
        free.append(decode_rate(engine, ids, 0, args.tokens))
        half.append(decode_rate(engine, ids, 4, args.tokens))
    ratio = statistics.median(half) / statistics.median(free)
    print(
        f"batch of 8, {args.tokens} tokens each: free {statistics.median(free):.1f} tok/s "
        f"(runs {', '.join(f'{r:.1f}' for r in free)}); half under a JSON schema "
        f"{statistics.median(half):.1f} tok/s (runs {', '.join(f'{r:.1f}' for r in half)}); "
        f"ratio {ratio:.2f}x (target >= 0.9x)"
    )
    engine.shutdown()


if __name__ == "__main__":
    main()
