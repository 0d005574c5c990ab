"""How far apart two numeric paths' logits are: the numbers behind the tolerances of
tests/greedy_ties.py.

For each pair (candidate path, reference path) on short chat prompts, the candidate
decodes greedy with `logprobs=20` through the engine (one prompt at a time, or all at once
so rows are batched and left-padded); the reference reads the candidate's own tokens
(teacher forcing) through mlx-lm's caches and gives log-probabilities at every position.
Printed per pair: the largest |difference| of the top-20 log-probabilities; the largest
change of the reference's top-two margin as the candidate sees it (what flips a greedy
token: a tolerance must exceed it); the smallest top-two margin of the reference on the
way; and where the candidate's token is not the reference's best (position, the
reference's margin there, how far below its best the candidate's token is).

Pairs, on the embedded model (float32 weights on the CPU):
- f32 KV, engine alone (one request) vs the model alone;
- f32 KV, engine batched (8 requests) vs the model alone;
- f32 KV with the Rust kernels vs without them (the model loaded a second time with
  `kernel_available` false: another CPU's float order);
- 8-bit and 4-bit KV (group 64), engine alone, batched, and batched without the kernels,
  vs mlx-lm's `QuantizedKVCache` filled as greedy decoding fills it;
the users' path (`dtype="quantized"`: the GGUF's weights kept quantized), alone and
batched vs the model alone; and f32 KV on the tiny random llama (tests/tiny_models.py),
batched vs alone.

Run: `.venv/bin/python benches/greedy_tie_tolerances.py [--tokens 32]
[--only f32|quantized|users|tiny] [--bits 8 4]` (about 15 minutes in all on 2 shared cores).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from compat_serve.models.blas import ensure_fast_blas

ensure_fast_blas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.chat_prompts import chat_ids  # noqa: E402
from tests.python.test_batching import PROMPTS  # noqa: E402
from tests.tiny_models import tiny_model  # noqa: E402

from compat_serve.engine.config import EngineConfig  # noqa: E402
from compat_serve.engine.engine import Engine  # noqa: E402
from compat_serve.engine.kv_quant import KVFormat  # noqa: E402
from compat_serve.engine.types import EngineRequest, SamplingParams  # noqa: E402
from compat_serve.models.loader import load_model  # noqa: E402
from compat_serve.models.types import LoadedModel  # noqa: E402

TOP = 20


def engine_runs(
    loaded: LoadedModel, prompts: list[tuple[int, ...]], tokens: int, kv: KVFormat, together: bool
) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Greedy tokens and their top-20 log-probabilities, all prompts at once or one by one."""
    engine = Engine(loaded, EngineConfig(prefix_cache=False, kv_format=kv))
    engine.start()
    counter = iter(range(10**6))

    async def one(prompt: tuple[int, ...]) -> tuple[list[int], list[dict[int, float]]]:
        sampling = SamplingParams(max_tokens=tokens, temperature=0, logprobs=TOP, stop_at_eos=False)
        events = [
            e async for e in engine.submit(EngineRequest(f"m{next(counter)}", prompt, sampling))
        ]
        ids = [t for e in events for t in e.token_ids]
        return ids, [dict(lp.top) for e in events for lp in e.logprobs]

    async def go() -> list[tuple[list[int], list[dict[int, float]]]]:
        if together:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        return [await one(p) for p in prompts]

    try:
        return asyncio.run(go())
    finally:
        engine.shutdown()


def reference_logprobs(
    loaded: LoadedModel, prompt: tuple[int, ...], tokens: list[int], kv: KVFormat
) -> np.ndarray:
    """Log-probabilities after the prompt and each of `tokens`, one sequence, mlx-lm's own
    caches: float32 KV in one forward pass; quantized KV as `mlx_lm_greedy` runs it (the
    prompt, then one token at a time). A quantized cache read in one pass of many tokens
    gives other logits, by up to ~0.3 here: the shape of the quantized products matters."""
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    model: Any = loaded.model

    def log_softmax(logits: mx.array) -> np.ndarray:
        logits = logits.astype(mx.float32)
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    if kv.bits is None:
        cache = make_prompt_cache(model)
        return log_softmax(model(mx.array([[*prompt, *tokens]]), cache=cache)[0])[len(prompt) - 1 :]
    cache = [QuantizedKVCache(kv.group_size, kv.bits) for _ in model.layers]
    rows = [model(mx.array([prompt]), cache=cache)[0, -1]]
    for token in tokens[:-1]:
        rows.append(model(mx.array([[token]]), cache=cache)[0, -1])
    return log_softmax(mx.stack(rows))


def compare(
    name: str,
    candidate: LoadedModel,
    reference: LoadedModel,
    prompts: list[tuple[int, ...]],
    tokens: int,
    kv: KVFormat,
    together: bool,
) -> None:
    worst, shift, smallest_margin, departures = 0.0, 0.0, float("inf"), []
    for prompt, (ids, tops) in zip(
        prompts, engine_runs(candidate, prompts, tokens, kv, together), strict=True
    ):
        ref = reference_logprobs(reference, prompt, ids, kv)
        for i, (token, top) in enumerate(zip(ids, tops, strict=True)):
            row = ref[i]
            worst = max(worst, *(abs(row[t] - s) for t, s in top.items()))
            second, best = (int(t) for t in np.argsort(row)[-2:])
            margin = float(row[best] - row[second])
            if best in top and second in top:  # how far the candidate moves that margin
                shift = max(shift, abs(margin - (top[best] - top[second])))
            smallest_margin = min(smallest_margin, margin)
            if int(np.argmax(row)) != token:
                departures.append((i, round(margin, 6), round(float(row.max() - row[token]), 6)))
                break  # the rest is another text
    print(
        f"{name:<44} max|dlogprob| {worst:9.2e}  max margin shift {shift:9.2e}  "
        f"min ref margin {smallest_margin:9.2e}  "
        f"departures (pos, ref margin, cand gap) {departures}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--only", choices=["f32", "quantized", "tiny", "users"], default=None)
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4], choices=[8, 4])
    args = parser.parse_args()
    n = args.tokens
    from compat_serve.models import cpu_linear

    kernels = load_model(None)
    prompts = [tuple(chat_ids(kernels, text)) for text in PROMPTS]
    real = cpu_linear.kernel_available
    cpu_linear.kernel_available = lambda: False
    plain = load_model(None)
    cpu_linear.kernel_available = real
    layouts = [m.extra.get("weight_layout") for m in (kernels, plain)]
    print(f"weight layouts: with kernels {layouts[0]}; without {layouts[1]}")
    f32 = KVFormat()
    if args.only in (None, "f32"):
        compare("f32 KV, alone vs model alone", kernels, kernels, prompts, n, f32, False)
        compare("f32 KV, batched vs model alone", kernels, kernels, prompts, n, f32, True)
        compare("f32 KV, batched, kernels vs no kernels", kernels, plain, prompts, n, f32, True)
        compare("f32 KV, batched, no kernels vs no kernels", plain, plain, prompts, n, f32, True)
    if args.only in (None, "quantized"):
        for bits in args.bits:
            kv = KVFormat(bits, 64)
            for together, how in ((False, "alone"), (True, "batched")):
                name = f"{bits}-bit KV, {how} vs QuantizedKVCache"
                compare(name, kernels, kernels, prompts, n, kv, together)
            name = f"{bits}-bit KV, batched, no kernels vs QuantizedKVCache"
            compare(name, plain, kernels, prompts, n, kv, True)
    if args.only in (None, "users"):
        # The users' path (--dtype quantized): Q4_1/Q8_0 weights kept quantized, stock
        # mlx-lm modules, float32 KV; MLX's quantized products in another shape per batch.
        users = load_model(None, dtype="quantized")
        compare("quantized weights, alone vs model alone", users, users, prompts, n, f32, False)
        compare("quantized weights, batched vs model alone", users, users, prompts, n, f32, True)
    if args.only in (None, "tiny"):
        tiny = tiny_model("llama", kernels)
        tiny_prompts = [tuple(chat_ids(tiny, text)) for text in PROMPTS]
        compare("tiny llama f32, batched vs model alone", tiny, tiny, tiny_prompts, n, f32, True)


if __name__ == "__main__":
    main()
