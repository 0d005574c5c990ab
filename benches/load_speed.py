"""Single-model load time of the embedded model (`load_model(None)`, the path `--model`
and the default take), for two builds side by side: each `--python` interpreter (a
checkout's `.venv/bin/python`) loads the model twice in a fresh process and the second
load is timed (the first pays the imports). Rounds alternate between the builds;
medians of 5 with their spread.

    python benches/load_speed.py --python /work/main/.venv/bin/python --python .venv/bin/python
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()
    pythons: list[str] = args.python or [sys.executable]
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


if __name__ == "__main__":
    main()
