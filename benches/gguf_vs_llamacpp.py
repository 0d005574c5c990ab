"""compat-serve against llama.cpp on the real Gemma 3 270M Q4_K_M file (#43), both `--dtype`
loads (default: dequantized on the CPU; `quantized`: the users' path).

Each side runs in its own subprocess (so RSS is that side's alone): llama.cpp through
`xllamacpp` (2 threads, greedy, n_probs 10), compat-serve's engine on each load. Reported:
load time (wall, from nothing to a ready model), peak RSS of the process, the top-1
agreement rate teacher-forced on llama.cpp's greedy continuation (N tokens x 10 prompts, every
position counts), the mean |Δ logprob| of llama.cpp's top token there, and compat-serve's own
greedy run's departures from llama.cpp with llama.cpp's top-two margin at each (a near tie
when under tests/llamacpp's LLAMACPP_TIE).

Goals (issue #43): agreement up to ties on every prompt on the default load; RSS on
`--dtype quantized` at most llama.cpp's x 1.3.

    .venv/bin/python benches/gguf_vs_llamacpp.py [--tokens 32] [--prompts 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Die drei größten Städte Deutschlands sind",
    "1, 1, 2, 3, 5, 8, 13,",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "東京は日本の",
    "import numpy as np\n\nx = np.",
    "Water boils at a temperature of",
    "La tour Eiffel a été construite en",
]


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_llamacpp(path: Path, prompts: list[list[int]], n: int) -> dict[str, Any]:
    from tests.llamacpp.reference import LlamaCpp

    start = time.perf_counter()
    reference = LlamaCpp(path)
    load = time.perf_counter() - start
    out = []
    for ids in prompts:
        g = reference.greedy(ids, n)
        top = [max(t.items(), key=lambda kv: kv[1]) for t in g.top]
        out.append({"ids": g.ids, "top": g.top, "best": top})
    rss = rss_mib()
    reference.close()
    return {"load_s": load, "rss_mib": rss, "runs": out}


def teacher_forced(loaded: Any, prompt: list[int], reference: list[int]) -> list[dict[str, Any]]:
    """compat-serve's model on llama.cpp's own continuation (one forward pass): at each
    position its top-1 id and its log-probabilities by token id."""
    import mlx.core as mx

    sequence = [*prompt, *reference]
    logits = loaded.model(mx.array([sequence]))[0, len(prompt) - 1 : len(sequence) - 1]
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logprobs)
    return [{"top1": int(mx.argmax(row).item()), "row": row} for row in logprobs]


def run_compat(
    path: Path, dtype: str, prompts: list[list[int]], n: int, reference: list[list[int]]
) -> dict[str, Any]:
    from compat_serve.models.blas import ensure_fast_blas

    ensure_fast_blas()
    from compat_serve.engine.config import EngineConfig
    from compat_serve.engine.engine import Engine
    from compat_serve.engine.types import EngineRequest, SamplingParams
    from compat_serve.models.loader import load_model
    from compat_serve.server.openai.logprobs import token_texts

    start = time.perf_counter()
    loaded = load_model(str(path), dtype=dtype)
    load = time.perf_counter() - start
    engine = Engine(loaded, EngineConfig(prefix_cache=False))
    engine.start()
    texts = token_texts(loaded.tokenizer, engine.logits_width)
    out = []
    try:
        for k, ids in enumerate(prompts):
            sampling = SamplingParams(max_tokens=n, temperature=0, logprobs=20, stop_at_eos=False)
            request = EngineRequest(f"bench{k}", tuple(ids), sampling)

            async def go(r: EngineRequest = request) -> list[Any]:
                return [e async for e in engine.submit(r)]

            events = asyncio.run(go())
            lps = [lp for e in events for lp in e.logprobs]
            forced = teacher_forced(loaded, ids, reference[k])
            out.append(
                {
                    "ids": [lp.token_id for lp in lps],
                    "top": [{texts.token(t)[0]: v for t, v in lp.top} for lp in lps],
                    "forced_top1": [f["top1"] for f in forced],
                    "forced_ref_logprob": [
                        float(f["row"][t].item()) for f, t in zip(forced, reference[k], strict=True)
                    ],
                }
            )
    finally:
        engine.shutdown()
    return {"load_s": load, "rss_mib": rss_mib(), "runs": out}


def child(args: argparse.Namespace) -> None:
    given = json.loads(Path(args.prompts_file).read_text())
    path = Path(args.model)
    if args.side == "llamacpp":
        result = run_llamacpp(path, given["prompts"], args.tokens)
    else:
        result = run_compat(path, args.side, given["prompts"], args.tokens, given["reference"])
    print("RESULT " + json.dumps(result))


def spawn(side: str, args: argparse.Namespace, model: Path, prompts_file: Path) -> dict[str, Any]:
    command = [sys.executable, __file__, "--side", side, "--model", str(model)]
    command += ["--prompts-file", str(prompts_file), "--tokens", str(args.tokens)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"{side} failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def compare(reference: dict[str, Any], candidate: dict[str, Any], tie: float) -> dict[str, Any]:
    """Agreement and |Δ logprob| teacher-forced on llama.cpp's continuation (every position
    counts); departures of compat-serve's own greedy run, each with llama.cpp's margin."""
    agreed = total = 0
    deltas: list[float] = []
    departures = []
    all_ties = True
    for k, (ref, cand) in enumerate(zip(reference["runs"], candidate["runs"], strict=True)):
        for i, token in enumerate(ref["ids"]):
            total += 1
            agreed += cand["forced_top1"][i] == token
            deltas.append(abs(cand["forced_ref_logprob"][i] - ref["best"][i][1]))
        for i, (a, b) in enumerate(zip(ref["ids"], cand["ids"], strict=False)):
            if a != b:
                scores = sorted(ref["top"][i].values(), reverse=True)
                margin = scores[0] - scores[1]
                all_ties &= margin < tie
                departures.append({"prompt": k, "position": i, "llamacpp_margin": round(margin, 4)})
                break
    return {
        "top1_agreement": agreed / max(total, 1),
        "departures": departures,
        "every_departure_a_tie": all_ties,
        "mean_abs_dlogprob": sum(deltas) / max(len(deltas), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--model", help="a GGUF (default: the Gemma file of tests/llamacpp)")
    parser.add_argument("--prompts-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        child(args)
        return
    from tests.llamacpp.reference import LlamaCpp, gemma_gguf
    from tests.llamacpp.test_gemma_vs_llamacpp import LLAMACPP_TIE

    model = Path(args.model) if args.model else gemma_gguf()
    # The prompts' ids from llama.cpp's own tokenizer (with the file's BOS), so both sides
    # see the same ids whatever compat-serve's tokenizer does.
    tokenizer = LlamaCpp(model, n_ctx=256, threads=1)
    prompts = [tokenizer.tokenize(p) for p in PROMPTS[: args.prompts]]
    tokenizer.close()
    prompts_file = ROOT / ".test-cache" / "gguf_vs_llamacpp_prompts.json"
    prompts_file.write_text(json.dumps({"prompts": prompts}))
    print(f"{model.name}: {len(prompts)} prompts x {args.tokens} greedy tokens")
    reference = spawn("llamacpp", args, model, prompts_file)
    given = {"prompts": prompts, "reference": [r["ids"] for r in reference["runs"]]}
    prompts_file.write_text(json.dumps(given))
    print(f"llama.cpp       load {reference['load_s']:6.2f} s  RSS {reference['rss_mib']:7.0f} MiB")
    for dtype in ("auto", "quantized"):
        result = spawn(dtype, args, model, prompts_file)
        c = compare(reference, result, LLAMACPP_TIE)
        ratio = result["rss_mib"] / reference["rss_mib"]
        print(
            f"compat {dtype:9s} load {result['load_s']:6.2f} s  RSS {result['rss_mib']:7.0f} MiB "
            f"(x{ratio:.2f} llama.cpp)  top-1 agreement {c['top1_agreement']:.3f}  "
            f"mean |dlogprob| {c['mean_abs_dlogprob']:.4f}  departures {c['departures']}  "
            f"all near ties: {c['every_departure_a_tie']}"
        )


if __name__ == "__main__":
    main()
