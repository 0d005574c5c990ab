"""Fuzz the OpenAPI document on many seeds: does the server agree with it on any seed?

CI fuzzes two seeds (tests/http/test_openapi_schemathesis.py). This runs the same test,
the same server (the tiny llama, the embedded model's tokenizer and template, output
capped at 4 tokens), every schemathesis check, and the same one exemption (a positive
case refused with the exact message of a rule the document states in words skips
`positive_data_acceptance` only), on seeds 1-20 with 30 examples per operation. It prints
one row per seed (operations fuzzed, failures, the failing operations with their first
failing check) and the total failures.

Run: `.venv/bin/python benches/schemathesis_seeds.py [--seeds 1-20] [--examples 30]`
(tens of minutes on a 2-core machine: run it in the background).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

_SEEDS_ENV, _EXAMPLES_ENV = "SCHEMATHESIS_SEEDS", "SCHEMATHESIS_EXAMPLES"
# A failing check as schemathesis prints it ("- ST202 Schema-valid request rejected").
_CHECK = re.compile(r"- (ST\d+ [^\n]+)")
_NODE = re.compile(r"::test_seed_(\d+)$")


def parse_seeds(text: str) -> list[int]:
    """'1-20' or '1,5,7' (or both: '1-3,7') -> seeds."""
    seeds: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        seeds += list(range(int(first), int(last or first) + 1))
    return seeds


# Under pytest (started by `main` below): one test per seed, each parametrized by operation.
# Imported only there: pytest must see hypothesis and schemathesis imported first.
if _SEEDS_ENV in os.environ:
    # The fixtures the fuzz test needs, imported so pytest finds them in this module.
    from tests.http.test_openapi_schemathesis import (
        _fuzz,
        _node_id_for_schemathesis,
        api_schema,
        fuzzed_server,
    )

    __all__ = ["_node_id_for_schemathesis", "api_schema", "fuzzed_server"]
    _examples = int(os.environ.get(_EXAMPLES_ENV, "30"))
    for _seed in parse_seeds(os.environ[_SEEDS_ENV]):
        globals()[f"test_seed_{_seed:02d}"] = _fuzz(_seed, coverage=False, examples=_examples)


class _Tally:
    """Outcomes per seed, read from pytest's reports."""

    def __init__(self) -> None:
        self.operations: dict[int, int] = {}
        self.failures: dict[int, list[str]] = {}
        self.seconds: dict[int, float] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        match = _NODE.search(report.nodeid)
        if match is None:
            return
        seed = int(match.group(1))
        context = getattr(report, "context", None)  # a subtest: one operation
        if context is None:
            self.seconds[seed] = self.seconds.get(seed, 0.0) + float(report.duration)
            if report.failed and report.when != "call":  # setup or teardown
                self.failures.setdefault(seed, []).append(f"{report.when} failed")
            return
        operation = str(context.msg or context.kwargs.get("label", context.kwargs)).strip("'")
        self.operations[seed] = self.operations.get(seed, 0) + 1
        if report.failed:
            checks = _CHECK.findall(str(report.longreprtext)) or ["failed"]
            self.failures.setdefault(seed, []).append(f"{operation}: {checks[0]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1-20")
    parser.add_argument("--examples", type=int, default=30)
    args = parser.parse_args()
    seeds = parse_seeds(args.seeds)
    os.environ[_SEEDS_ENV] = ",".join(map(str, seeds))
    os.environ[_EXAMPLES_ENV] = str(args.examples)
    tally = _Tally()
    started = time.monotonic()
    pytest.main(
        [
            str(Path(__file__).resolve()),
            f"--rootdir={ROOT}",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            "-q",
            "--no-header",
            "-rN",
            "--tb=short",
        ],
        plugins=[tally],
    )
    print(f"\nschemathesis, every check, {args.examples} examples per operation\n")
    print(f"{'seed':>4}  {'operations':>10}  {'failures':>8}  {'seconds':>7}  failing")
    for seed in seeds:
        failed = tally.failures.get(seed, [])
        print(
            f"{seed:>4}  {tally.operations.get(seed, 0):>10}  {len(failed):>8}  "
            f"{tally.seconds.get(seed, 0.0):>7.0f}  {'; '.join(failed)}"
        )
    total = sum(len(f) for f in tally.failures.values())
    ran = sum(tally.operations.values())
    print(f"\ntotal failures: {total} ({ran} operation runs, {time.monotonic() - started:.0f} s)")
    return 1 if total or ran == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
