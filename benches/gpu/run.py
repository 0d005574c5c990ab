"""The GPU kit's benchmark (#35): compat-serve vs mlx-lm on one accelerator, in one run.

Models of real shapes with random weights, built here from mlx-lm's classes: a
Llama-3.1-8B-shaped dense model in 4-bit and bf16, a Qwen3-30B-A3B-shaped MoE in 4-bit;
and the embedded SmolLM2-135M (its GGUF carried in the kit: `--gguf`) for what needs a
model that copies. Tables, most important first:

1. greedy equality (ours vs `mlx_lm.generate`, 32 tokens, tie-aware);
2. decode tok/s at 1/8/32/64 streams, ours vs mlx-lm's BatchGenerator (8B 4-bit);
3. TTFT cold vs warm at 8k and 32k of shared prefix (8B 4-bit);
4. decode at 8 streams after a 4k preamble: KV in the model's dtype vs --kv-bits 8 vs 4;
5. `--speculative ngram` vs off at 1 and 4 streams, copy-heavy vs free text (SmolLM2);
6. decode tok/s for the 8B bf16 and the 30B-A3B MoE 4-bit.

Each table has a share of `--budget-s` (default 400 s; the device call allows 600 s with
the install) and writes `gpu-bench.md` and `gpu-bench.json` to `--out` (default `$OUT`)
after every row. `--smoke` runs the same code on tiny shapes on the CPU in seconds (CI).

Run: `python benches/gpu/run.py [--smoke] [--out DIR] [--gguf FILE] [--budget-s S]`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compat_serve.models.blas import ensure_fast_blas

ensure_fast_blas()  # the CPU smoke: an optimized BLAS before mlx (a no-op where none is)

import mlx.core as mx  # noqa: E402
import sections  # noqa: E402
from report import Budget, Report  # noqa: E402
from shapes import build, random_prompt, shapes  # noqa: E402

from compat_serve.models.device_memory import device_memory  # noqa: E402
from compat_serve.models.loader import load_model  # noqa: E402
from compat_serve.models.types import LoadedModel  # noqa: E402
from compat_serve.models.weights import compute_backend  # noqa: E402

# Shares of the budget, in the order the sections run (what the goals need first).
WEIGHTS = {
    "build dense-4bit": 0.5,
    "greedy dense-4bit": 0.3,
    "decode dense-4bit": 3.0,
    "ttft dense-4bit": 2.5,
    "kv dense-4bit": 2.0,
    "mtp dense-4bit": 1.0,
    "load copier": 0.2,
    "greedy copier": 0.3,
    "spec copier": 2.0,
    "build dense-bf16": 0.4,
    "decode dense-bf16": 1.5,
    "build moe-4bit": 0.6,
    "decode moe-4bit": 2.0,
}


def header(args: argparse.Namespace, plan: sections.Plan) -> dict[str, object]:
    from importlib.metadata import version

    size, source = device_memory()
    manifest = Path(args.kit) / "manifest.json" if args.kit else None
    kit = json.loads(manifest.read_text()) if manifest and manifest.is_file() else {}
    return {
        "date (UTC)": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "mode": "smoke (CPU, tiny shapes)" if args.smoke else "full",
        "compute_backend()": compute_backend(),
        "mx.default_device()": str(mx.default_device()),
        "device_info": dict(mx.device_info()),
        "device_memory()": f"{size / 2**30:.1f} GiB ({source})",
        "mlx": version("mlx"),
        "mlx-lm": version("mlx-lm"),
        "compat-serve kit commit": kit.get("commit", "unknown"),
        "python": sys.version.split()[0],
        "plan": plan.__dict__,
        "budget_s": args.budget_s,
    }


def copier(args: argparse.Namespace, smoke_model: LoadedModel | None) -> LoadedModel:
    """The model that copies: the embedded SmolLM2 (as the server loads it: on CUDA or
    Metal quantized, as stored), or in the smoke the tiny dense model."""
    if smoke_model is not None:
        return smoke_model
    return load_model(args.gguf)


def spec_workloads(loaded: LoadedModel, smoke: bool) -> dict[str, tuple[int, ...]]:
    if smoke:  # ids: a sequence shown twice (copy-heavy) and random ids (free)
        vocab = loaded.tokenizer.vocab_size
        seen = random_prompt(vocab, 12, 77)
        return {"copy-heavy": seen + seen, "free": random_prompt(vocab, 24, 78)}
    from speculative import WORKLOADS, chat

    return {
        "copy: repeat passage": chat(loaded, WORKLOADS["repeat passage"]),
        "copy: add type hints": chat(loaded, WORKLOADS["add type hints"]),
        "free text": chat(loaded, WORKLOADS["free generation"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (CI)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-bench-out")
    parser.add_argument("--gguf", default=None, help="SmolLM2 GGUF (default: the embedded)")
    parser.add_argument("--kit", default=".gpu-kit", help="the kit folder (its manifest)")
    parser.add_argument("--budget-s", type=float, default=None, help="default 400 (smoke 25)")
    parser.add_argument("--only", default="", help="run only sections whose name has this")
    args = parser.parse_args()
    args.budget_s = args.budget_s or (25.0 if args.smoke else 400.0)
    plan = sections.SMOKE if args.smoke else sections.FULL
    weights = {k: v for k, v in WEIGHTS.items() if args.only in k}
    budget = Budget(args.budget_s, weights)
    report = Report(Path(args.out))
    report.header = header(args, plan)
    report.save()
    budget.watchdog(report.save)
    print(json.dumps(report.header, indent=1, default=str), flush=True)
    if not args.smoke and compute_backend() == "cpu":  # 8B shapes on a CPU: never ends
        report.skip("everything: MLX found no GPU (compute_backend() is 'cpu'); see header")
        sys.exit(2)
    models = shapes(args.smoke)
    dense4: LoadedModel | None = None

    def step(name: str, action: object) -> None:
        if name not in budget.weights:
            return
        seconds = budget.start(name)
        print(f"== {name} ({seconds:.0f} s of {budget.left():.0f} s left)", flush=True)
        sections.guarded(report, name, action)  # type: ignore[arg-type]

    def build_dense4() -> None:
        nonlocal dense4
        dense4 = build(models["dense-4bit"])

    step("build dense-4bit", build_dense4)
    if dense4 is not None:
        d4 = dense4
        step("greedy dense-4bit", lambda: sections.greedy(report, budget, d4, plan, 2))
        step("decode dense-4bit", lambda: sections.decode(report, budget, d4, plan))
        step("ttft dense-4bit", lambda: sections.ttft(report, budget, d4, plan))
        step("kv dense-4bit", lambda: sections.kv_bits(report, budget, d4, plan))
        step("mtp dense-4bit", lambda: sections.mtp_cost(report, budget, d4, plan))
        del d4  # the lambdas' cell too: the 8B leaves memory with `dense4` below
    held: dict[str, LoadedModel] = {}

    def load_copier() -> None:
        held["copier"] = copier(args, dense4 if args.smoke else None)

    if not args.smoke:
        dense4 = None  # frees the 8B before the next models
        sections.free_memory()
    step("load copier", load_copier)
    if "copier" in held:
        model = held["copier"]
        if not args.smoke:  # in the smoke the copier is the dense model, already compared
            step("greedy copier", lambda: sections.greedy(report, budget, model, plan, 3))
        workloads = spec_workloads(model, args.smoke)
        step("spec copier", lambda: sections.speculation(report, budget, model, plan, workloads))
        held.clear()
    for key in ("dense-bf16", "moe-4bit"):

        def build_it(key: str = key) -> None:
            held[key] = build(models[key])

        step(f"build {key}", build_it)
        if key in held:
            loaded = held[key]
            step(
                f"decode {key}", lambda loaded=loaded: sections.decode(report, budget, loaded, plan)
            )
            held.clear()
            sections.free_memory()
    report.header["elapsed_s"] = round(budget.elapsed(), 1)
    report.save()
    print(report.markdown(), flush=True)
    print(f"wrote {report.out / 'gpu-bench.md'} and gpu-bench.json", flush=True)


if __name__ == "__main__":
    main()
