"""Decode speed with LoRA adapters at 8 streams, through the Engine (issue #38).

The embedded SmolLM2-135M as the server loads it on this machine (float32 with the CPU
fast paths on a CPU backend; `--dtype quantized` for the users' path), random rank-8
adapters in mlx-lm's default shape (every linear of the last 16 layers). Three cases, run
alternately so that load on a shared machine hits them alike:

- `bare`: a second copy of the model in an engine that never had an adapter (what users
  without adapters run: no bank installed, not one line of adapter code in a forward);
- `none`: no adapter on any row (the bank installed and holding four adapters);
- `one`: the same adapter on all 8 rows;
- `four`: four adapters over the 8 rows (two rows each).

Decode tok/s = tokens the 8 streams emit while all 8 decode (after the last stream's
first token, until the first stream's last) / that time. Prints the median of the runs
with their spread, and each case's ratio to `none` (the target: `four` >= 0.8); also per
CPU second of this process, which a shared machine's load disturbs less.

Run: `.venv/bin/python benches/lora.py [--runs 5] [--tokens 48] [--dtype quantized]`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from compat_serve.models.blas import ensure_fast_blas

ensure_fast_blas()

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STREAMS = 8
CASES = ("bare", "none", "one", "four")
PROMPTS = [
    "Name three colours.",
    "What is 2+2?",
    "Write a haiku about rain.",
    "Who wrote Hamlet?",
    "List five fruits.",
    "Explain gravity briefly.",
    "Say hello in French.",
    "Count to ten.",
]


def write_adapters(model: Any, root: Path, count: int) -> list[Path]:
    from tests.python.lora_files import random_pairs, write_mlx_adapter

    keys = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
    layers = min(16, len(model.layers))
    return [
        write_mlx_adapter(
            root / f"a{i}",
            random_pairs(model, keys, seed=i, layers=layers),
            scale=0.5,
            layers=layers,
            keys=keys,
        )
        for i in range(count)
    ]


def adapters_of(case: str) -> list[str | None]:
    if case in ("bare", "none"):
        return [None] * STREAMS
    if case == "one":
        return ["a0"] * STREAMS
    return [f"a{row % 4}" for row in range(STREAMS)]


def decode_rate(engine: Any, loaded: Any, case: str, tokens: int) -> tuple[float, float]:
    """(tokens per wall-clock second, tokens per CPU second of this process)."""
    from compat_serve.engine.types import EngineRequest, SamplingParams

    sampling = SamplingParams(max_tokens=tokens, temperature=0, stop_at_eos=False)
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    requests = [
        EngineRequest(
            f"{case}-{time.monotonic_ns()}-{row}",
            tuple(loaded.tokenizer.encode(chat.format(text))),
            sampling,
            adapter=adapter,
        )
        for row, (text, adapter) in enumerate(zip(PROMPTS, adapters_of(case), strict=True))
    ]

    async def stream(request: EngineRequest) -> list[tuple[float, float, int]]:
        return [
            (time.perf_counter(), time.process_time(), len(event.token_ids))
            async for event in engine.submit(request)
            if event.token_ids
        ]

    async def together() -> list[list[tuple[float, float, int]]]:
        return list(await asyncio.gather(*(stream(r) for r in requests)))

    timelines = asyncio.run(together())
    first = max((timeline[0] for timeline in timelines), key=lambda point: point[0])
    last = min((timeline[-1] for timeline in timelines), key=lambda point: point[0])
    emitted = sum(n for line in timelines for t, _, n in line if first[0] < t <= last[0])
    return emitted / (last[0] - first[0]), emitted / (last[1] - first[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--dtype", default=None, help="as --dtype (default: the server's)")
    args = parser.parse_args()

    from compat_serve.engine.config import EngineConfig
    from compat_serve.engine.engine import Engine
    from compat_serve.engine.host import EngineHost
    from compat_serve.models.loader import load_model

    loaded = load_model(None, dtype=args.dtype)
    # No prefix cache: every run prefills its prompts and decodes the same way.
    config = EngineConfig(max_num_seqs=STREAMS, prefix_cache=False)
    engine = Engine(loaded, config)
    bare = Engine(load_model(None, dtype=args.dtype), config)
    # One host thread steps both engines, as in the server (serve_models.py); only one of
    # them has work at a time here.
    host = EngineHost()
    bare.start(host)
    with tempfile.TemporaryDirectory() as tmp:
        for i, folder in enumerate(write_adapters(loaded.model, Path(tmp), 4)):
            engine.add_adapter(f"a{i}", folder)
    engine.start(host)
    print(f"model: {loaded.name} ({loaded.dtype}), {STREAMS} streams, {args.tokens} tokens each")
    rates: dict[str, list[float]] = {case: [] for case in CASES}
    cpu_rates: dict[str, list[float]] = {case: [] for case in CASES}
    try:
        decode_rate(engine, loaded, "four", 8)  # warm-up
        decode_rate(bare, loaded, "bare", 8)
        for run in range(args.runs):
            order = CASES if run % 2 == 0 else CASES[::-1]
            for case in order:
                which = bare if case == "bare" else engine
                wall, cpu = decode_rate(which, loaded, case, args.tokens)
                rates[case].append(wall)
                cpu_rates[case].append(cpu)
            print(
                f"run {run + 1}: "
                + ", ".join(f"{c} {rates[c][-1]:.1f} ({cpu_rates[c][-1]:.1f}/cpu-s)" for c in CASES)
            )
    finally:
        engine.shutdown()
        bare.shutdown()
    # Tokens per CPU second of this process: what a shared machine's load disturbs
    # least (other processes' time is not in it); wall-clock tok/s beside it.
    for title, table in (("decode tok/s", rates), ("decode tokens per CPU second", cpu_rates)):
        base = statistics.median(table["none"])
        print(f"\n{title} at {STREAMS} streams (median of {args.runs}, min-max):")
        for case in CASES:
            values = table[case]
            median = statistics.median(values)
            print(
                f"  {case:5s} {median:7.1f}  ({min(values):.1f}-{max(values):.1f})"
                f"  {median / base:.2f}x of none"
            )


if __name__ == "__main__":
    main()
