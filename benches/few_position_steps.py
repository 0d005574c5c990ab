"""Steps of a few positions per row on the CPU's fused path vs the stock llama block (#45).

A speculative verify feeds each row its last token and its drafts in one forward. On the
CPU, decode steps run two Rust calls per block (models/cpu_decode_block.py); steps of a
few positions per row now take them too, each position a row of its own. This bench
compares that path with the stock block (mlx-lm's, which those steps ran before), both in
one process, alternating:

1. the embedded model's forward of `width` new positions over a ~100-position cache, one
   row and four rows (median ms of `--steps` forwards per round);
2. `--speculative ngram` decoding the copy workloads of benches/speculative.py at
   concurrency 1 (tok/s, the engine's cost-aware policy on, as served; an engine per path,
   so each learns its own step costs).

Medians over `--rounds` alternating rounds with the min-max spread. The load average is
printed: the machine may be shared.

Run: `.venv/bin/python benches/few_position_steps.py [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from compat_serve.models.blas import ensure_fast_blas

ensure_fast_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import compat_serve.models.cpu_decode_block as fused_block  # noqa: E402
from compat_serve.engine.batch import merge_caches  # noqa: E402
from compat_serve.engine.config import EngineConfig  # noqa: E402
from compat_serve.engine.engine import Engine  # noqa: E402
from compat_serve.engine.speculation import SpeculationConfig  # noqa: E402
from compat_serve.models.loader import load_model  # noqa: E402
from speculative import WORKLOADS, chat, run  # noqa: E402

FUSED = fused_block._few_positions
PATHS: dict[str, Callable[[mx.array], bool]] = {"fused": FUSED, "stock": lambda x: False}


def forward_ms(model: Any, rows: int, width: int, steps: int) -> float:
    caches = []
    for row in range(rows):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([list(range(100, 200 + 7 * row))]), cache=cache))
        caches.append(cache)
    cache = caches[0] if rows == 1 else merge_caches(caches)
    times = []
    for _ in range(steps):
        tokens = mx.array([[5 + j for j in range(width)]] * rows)
        started = time.perf_counter()
        mx.eval(model(tokens, cache=cache))
        times.append(time.perf_counter() - started)
        for layer in cache:
            layer.trim(width)
    return statistics.median(times) * 1000


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):6.1f} [{min(values):5.1f}-{max(values):5.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=9, help="forwards per round and shape")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    loaded = load_model(None)
    if not loaded.extra.get("decode_blocks"):
        print("no fused decode blocks on this CPU (no AVX-512 or kernels off): nothing to compare")
        return
    print(f"load average before: {os.getloadavg()[0]:.2f} (rounds {args.rounds})")
    shapes = [(rows, width) for rows in (1, 4) for width in (1, 2, 3, 4)]
    forwards: dict[tuple[str, int, int], list[float]] = {}
    for _ in range(args.rounds):
        for path, rule in PATHS.items():
            fused_block._few_positions = rule
            for rows, width in shapes:
                ms = forward_ms(loaded.model, rows, width, args.steps)
                forwards.setdefault((path, rows, width), []).append(ms)
    fused_block._few_positions = FUSED
    print("forward of `width` new positions per row (ms): fused path vs stock block")
    print(f"{'rows':>4} {'width':>5} {'fused':>20} {'stock':>20} {'fused/width 1':>14}")
    for rows, width in shapes:
        fused, stock = forwards[("fused", rows, width)], forwards[("stock", rows, width)]
        ratio = statistics.median(fused) / statistics.median(forwards[("fused", rows, 1)])
        print(f"{rows:>4} {width:>5} {cell(fused):>20} {cell(stock):>20} {ratio:>13.2f}x")

    # An engine per path: each learns its own step costs (the cost-aware policy).
    spec = SpeculationConfig("ngram", num_tokens=4)
    engines = {
        path: Engine(loaded, EngineConfig(prefix_cache=False, max_num_seqs=4, speculation=spec))
        for path in PATHS
    }
    for engine in engines.values():
        engine.start()
    try:
        print("--speculative ngram, concurrency 1, tok/s: fused path vs stock block")
        for name in ("repeat passage", "add type hints"):
            prompt = chat(loaded, WORKLOADS[name])
            rates: dict[str, list[float]] = {path: [] for path in PATHS}
            for rep in range(args.rounds):
                for path, rule in PATHS.items():
                    fused_block._few_positions = rule
                    rate = run(engines[path], prompt, 1, args.max_tokens, f"{path}{rep}")
                    rates[path].append(rate)
            fused_block._few_positions = FUSED
            gain = statistics.median(rates["fused"]) / statistics.median(rates["stock"])
            print(f"{name:<16} {cell(rates['fused'])} {cell(rates['stock'])} {gain:.2f}x")
    finally:
        fused_block._few_positions = FUSED
        for engine in engines.values():
            engine.shutdown()
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
