"""`--speculative mtp` with a trained head vs `off` and `ngram` on copy-free prompts (#45).

Copy-free prompts (held out of benches/train_mtp_head.py's topics), at concurrency 1 and
4, greedy. Engines with each mode run alternately (`--repeats` times, prefix cache off);
decode tok/s = generated tokens / (last token time - first token time) over the
concurrent requests' span. Prints medians with the min-max spread, the speed-up over
`off` and each speculative mode's acceptance (greedy exactness is tests/python/test_mtp.py's).
The load average is printed: the machine may be shared.

Run: `.venv/bin/python benches/mtp_speed.py --head mtp_head.safetensors [--repeats 3]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from compat_serve.models.blas import ensure_fast_blas

ensure_fast_blas()

from compat_serve.engine.config import EngineConfig  # noqa: E402
from compat_serve.engine.engine import Engine  # noqa: E402
from compat_serve.engine.mtp_head import load_head  # noqa: E402
from compat_serve.engine.speculation import SpeculationConfig  # noqa: E402
from compat_serve.models.loader import load_model  # noqa: E402
from speculative import chat, run  # noqa: E402

PROMPTS = {
    "story": "Write a short story about a fox who finds a key in the snow.",
    "explain": "Explain in a few sentences why the sky is blue.",
    "tips": "Give three tips for learning to play the guitar.",
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head", required=True, help="the trained head (safetensors)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1, help="--speculative-tokens for mtp")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--prompts", default=",".join(PROMPTS), help="which of them")
    parser.add_argument("--always-verify", action="store_true", help="verify every draft "
                        "(cost-aware policy off): the raw acceptance and step cost")  # fmt: skip
    args = parser.parse_args()
    loaded = load_model(None)
    head = load_head(args.head, loaded.model)

    def engine(mode: str) -> Engine:
        spec = SpeculationConfig(
            mode,
            num_tokens=args.tokens if mode == "mtp" else 4,
            mtp=head if mode == "mtp" else None,
            cost_aware=not args.always_verify,
        )
        eng = Engine(loaded, EngineConfig(prefix_cache=False, max_num_seqs=8, speculation=spec))
        eng.start()
        return eng

    engines = {mode: engine(mode) for mode in ("off", "ngram", "mtp")}
    print(f"load average before: {os.getloadavg()[0]:.2f} (repeats {args.repeats})")
    line = "{:<8} {:>4} {:>18} {:>18} {:>18} {:>7} {:>7} {:>7} {:>7}"
    print(line.format("prompt", "conc", "off tok/s", "ngram tok/s", "mtp tok/s", "ngram x",
                      "mtp x", "ng acc", "mtp acc"))  # fmt: skip
    try:
        for name in args.prompts.split(","):
            text = PROMPTS[name]
            prompt = chat(loaded, text)
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                rates: dict[str, list[float]] = {mode: [] for mode in engines}
                before = {m: e.speculation_status() for m, e in engines.items() if m != "off"}
                for rep in range(args.repeats):  # alternate: drift hits all alike
                    for mode, eng in engines.items():
                        tag = f"{mode}-{name}-{concurrency}-{rep}"
                        rates[mode].append(run(eng, prompt, concurrency, args.max_tokens, tag))
                acc = {}
                for mode in ("ngram", "mtp"):
                    after = engines[mode].speculation_status()
                    drafted = _delta(before[mode], after, "draft_tokens")
                    accepted = _delta(before[mode], after, "accepted_tokens")
                    acc[mode] = f"{accepted / drafted:.0%}" if drafted else "-"
                cells = [
                    f"{statistics.median(r):6.1f} [{min(r):5.1f}-{max(r):5.1f}]"
                    for r in rates.values()
                ]
                off = statistics.median(rates["off"])
                print(
                    line.format(
                        name,
                        concurrency,
                        *cells,
                        f"{statistics.median(rates['ngram']) / off:.2f}x",
                        f"{statistics.median(rates['mtp']) / off:.2f}x",
                        acc["ngram"],
                        acc["mtp"],
                    ),
                    flush=True,
                )
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        print("mtp step costs (ms):", engines["mtp"].speculation_status()["step_costs_ms"])
    finally:
        for eng in engines.values():
            eng.shutdown()


def _delta(before: dict[str, Any], after: dict[str, Any], key: str) -> int:
    return int(after.get(key) or 0) - int(before.get(key) or 0)


if __name__ == "__main__":
    main()
