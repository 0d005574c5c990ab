"""How far apart two numeric paths' logits are: the numbers behind the tolerances of
tests/greedy_ties.py.

For each pair (candidate path, reference path) on short chat prompts, the candidate
decodes greedy with `logprobs=20` through the engine (several prompts at once, so rows
are batched and left-padded); the reference then reads the candidate's own tokens in one
forward pass (teacher forcing) and gives log-probabilities at every position. Printed per
pair: the largest |difference| of the top-20 log-probabilities (the noise a near tie must
beat), the smallest top-two margin of the reference along the way, and the positions
where the candidate's token is not the reference's best (with the reference's margin).

Pairs, on the embedded model (float32 weights on the CPU):
- f32 KV, engine alone (one request) vs the model alone;
- f32 KV, engine batched (8 requests) vs the model alone;
- f32 KV with the Rust kernels vs without them (the model loaded a second time with
  `kernel_available` false: another CPU's float order);
- 8-bit and 4-bit KV (group 64), engine batched vs mlx-lm's `QuantizedKVCache`;
and f32 KV on the tiny random llama (tests/tiny_models.py), batched vs alone.

Run: `.venv/bin/python benches/greedy_tie_tolerances.py [--tokens 32]`.
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


def reference_logprobs(loaded: LoadedModel, ids: list[int], kv: KVFormat) -> np.ndarray:
    """Log-probabilities at every position of `ids`, one sequence, mlx-lm's own caches."""
    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

    model: Any = loaded.model
    if kv.bits is None:
        cache = make_prompt_cache(model)
    else:
        cache = [QuantizedKVCache(kv.group_size, kv.bits) for _ in model.layers]
    logits = model(mx.array([ids]), cache=cache)[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def compare(
    name: str,
    candidate: LoadedModel,
    reference: LoadedModel,
    prompts: list[tuple[int, ...]],
    tokens: int,
    kv: KVFormat,
    together: bool,
) -> None:
    worst, smallest_margin, departures = 0.0, float("inf"), []
    for prompt, (ids, tops) in zip(
        prompts, engine_runs(candidate, prompts, tokens, kv, together), strict=True
    ):
        ref = reference_logprobs(reference, [*prompt, *ids], kv)[len(prompt) - 1 :]
        for i, (token, top) in enumerate(zip(ids, tops, strict=True)):
            row = ref[i]
            worst = max(worst, *(abs(row[t] - s) for t, s in top.items()))
            best2 = np.sort(row)[-2:]
            margin = float(best2[1] - best2[0])
            smallest_margin = min(smallest_margin, margin)
            if int(np.argmax(row)) != token:
                departures.append((i, round(margin, 6), round(float(row.max() - row[token]), 6)))
                break  # the rest is another text
    print(
        f"{name:<44} max|dlogprob| {worst:9.2e}   min ref margin {smallest_margin:9.2e}   "
        f"departures (pos, ref margin, cand gap) {departures}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32)
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
    compare("f32 KV, alone vs model alone", kernels, kernels, prompts, n, f32, False)
    compare("f32 KV, batched vs model alone", kernels, kernels, prompts, n, f32, True)
    compare("f32 KV, batched, kernels vs no kernels", kernels, plain, prompts, n, f32, True)
    compare("f32 KV, batched, no kernels vs no kernels", plain, plain, prompts, n, f32, True)
    for bits in (8, 4):
        kv = KVFormat(bits, 64)
        compare(
            f"{bits}-bit KV, batched vs QuantizedKVCache", kernels, kernels, prompts, n, kv, True
        )
    tiny = tiny_model("llama", kernels)
    tiny_prompts = [tuple(chat_ids(tiny, text)) for text in PROMPTS]
    compare("tiny llama f32, batched vs model alone", tiny, tiny, tiny_prompts, n, f32, True)


if __name__ == "__main__":
    main()
