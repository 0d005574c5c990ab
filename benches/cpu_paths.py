"""Our CPU fast paths vs stock mlx-lm, on the same weights in one process, same BLAS.

Loads the dense float32 directory `compat-serve convert-gguf --dtype float32` writes (the
weights both servers use in `throughput.py`) with `mlx_lm.utils.load`.

1. Decode: fills B batch-1 caches with distinct ~60-100-token prompts, merges them into
   mlx-lm's `BatchKVCache` and times one decode step (forward + greedy argmax, read back to
   Python) at batch 1, 4, 8, 16 — stock mlx-lm; with the weights stored input-major
   (`models/cpu_layout.py`, the path for CPUs without AVX-512); and on our Rust kernels
   (`models/cpu_linear.py` skinny matmul + fused SwiGLU, `models/cpu_decode_attention.py`),
   and with whole llama blocks fused (`models/cpu_decode_block.py`), the path the server
   takes on this machine.
2. Prefill (`models/cpu_attention.py`): one prompt chunk after C tokens of context (the
   context K/V copied from one long prefill), stock attention vs rows split over two CPU
   streams, alternating, best of `--repeats`.
Logits of both variants are compared.

Run: `.venv/bin/python benches/cpu_paths.py [--steps 20] [--batches 1,4,8,16]
[--prefill 0+512,2048+512,2048+300,4096+64] [--repeats 3]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from compat_serve.models.blas import ensure_fast_blas

BLAS = ensure_fast_blas()

import mlx.core as mx  # noqa: E402  (the BLAS must be loaded before mlx)
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load  # noqa: E402

from _servers import converted_model_dir, environment_lines  # noqa: E402
from compat_serve.models.cpu_attention import install_split_attention  # noqa: E402
from compat_serve.models.cpu_decode_block import install_fused_decode_blocks  # noqa: E402
from compat_serve.models.cpu_layout import store_input_major  # noqa: E402
from compat_serve.models.cpu_linear import install_skinny_linears, kernel_available  # noqa: E402


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


def context_cache(model: Any, tokens: int) -> list[Any]:
    cache = make_prompt_cache(model)
    for start in range(0, tokens, 512):
        chunk = [100 + (i % 5000) for i in range(start, min(tokens, start + 512))]
        model(mx.array([chunk]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def prefill_s(model: Any, context: list[Any], length: int, new: int) -> tuple[float, mx.array]:
    cache = make_prompt_cache(model)
    for layer, source in zip(cache, context, strict=True):
        layer.keys = mx.array(source.keys[:, :, :length])
        layer.values = mx.array(source.values[:, :, :length])
        layer.offset = length
    mx.eval([c.state for c in cache])
    start = time.perf_counter()
    logits = model(mx.array([[200 + i for i in range(new)]]), cache=cache)[:, -1, :]
    mx.eval(logits)
    return time.perf_counter() - start, logits


def compare_prefill(model: Any, cases: list[tuple[int, int]], repeats: int) -> None:
    module = sys.modules[type(model).__module__]
    stock = module.scaled_dot_product_attention
    install_split_attention(model)
    split = module.scaled_dot_product_attention
    stock = getattr(split, "_compat_split_attention", stock)
    context = context_cache(model, max(c for c, _ in cases) or 1)
    rows = []
    for length, new in cases:
        times: dict[str, list[float]] = {"stock": [], "split": []}
        last: dict[str, mx.array] = {}
        for _ in range(repeats):
            for name, function in (("stock", stock), ("split", split)):
                module.scaled_dot_product_attention = function
                seconds, last[name] = prefill_s(model, context, length, new)
                times[name].append(seconds)
        diff = mx.abs(last["stock"] - last["split"]).max().item()
        rows.append((length, new, min(times["stock"]), min(times["split"]), diff))
    module.scaled_dot_product_attention = stock
    print(
        f"\n== one prefill chunk after some context: stock attention vs split over two CPU "
        f"streams (best of {repeats}, alternating)"
    )
    print(f"{'context':>7} {'chunk':>5} {'stock s':>8} {'split s':>8} {'stock tok/s':>12} "
          f"{'split tok/s':>12} {'speedup':>8} {'max |dlogit|':>13}")  # fmt: skip
    for length, new, a, b, diff in rows:
        print(f"{length:>7} {new:>5} {a:>8.2f} {b:>8.2f} {new / a:>12.1f} {new / b:>12.1f} "
              f"{a / b:>7.2f}x {diff:>13.2e}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--prefill", default="0+512,2048+512,2048+300,4096+64")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model_dir = converted_model_dir()
    model, _ = load(str(model_dir))
    relaid_model, _ = load(str(model_dir))
    relaid = store_input_major(relaid_model)
    variants: dict[str, dict[int, tuple[float, mx.array]]] = {"stock": {}, "input-major": {}}
    for b in batches:  # stock and input-major alternate per batch size
        variants["stock"][b] = step_ms(model, b, args.steps)
        variants["input-major"][b] = step_ms(relaid_model, b, args.steps)
    del relaid_model
    if kernel_available():
        routed = install_skinny_linears(model)
        install_split_attention(model, decode_kernel=True)
        variants["kernels"] = {b: step_ms(model, b, args.steps) for b in batches}
        fused = install_fused_decode_blocks(model)
        variants["fused blocks"] = {b: step_ms(model, b, args.steps) for b in batches}
    print()
    for line in environment_lines(model_dir):
        print(line.replace(", loaded by both servers", ""))
    print(f"BLAS: {BLAS.library}; {relaid} weights re-laid input-major")
    if "kernels" in variants:
        print(f"Rust kernels: {routed} dense layers + SwiGLU blocks + decode attention")
        print(f"fused blocks: the kernels, and {fused} llama blocks' decode steps in 2 calls")
    else:
        print("Rust kernels: no AVX-512 on this CPU, not measured")
    print(
        f"\n== one batched decode step (median of {args.steps}); tok/s = batch / step time; "
        "speedup and max |dlogit| against stock"
    )
    names = list(variants)
    header = f"{'batch':>5} {'stock ms':>9}"
    for name in names[1:]:
        header += f" {name + ' ms':>15} {'speedup':>8} {'max |dlogit|':>13}"
    print(header + f" {'best tok/s':>11}")
    for b in batches:
        base_ms, base_logits = variants["stock"][b]
        line = f"{b:>5} {base_ms:>9.1f}"
        for name in names[1:]:
            ms, logits = variants[name][b]
            diff = mx.abs(base_logits - logits).max().item()
            line += f" {ms:>15.1f} {base_ms / ms:>7.2f}x {diff:>13.2e}"
        best = min(variants[name][b][0] for name in names)
        print(line + f" {b * 1000 / best:>11.1f}")
    if args.prefill:
        cases = [tuple(int(n) for n in case.split("+")) for case in args.prefill.split(",")]
        compare_prefill(model, [(c, n) for c, n in cases], args.repeats)


if __name__ == "__main__":
    main()
