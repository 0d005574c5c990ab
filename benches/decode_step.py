"""One batched decode forward: mlx-lm's weight layout vs ours (`models/cpu_layout.py`).

Loads the dense float32 directory `compat-serve convert-gguf --dtype float32` writes (the
weights both servers use in `throughput.py`) with `mlx_lm.utils.load`, fills B batch-1
caches with distinct ~60-100-token prompts, merges them into mlx-lm's `BatchKVCache` and
times one decode step (forward + greedy argmax, read back to Python) at batch 1, 4, 8, 16
— first with the weights as mlx-lm stores them (`[out, in]`, used transposed), then after
`store_input_major` in the same process, same BLAS. Logits of both layouts are compared.

Run: `.venv/bin/python benches/decode_step.py [--steps 20] [--batches 1,4,8,16]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from compat_serve.models.blas import ensure_fast_blas

BLAS = ensure_fast_blas()

import mlx.core as mx  # noqa: E402  (the BLAS must be loaded before mlx)
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load  # noqa: E402

from _servers import converted_model_dir, environment_lines  # noqa: E402
from compat_serve.models.cpu_layout import store_input_major  # noqa: E402


def batch_cache(model: Any, rows: int) -> list[Any]:
    caches = []
    for row in range(rows):
        cache = make_prompt_cache(model)
        prompt = [100 + (7 * row + i) % 5000 for i in range(60 + 3 * row)]
        model(mx.array([prompt]), cache=cache)
        mx.eval([c.state for c in cache])
        caches.append(cache)
    return [type(layer[0]).merge(list(layer)) for layer in zip(*caches, strict=True)]


def step_ms(model: Any, rows: int, steps: int) -> tuple[float, mx.array]:
    """Median ms of one decode step; also the logits of the first step."""
    cache = batch_cache(model, rows)
    tokens = mx.array([[5 + row] for row in range(rows)], dtype=mx.uint32)
    first = model(tokens, cache=cache)[:, -1, :]
    mx.eval(first)
    for _ in range(2):
        mx.eval(mx.argmax(model(tokens, cache=cache)[:, -1, :], axis=-1))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        picked = mx.argmax(model(tokens, cache=cache)[:, -1, :], axis=-1)
        picked.tolist()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batches", default="1,4,8,16")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model_dir = converted_model_dir()
    model, _ = load(str(model_dir))
    stock: dict[int, tuple[float, mx.array]] = {b: step_ms(model, b, args.steps) for b in batches}
    relaid = store_input_major(model)
    ours: dict[int, tuple[float, mx.array]] = {b: step_ms(model, b, args.steps) for b in batches}
    print()
    for line in environment_lines(model_dir):
        print(line.replace(", loaded by both servers", ""))
    print(f"BLAS: {BLAS.library}; {relaid} weights re-laid input-major")
    print(
        f"\n== one batched decode step (median of {args.steps}), mlx-lm layout vs ours; "
        "tok/s = batch / step time"
    )
    print(f"{'batch':>5} {'mlx-lm ms':>10} {'ours ms':>8} {'mlx-lm tok/s':>13} "
          f"{'ours tok/s':>11} {'speedup':>8} {'max |dlogit|':>13}")  # fmt: skip
    for b in batches:
        (a, la), (o, lo) = stock[b], ours[b]
        diff = mx.abs(la - lo).max().item()
        print(f"{b:>5} {a:>10.1f} {o:>8.1f} {b * 1000 / a:>13.1f} {b * 1000 / o:>11.1f} "
              f"{a / o:>7.2f}x {diff:>13.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
