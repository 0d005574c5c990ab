"""How big a step plan (engine/step_plan.py) is on the wire, and what encoding and
decoding it costs: the message rank 0 would broadcast each step in distributed mode
(issue #28).

Typical steps of a busy server, with request ids as the server makes them ("msg_" and 24
hex digits) and token ids of a 150k vocabulary:

- `decode-8` / `decode-16`: a decode step of 8 or 16 rows;
- `decode-8+chunk-256` / `decode-8+chunk-512`: 8 rows decoding while one request
  prefills a chunk (256 is the default chunk while others decode, 512 the default one);
- `verify-8x4`: speculative decoding, 8 rows each verifying 4 drafted tokens, and the
  rollback after;
- `join+drop`: 4 requests joining the batch and 4 leaving it.

Prints, per shape, the bytes of `to_bytes()` and the median (and p10-p90) microseconds
of `to_bytes()` and of `from_bytes()` over `--runs` alternating runs. No model needed.

Run: `.venv/bin/python benches/step_plan_size.py [--runs 2000]`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import uuid

from compat_serve.engine.step_plan import (
    Decode,
    Drop,
    Join,
    NewCache,
    PlanOp,
    Prefill,
    Rollback,
    StepPlan,
    Verify,
)

VOCAB = 151_936


def request_ids(n: int) -> tuple[str, ...]:
    return tuple(f"msg_{uuid.uuid4().hex[:24]}" for _ in range(n))


def shapes(rng: random.Random) -> dict[str, StepPlan]:
    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(VOCAB) for _ in range(n))

    rows8, rows16 = request_ids(8), request_ids(16)
    prefilling = request_ids(1)[0]

    def chunk(n: int) -> tuple[PlanOp, ...]:
        return (Decode(rows8, tokens(8)), Prefill(prefilling, 1024, tokens(n), False))

    verify = Verify(rows8, tuple(tokens(5) for _ in rows8))
    rollback = Rollback(tuple(rng.randrange(5) for _ in rows8))
    joining, leaving = request_ids(4), request_ids(4)
    return {
        "decode-8": StepPlan(1000, (Decode(rows8, tokens(8)),)),
        "decode-16": StepPlan(1000, (Decode(rows16, tokens(16)),)),
        "decode-8+chunk-256": StepPlan(1000, chunk(256)),
        "decode-8+chunk-512": StepPlan(1000, chunk(512)),
        "verify-8x4": StepPlan(1000, (verify, rollback)),
        "join+drop": StepPlan(
            1000,
            (*(NewCache(r) for r in joining), Join(joining), Drop(leaving)),
        ),
    }


def timed_us(fn: object, *args: object) -> float:
    started = time.perf_counter()
    fn(*args)  # type: ignore[operator]
    return (time.perf_counter() - started) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    args = parser.parse_args()
    plans = shapes(random.Random(0))
    encoded = {name: plan.to_bytes() for name, plan in plans.items()}
    for name, plan in plans.items():
        assert StepPlan.from_bytes(encoded[name]) == plan
    encode: dict[str, list[float]] = {name: [] for name in plans}
    decode: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(args.runs):  # the shapes alternate within each run
        for name, plan in plans.items():
            encode[name].append(timed_us(plan.to_bytes))
            decode[name].append(timed_us(StepPlan.from_bytes, encoded[name]))
    print(f"{'shape':<22}{'bytes':>7}  {'encode us (p10-p90)':<26}decode us (p10-p90)")
    for name in plans:
        line = f"{name:<22}{len(encoded[name]):>7}  {spread(encode[name])}{spread(decode[name])}"
        print(line.rstrip())


def spread(values: list[float]) -> str:
    deciles = statistics.quantiles(values, n=10)
    return f"{statistics.median(values):.1f} ({deciles[0]:.1f}-{deciles[-1]:.1f})".ljust(26)


if __name__ == "__main__":
    main()
