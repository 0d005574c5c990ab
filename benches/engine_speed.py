"""Prefill and decode speed of the embedded model: our engine vs mlx_lm, and fast path vs not.

1. Our engine (GGUF loaded, dequantized f32, fast BLAS) vs `mlx_lm.stream_generate` on the
   directory `compat-serve convert-gguf --dtype float32` writes — same process, same BLAS,
   same dtype, same prompt — with mlx_lm's own formulas: prompt tok/s = prompt tokens /
   time to first token; decode tok/s = tokens / time since the first token.
2. Our fast path vs MLX as installed (reference BLAS, quantized weights), in a subprocess
   because the BLAS must be chosen before mlx is imported.

Run: `make bench-python` or `.venv/bin/python benches/engine_speed.py [--repeats N]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from compat_serve.models.blas import ensure_fast_blas

BLAS = ensure_fast_blas()

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".bench-cache"
STORY = (
    "Here is a long and detailed story about a dragon who learns to bake bread in a small "
    "mountain village, told chapter by chapter with many characters and conversations. "
)


def prompt_ids(tokenizer: Any, n_tokens: int) -> list[int]:
    """A ChatML prompt of exactly `n_tokens` tokens."""
    head = tokenizer.encode("<|im_start|>user\n")
    tail = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n")
    body = tokenizer.encode(STORY * (n_tokens // 20 + 2))
    return head + body[: n_tokens - len(head) - len(tail)] + tail


def measure_ours(loaded: Any, ids: list[int], decode_tokens: int) -> dict[str, float]:
    from compat_serve.engine.config import EngineConfig
    from compat_serve.engine.engine import Engine
    from compat_serve.engine.types import EngineRequest, SamplingParams

    engine = Engine(loaded, EngineConfig(prefill_chunk=2048))
    engine.start()

    async def one() -> dict[str, float]:
        sampling = SamplingParams(max_tokens=decode_tokens, temperature=0, stop_at_eos=False)
        started = time.perf_counter()
        stream = engine.submit(EngineRequest("bench", tuple(ids), sampling))
        first = last = 0.0
        count = 0
        async for event in stream:
            if event.token_ids:
                last = time.perf_counter()
                count += len(event.token_ids)
                if count == 1:
                    first = last
        return {
            "prompt_tps": len(ids) / (first - started),
            "decode_tps": (count - 1) / (last - first),
        }

    try:
        return asyncio.run(one())
    finally:
        engine.shutdown()


def measure_mlx_lm(model_dir: Path, ids: list[int], decode_tokens: int) -> dict[str, float]:
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(model_dir))
    tokenizer._eos_token_ids = set()  # decode a fixed number of tokens, like ours
    last = None
    for response in stream_generate(model, tokenizer, mx.array(ids), max_tokens=decode_tokens + 1):
        last = response
    assert last is not None
    # mlx_lm divides by tokens counted from the first; ours counts the gaps: align them.
    n = last.generation_tokens
    return {"prompt_tps": last.prompt_tps, "decode_tps": last.generation_tps * (n - 1) / n}


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def converted_dir() -> Path:
    from compat_serve.models.convert import convert_gguf
    from compat_serve.models.embedded import embedded_model_path

    out = CACHE / "smollm2-float32"
    if not (out / "config.json").exists():
        print(f"converting the embedded GGUF to {out} (float32) ...", flush=True)
        convert_gguf(str(embedded_model_path()), str(out), dtype="float32", overwrite=True)
    return out


def only_ours(args: argparse.Namespace) -> None:
    """Subprocess mode: print our numbers as JSON under whatever BLAS/dtype we were given."""
    from compat_serve.models.loader import load_model

    loaded = load_model(None, dtype=args.dtype)
    ids = prompt_ids(loaded.tokenizer, args.prompt_tokens)
    result = measure_ours(loaded, ids, args.decode_tokens)
    print(json.dumps({**result, "blas": BLAS.describe(), "dtype": loaded.dtype}))


def subprocess_ours(
    blas: str, dtype: str, prompt_tokens: int, decode_tokens: int
) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("COMPAT_SERVE_BLAS", None)
    if blas != "auto":
        env["COMPAT_SERVE_BLAS"] = blas
    cmd = [
        sys.executable,
        __file__,
        "--only-ours",
        f"--dtype={dtype}",
        f"--prompt-tokens={prompt_tokens}",
        f"--decode-tokens={decode_tokens}",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-installed", action="store_true", help="skip the slow part 2")
    parser.add_argument("--only-ours", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only_ours:
        only_ours(args)
        return

    from compat_serve.models.loader import load_model

    print(f"BLAS: {BLAS.describe()}")
    loaded = load_model(None)
    ids = prompt_ids(loaded.tokenizer, args.prompt_tokens)
    model_dir = converted_dir()
    # Warm up both paths (allocator, lazy graph setup) before timing.
    measure_ours(loaded, ids[:64], 4)
    measure_mlx_lm(model_dir, ids[:64], 4)
    ours, theirs = [], []
    for i in range(args.repeats):
        # Alternate so drift on a shared machine hits both sides alike.
        ours.append(measure_ours(loaded, ids, args.decode_tokens))
        theirs.append(measure_mlx_lm(model_dir, ids, args.decode_tokens))
        print(f"  run {i + 1}: ours {ours[-1]}  mlx_lm {theirs[-1]}", flush=True)
    o, t = median_of(ours), median_of(theirs)
    print(
        f"\n== engine vs mlx_lm.stream_generate ({args.prompt_tokens}-token prompt, "
        f"{args.decode_tokens} decode tokens, float32, median of {args.repeats})"
    )
    print(f"{'':14}{'compat-serve':>14}{'mlx_lm':>10}{'ratio':>8}")
    for key, label in (("prompt_tps", "prefill tok/s"), ("decode_tps", "decode tok/s")):
        print(f"{label:14}{o[key]:14.1f}{t[key]:10.1f}{o[key] / t[key]:8.2f}")

    if args.skip_installed:
        return
    small_prompt, small_decode = 128, 16
    fast = subprocess_ours("auto", "auto", small_prompt, small_decode)
    slow = subprocess_ours("none", "quantized", small_prompt, small_decode)
    print(
        f"\n== fast path vs MLX as installed ({small_prompt}-token prompt, "
        f"{small_decode} decode tokens)"
    )
    print(f"  fast path:    {fast['blas']}, {fast['dtype']}")
    print(f"  as installed: {slow['blas']}, {slow['dtype']}")
    print(f"{'':14}{'fast path':>12}{'installed':>11}{'speedup':>9}")
    for key, label in (("prompt_tps", "prefill tok/s"), ("decode_tps", "decode tok/s")):
        print(f"{label:14}{fast[key]:12.1f}{slow[key]:11.1f}{fast[key] / slow[key]:9.1f}x")


if __name__ == "__main__":
    main()
