"""Single-model load time of the embedded model (`load_model(None)`, the path `--model`
and the default take), for two builds side by side: each `--python` interpreter (a
checkout's `.venv/bin/python`) loads the model twice in a fresh process and the second
load is timed (the first pays the imports). Rounds alternate between the builds;
medians of 5 with their spread. `--stepped` also times, in this build, the embedded
model's load as a server of several models runs it when nothing else is stepping (its
MLX slices back to back on an `EngineHost` thread, the engine's start-up included)
against `build_state` on the calling thread, alternating.

    python benches/load_speed.py --python /work/main/.venv/bin/python --python .venv/bin/python
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

SCRIPT = """
import time
from compat_serve.models.loader import load_model
load_model(None)
started = time.perf_counter()
loaded = load_model(None)
print(time.perf_counter() - started, loaded.extra["load_seconds"]["weights"])
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--python", action="append", help="an interpreter (repeatable)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stepped", action="store_true", help="hosted vs inline, this build")
    args = parser.parse_args()
    if args.stepped:
        stepped_vs_inline(args.rounds)
    pythons: list[str] = [os.path.abspath(p) for p in args.python or [sys.executable]]
    seconds: dict[str, list[float]] = {p: [] for p in pythons}
    weights: dict[str, list[float]] = {p: [] for p in pythons}
    for _ in range(args.rounds):
        for python in pythons:
            out = subprocess.run(
                [python, "-c", SCRIPT], capture_output=True, text=True, check=True, cwd="/"
            ).stdout.split()
            seconds[python].append(float(out[-2]))
            weights[python].append(float(out[-1]))
    for python in pythons:
        total, part = seconds[python], weights[python]
        print(
            f"{python}: load_model(None) median {statistics.median(total):.3f} s "
            f"(min {min(total):.3f}, max {max(total):.3f}); of it the weights "
            f"{statistics.median(part):.3f} s (min {min(part):.3f}, max {max(part):.3f})"
        )


def stepped_vs_inline(rounds: int) -> None:
    import asyncio
    import time

    from compat_serve.bootstrap import ServeOptions, build_state
    from compat_serve.engine.host import EngineHost
    from compat_serve.serve_models import load_state_steps

    options = ServeOptions(kv_memory="64MB", cache_memory="64MB")
    host = EngineHost()
    build_state(options).engine.shutdown()  # imports and first-use costs
    times: dict[str, list[float]] = {"inline": [], "stepped": []}
    for _ in range(rounds):
        started = time.perf_counter()
        build_state(options).engine.shutdown()
        times["inline"].append(time.perf_counter() - started)
        started = time.perf_counter()
        asyncio.run(host.run_steps(load_state_steps(options))).engine.shutdown()
        times["stepped"].append(time.perf_counter() - started)
    for name, values in times.items():
        print(
            f"{name} load of the embedded model with its engine: median "
            f"{statistics.median(values):.3f} s (min {min(values):.3f}, max {max(values):.3f})"
        )
    slices = sorted(host.slice_times, key=lambda item: -item[1])
    print(
        f"{len(host.slice_times) // rounds} host slices per load; the longest: "
        + ", ".join(f"{label} {seconds:.3f} s" for label, seconds in slices[:4])
    )


if __name__ == "__main__":
    main()
