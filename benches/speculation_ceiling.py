"""The most any drafter can gain on this machine: an oracle that drafts for free (#45).

Each prompt's greedy reply is recorded from a plain engine first. The oracle then drafts
the reply's next tokens, right with probability `p` per token (a wrong token otherwise,
chosen by a seeded hash so every run draws the same), and costs nothing to draft, so it
bounds what any real drafter (ngram, a draft model, an MTP head that pays for its layer)
can reach at that acceptance. The engine verifies every draft (cost-aware policy off), as
in `benches/mtp_speed.py --always-verify`. Engines run alternately, `--repeats` rounds,
prefix cache off, greedy; decode tok/s as in benches/speculative.py. Prints medians with
the min-max spread, the speed-up over `off`, the measured acceptance and the engine's
measured step costs.

Run: `.venv/bin/python benches/speculation_ceiling.py [--repeats 3] [--points 1:1.0,1:0.7]`
(each point is depth:p).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics

from compat_serve.models.blas import ensure_fast_blas

ensure_fast_blas()

from compat_serve.engine.config import EngineConfig  # noqa: E402
from compat_serve.engine.engine import Engine  # noqa: E402
from compat_serve.engine.speculation import SpeculationConfig  # noqa: E402
from compat_serve.engine.types import EngineRequest, SamplingParams  # noqa: E402
from compat_serve.models.loader import load_model  # noqa: E402
from mtp_speed import PROMPTS, _delta  # noqa: E402
from speculative import chat, run  # noqa: E402


class OracleDrafter:
    """Drafts the recorded greedy continuation of a known prompt, each token right with
    probability `p`; the first wrong token ends what the engine can accept anyway."""

    def __init__(self, replies: dict[tuple[int, ...], list[int]], p: float) -> None:
        self._replies = replies
        self._p = p

    def propose(self, key: str, tokens: list[int], k: int) -> list[int]:
        for prompt, reply in self._replies.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                draft = list(reply[done : done + k])
                for j, token in enumerate(draft):
                    if not self._right(prompt, done + j):
                        draft[j] = token + 1  # any other id is rejected by greedy
                        return draft[: j + 1]
                return draft
        return []

    def _right(self, prompt: tuple[int, ...], position: int) -> bool:
        digest = hashlib.sha256(f"{len(prompt)}:{prompt[-8:]}:{position}".encode()).digest()
        return int.from_bytes(digest[:4], "little") / 2**32 < self._p

    def forget(self, key: str) -> None:
        pass


def record(engine: Engine, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    async def go() -> list[int]:
        stream = engine.submit(
            EngineRequest("record", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
        )
        ids: list[int] = []
        async for out in stream:
            ids.extend(out.token_ids)
        return ids

    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1")
    parser.add_argument("--prompts", default=",".join(PROMPTS))
    parser.add_argument("--points", default="1:1.0,1:0.7,1:0.5,2:1.0", help="depth:p, ...")
    args = parser.parse_args()
    loaded = load_model(None)

    def engine(mode: str, depth: int = 1) -> Engine:
        spec = SpeculationConfig(mode, num_tokens=depth, cost_aware=False)
        eng = Engine(loaded, EngineConfig(prefix_cache=False, max_num_seqs=8, speculation=spec))
        eng.start()
        return eng

    plain = engine("off")
    prompts = {name: chat(loaded, PROMPTS[name]) for name in args.prompts.split(",")}
    # More tokens than asked: the oracle must know the tokens after the last one kept.
    replies = {p: record(plain, p, args.max_tokens + 8) for p in prompts.values()}
    engines: dict[str, Engine] = {"off": plain}
    for point in args.points.split(","):
        depth, p = point.split(":")
        eng = engine("ngram", int(depth))
        eng._executor.spec._drafter = OracleDrafter(replies, float(p))
        engines[f"k{depth} p{p}"] = eng
    print(f"load average before: {os.getloadavg()[0]:.2f} (repeats {args.repeats})")
    try:
        for name, prompt in prompts.items():
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                rates: dict[str, list[float]] = {label: [] for label in engines}
                before = {k: e.speculation_status() for k, e in engines.items() if k != "off"}
                for rep in range(args.repeats):
                    for label, eng in engines.items():
                        tag = f"{label}-{name}-{concurrency}-{rep}"
                        rates[label].append(run(eng, prompt, concurrency, args.max_tokens, tag))
                off = statistics.median(rates["off"])
                print(f"{name} c={concurrency}: off {_cell(rates['off'])} tok/s")
                for label, eng in engines.items():
                    if label == "off":
                        continue
                    after = eng.speculation_status()
                    drafted = _delta(before[label], after, "draft_tokens")
                    accepted = _delta(before[label], after, "accepted_tokens")
                    print(
                        f"  {label:<10} {_cell(rates[label])} tok/s "
                        f"{statistics.median(rates[label]) / off:.2f}x  accepted "
                        f"{accepted / drafted if drafted else 0:.0%}",
                        flush=True,
                    )
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        for label, eng in engines.items():
            if label != "off":
                print(f"step costs (ms) {label}:", eng.speculation_status()["step_costs_ms"])
    finally:
        for eng in engines.values():
            eng.shutdown()


def _cell(rates: list[float]) -> str:
    return f"{statistics.median(rates):6.1f} [{min(rates):5.1f}-{max(rates):5.1f}]"


if __name__ == "__main__":
    main()
