"""Speculative decoding (`--speculative ngram`) vs plain decoding on the embedded model.

Workloads: copy-heavy agent work (repeat a passage; rewrite a code file adding type
hints) and free generation, at concurrency 1 and 4. For each, engines with and without
speculation run alternately (`--repeats` times each, same greedy requests, prefix cache
off so every run prefills the same); decode tok/s = generated tokens / (last token time -
first token time), summed over the concurrent requests' span. Reports medians with the
min-max spread, the speed-up, the drafts' acceptance, the tokens each verified row
emitted (`tok/row`), and the cost of a verify step against a plain step as the engine
measured it (`verify/plain`, the widest verify shape it ran at that batch size) — with
`gpu est`, the speed-up where a verify step costs about one plain step (a GPU reading
the weights once either way): tokens per verified row, as every step would verify. The
load average is printed before and after: the machine may be shared.

Run: `make bench-python` or `.venv/bin/python benches/speculative.py [--repeats N]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

from compat_serve.models.blas import ensure_fast_blas

ensure_fast_blas()

from compat_serve.engine.config import EngineConfig  # noqa: E402
from compat_serve.engine.engine import Engine  # noqa: E402
from compat_serve.engine.speculation import SpeculationConfig  # noqa: E402
from compat_serve.engine.types import EngineRequest, SamplingParams  # noqa: E402
from compat_serve.models.loader import load_model  # noqa: E402

PASSAGE = (
    "The committee met on Tuesday to review the proposal for the new library. After a long "
    "discussion about the budget, the schedule and the design of the reading rooms, the "
    "members agreed to ask the architects for a revised plan by the end of the month."
)
CODE = """def load(path):
    with open(path) as handle:
        return [line.strip() for line in handle if line.strip()]


def count_words(lines):
    counts = {}
    for line in lines:
        for word in line.split():
            counts[word] = counts.get(word, 0) + 1
    return counts


def top(counts, n):
    return sorted(counts.items(), key=lambda item: item[1], reverse=True)[:n]
"""
WORKLOADS = {
    "repeat passage": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    "add type hints": f"Rewrite this Python file adding type hints. Output only the code.\n\n"
    f"```python\n{CODE}```",
    "free generation": "Write a short story about a lighthouse keeper and a storm.",
}


def chat(loaded: Any, text: str) -> tuple[int, ...]:
    prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return tuple(loaded.tokenizer.encode(prompt))


async def timed(engine: Engine, request: EngineRequest) -> tuple[int, float, float]:
    first = last = 0.0
    count = 0
    async for event in engine.submit(request):
        if event.token_ids:
            now = time.perf_counter()
            first = first or now
            last = now
            count += len(event.token_ids)
    return count, first, last


def run(
    engine: Engine, prompt: tuple[int, ...], concurrency: int, max_tokens: int, tag: str
) -> float:
    async def all_of() -> list[tuple[int, float, float]]:
        reqs = [
            EngineRequest(
                f"{tag}-{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0)
            )
            for i in range(concurrency)
        ]
        return list(await asyncio.gather(*(timed(engine, r) for r in reqs)))

    results = asyncio.run(all_of())
    tokens = sum(count - 1 for count, _, _ in results)
    span = max(last for _, _, last in results) - min(first for _, first, _ in results)
    return tokens / span if span > 0 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument(
        "--speculative-tokens", type=lambda t: t if t == "auto" else int(t), default=4
    )
    parser.add_argument("--only", default="", help="run the workloads whose name has this")
    parser.add_argument("--concurrency", default="1,4", help="comma-separated (1,4)")
    args = parser.parse_args()
    loaded = load_model(None)

    def engine(mode: str) -> Engine:
        spec = SpeculationConfig(mode, num_tokens=args.speculative_tokens)
        eng = Engine(loaded, EngineConfig(prefix_cache=False, max_num_seqs=8, speculation=spec))
        eng.start()
        return eng

    plain, spec = engine("off"), engine("ngram")
    print(f"load average before: {os.getloadavg()[0]:.2f} (repeats {args.repeats})")
    header = (
        "workload", "conc", "plain tok/s", "ngram tok/s", "speed-up", "accept", "tok/row",
        "verify/plain", "gpu est",
    )  # fmt: skip
    line = "{:<16} {:>4} {:>18} {:>18} {:>8} {:>7} {:>7} {:>12} {:>7}"
    print(line.format(*header))
    try:
        for name, text in WORKLOADS.items():
            if args.only not in name:
                continue
            prompt = chat(loaded, text)
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                rates: dict[str, list[float]] = {"off": [], "ngram": []}
                before = spec.speculation_status()
                for rep in range(args.repeats):  # alternate: drift hits both alike
                    for mode, eng in (("off", plain), ("ngram", spec)):
                        tag = f"{mode}-{name[:4]}-{concurrency}-{rep}"
                        rates[mode].append(run(eng, prompt, concurrency, args.max_tokens, tag))
                after = spec.speculation_status()
                drafted = _delta(before, after, "draft_tokens")
                accepted = _delta(before, after, "accepted_tokens")
                rows = _delta(before, after, "verified_rows")
                emitted = _delta(before, after, "emitted_tokens")
                per_row = emitted / rows if rows else 1.0
                cells = []
                for mode in ("off", "ngram"):
                    r = rates[mode]
                    cells.append(f"{statistics.median(r):6.1f} [{min(r):5.1f}-{max(r):5.1f}]")
                ratio = statistics.median(rates["ngram"]) / statistics.median(rates["off"])
                acc = f"{accepted / drafted:.0%}" if drafted else "-"
                row = (
                    name, concurrency, *cells, f"{ratio:.2f}x", acc, f"{per_row:.2f}",
                    _cost_ratio(after, concurrency), f"{per_row:.2f}x",
                )  # fmt: skip
                print(line.format(*row), flush=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        final = spec.speculation_status()
        print("measured step costs (ms, rows x positions):", final["step_costs_ms"])
        print("draft depth:", final["draft_depth"])
        print(
            "acceptance by position:",
            [(p["position"], p["acceptance_rate"], p["draft_tokens"]) for p in final["positions"]],
        )
    finally:
        plain.shutdown()
        spec.shutdown()


def _delta(before: dict[str, Any], after: dict[str, Any], key: str) -> int:
    return int(after.get(key) or 0) - int(before.get(key) or 0)


def _cost_ratio(status: dict[str, Any], rows: int) -> str:
    """The engine's measured cost of its widest verify shape at `rows` rows over a plain
    step at as many rows."""
    costs: dict[str, float] = status["step_costs_ms"]
    plain = costs.get(f"{rows}x1")
    widths = [int(k.split("x")[1]) for k in costs if k.startswith(f"{rows}x")]
    widest = max(widths, default=1)
    if plain is None or widest == 1:
        return "-"
    return f"{costs[f'{rows}x{widest}'] / plain:.2f} (w{widest})"


if __name__ == "__main__":
    main()
