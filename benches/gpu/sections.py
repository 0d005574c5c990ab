"""The kit's measurements, one function per table. Each runs alternating rounds (ours,
then mlx-lm's or the other setting, on the same weights) until its rounds are done or its
share of the time budget is spent, and writes each row as soon as it has it. A row's first
round runs while the whole run has time left (every row gets a number; the last sections
get less), its further rounds only within the section's share."""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from measure import (
    agreement,
    decode_rate,
    engine_streams,
    engine_ttft,
    mlx_lm_greedy,
    mlx_lm_prefill,
    mlx_lm_streams,
    mlx_lm_ttft,
    running_engine,
)
from report import Budget, Report, median, median_spread
from shapes import random_prompt

from compat_serve.engine.config import EngineConfig
from compat_serve.engine.kv_quant import KVFormat
from compat_serve.engine.speculation import SpeculationConfig
from compat_serve.models.types import LoadedModel


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the full one on a GPU, or the smoke on the CPU."""

    widths: tuple[int, ...]
    prompt_tokens: int
    decode_tokens: int
    repeats: int
    ttft_prefixes: tuple[int, ...]
    ttft_tail: int
    kv_preamble: int
    kv_streams: int
    spec_tokens: int
    spec_widths: tuple[int, ...]
    greedy_tokens: int
    tie_tolerance: float


FULL = Plan((1, 8, 32, 64), 32, 64, 3, (8192, 32768), 64, 4096, 8, 96, (1, 4), 32, 0.1)
SMOKE = Plan((1, 2), 8, 4, 1, (64,), 8, 32, 2, 8, (1, 2), 8, 0.1)


def free_memory() -> None:
    gc.collect()
    mx.clear_cache()


def greedy(report: Report, budget: Budget, loaded: LoadedModel, plan: Plan, seeds: int) -> None:
    """Our engine's greedy tokens against `mlx_lm.generate`'s on the same weights."""
    key = "greedy"
    report.table(
        key,
        f"Greedy equality, {plan.greedy_tokens} tokens: compat-serve engine vs mlx_lm.generate "
        f"(tie-aware: a difference counts only where mlx-lm's top-2 margin is >= "
        f"{plan.tie_tolerance})",
        ["model", "prompt", "result"],
    )
    prompts = _greedy_prompts(loaded, seeds)
    with running_engine(loaded, EngineConfig()) as engine:
        for done, (name, prompt) in enumerate(prompts):
            if budget.left() <= 0 or (done and budget.section_left() <= 0):
                report.skip(f"greedy {loaded.name} {name}: budget")
                return
            ours = engine_streams(engine, [prompt], plan.greedy_tokens)[0].tokens
            theirs = mlx_lm_greedy(loaded.model, prompt, plan.greedy_tokens)
            result = agreement(loaded.model, prompt, ours, theirs, plan.tie_tolerance)
            report.row(
                key,
                [loaded.name, name, result.describe()],
                model=loaded.name,
                prompt=name,
                same=result.same,
                length=result.length,
                gap=result.gap,
                ok=result.ok,
            )


def _greedy_prompts(loaded: LoadedModel, seeds: int) -> list[tuple[str, tuple[int, ...]]]:
    if loaded.chat_template is None:  # a random model: random ids
        vocab = loaded.tokenizer.vocab_size
        return [(f"random ids #{s}", random_prompt(vocab, 24, 1000 + s)) for s in range(seeds)]
    texts = ["The capital of France is", "def fibonacci(n):", "List three colors:"]
    return [(repr(t), _chat(loaded, t)) for t in texts[:seeds]]


def _chat(loaded: LoadedModel, text: str) -> tuple[int, ...]:
    prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return tuple(loaded.tokenizer.encode(prompt))


def decode(report: Report, budget: Budget, loaded: LoadedModel, plan: Plan) -> None:
    """Decode tok/s at each width: our engine vs mlx-lm's BatchGenerator, alternating."""
    key = f"decode:{loaded.name}"
    report.table(
        key,
        f"Decode tok/s, {loaded.name}: {plan.prompt_tokens}-token prompts, "
        f"{plan.decode_tokens} new tokens each, median (min-max) of alternating rounds",
        ["streams", "compat-serve", "mlx_lm BatchGenerator", "ratio", "rounds"],
    )
    vocab = loaded.tokenizer.vocab_size
    config = EngineConfig(max_num_seqs=max(plan.widths))
    with running_engine(loaded, config) as engine:
        for width in plan.widths:  # a short warm-up of each shape (kernels compile)
            warm = [
                random_prompt(vocab, plan.prompt_tokens, 90_000 + width + i) for i in range(width)
            ]
            engine_streams(engine, warm, 2)
            mlx_lm_streams(loaded.model, warm, 2)
        for width in plan.widths:
            ours: list[float] = []
            theirs: list[float] = []
            for rep in range(plan.repeats):
                if budget.section_left() <= 0 and rep > 0:
                    break
                if budget.left() <= 0:
                    report.skip(f"{key} x{width}: budget")
                    return
                seed = 10_000 * (rep + 1) + 100 * width
                prompts = [random_prompt(vocab, plan.prompt_tokens, seed + i) for i in range(width)]
                ours.append(decode_rate(engine_streams(engine, prompts, plan.decode_tokens)))
                theirs.append(
                    decode_rate(mlx_lm_streams(loaded.model, prompts, plan.decode_tokens))
                )
            ratio = median(ours) / median(theirs) if median(theirs) > 0 else 0.0
            report.row(
                key,
                [width, median_spread(ours), median_spread(theirs), f"{ratio:.2f}x", len(ours)],
                model=loaded.name,
                streams=width,
                ours=ours,
                mlx_lm=theirs,
                ratio=ratio,
            )
    free_memory()


def ttft(report: Report, budget: Budget, loaded: LoadedModel, plan: Plan) -> None:
    """Time to first token with a shared prefix: cold (nothing cached) vs warm (the prefix
    cached, `ttft_tail` new tokens after it), our prefix cache vs mlx-lm's copied cache."""
    key = f"ttft:{loaded.name}"
    report.table(
        key,
        f"TTFT cold vs warm, {loaded.name}: shared prefix + {plan.ttft_tail} new tokens "
        "(seconds; warm/cold ratio)",
        ["prefix", "ours cold", "ours warm", "ours warm/cold", "mlx_lm cold", "mlx_lm warm",
         "mlx_lm warm/cold", "ours cached tokens"],
    )  # fmt: skip
    vocab = loaded.tokenizer.vocab_size
    for length in plan.ttft_prefixes:
        if budget.left() <= 0:
            report.skip(f"{key} prefix {length}: budget")
            return
        prefix = random_prompt(vocab, length, 7 + length)
        first = prefix + random_prompt(vocab, plan.ttft_tail, 8 + length)
        second = prefix + random_prompt(vocab, plan.ttft_tail, 9 + length)
        with running_engine(loaded, EngineConfig()) as engine:
            cold = engine_ttft(engine, first)
            warm = engine_ttft(engine, second)
        free_memory()
        their_cold, _ = mlx_lm_ttft(loaded.model, first)
        cache = mlx_lm_prefill(loaded.model, prefix)
        their_warm, _ = mlx_lm_ttft(loaded.model, second[length:], cache)
        del cache
        free_memory()
        report.row(
            key,
            [length, f"{cold.ttft:.3f}", f"{warm.ttft:.3f}", f"{warm.ttft / cold.ttft:.3f}",
             f"{their_cold:.3f}", f"{their_warm:.3f}", f"{their_warm / their_cold:.3f}",
             warm.cached],
            model=loaded.name, prefix=length, ours_cold=cold.ttft, ours_warm=warm.ttft,
            mlx_lm_cold=their_cold, mlx_lm_warm=their_warm, cached=warm.cached,
        )  # fmt: skip


KV_FORMATS = {
    "model dtype": KVFormat(),
    "--kv-bits 8": KVFormat(8, 64),
    "--kv-bits 4": KVFormat(4, 64),
}


def kv_bits(report: Report, budget: Budget, loaded: LoadedModel, plan: Plan) -> None:
    """Decode at `kv_streams` streams after a shared `kv_preamble` (read from the prefix
    cache), per KV format, alternating formats each round."""
    key = f"kv:{loaded.name}"
    report.table(
        key,
        f"KV format, {loaded.name}: decode tok/s at {plan.kv_streams} streams after a "
        f"{plan.kv_preamble}-token shared preamble, {plan.decode_tokens} new tokens",
        ["KV", "decode tok/s", "vs model dtype", "rounds"],
    )
    vocab = loaded.tokenizer.vocab_size
    preamble = random_prompt(vocab, plan.kv_preamble, 4242)
    streams = [
        preamble + random_prompt(vocab, plan.prompt_tokens, 500 + i) for i in range(plan.kv_streams)
    ]
    rates: dict[str, list[float]] = {name: [] for name in KV_FORMATS}
    engines = {}
    try:
        for name, kv_format in KV_FORMATS.items():
            config = EngineConfig(kv_format=kv_format, max_num_seqs=max(plan.kv_streams, 16))
            engines[name] = running_engine(loaded, config)
        started = {name: ctx.__enter__() for name, ctx in engines.items()}
        for engine in started.values():
            engine_streams(engine, [preamble], 1)  # cached once; also the warm-up
            engine_streams(engine, streams, 2)
        for rep in range(plan.repeats):
            if (budget.section_left() if rep else budget.left()) <= 0:
                if rep == 0:
                    report.skip(f"{key}: budget")
                    return
                break
            for name, engine in started.items():
                rates[name].append(decode_rate(engine_streams(engine, streams, plan.decode_tokens)))
    finally:
        for ctx in engines.values():
            ctx.__exit__(None, None, None)
        free_memory()
    base = median(rates["model dtype"])
    for name, values in rates.items():
        ratio = median(values) / base if base > 0 else 0.0
        report.row(
            key,
            [name, median_spread(values), f"{ratio:.2f}x", len(values)],
            model=loaded.name, kv=name, rates=values, ratio=ratio,
        )  # fmt: skip


def speculation(
    report: Report,
    budget: Budget,
    loaded: LoadedModel,
    plan: Plan,
    workloads: dict[str, tuple[int, ...]],
) -> None:
    """`--speculative ngram` vs off, alternating, per workload and width."""
    key = f"spec:{loaded.name}"
    report.table(
        key,
        f"Speculation, {loaded.name}: ngram vs off, decode tok/s, {plan.spec_tokens} new tokens",
        ["workload", "streams", "off", "ngram", "speed-up", "accepted", "rounds"],
    )

    def config(mode: str) -> EngineConfig:
        return EngineConfig(prefix_cache=False, speculation=SpeculationConfig(mode))

    with (
        running_engine(loaded, config("off")) as plain,
        running_engine(loaded, config("ngram")) as spec,
    ):
        engines: dict[str, Any] = {"off": plain, "ngram": spec}
        for name, prompt in workloads.items():
            for width in plan.spec_widths:
                measured = _alternating_rates(budget, engines, "ngram", [prompt] * width, plan)
                if measured is None:
                    report.skip(f"{key} {name} x{width}: budget")
                    return
                rates, drafted, accepted = measured
                off, ngram = median(rates["off"]), median(rates["ngram"])
                ratio = ngram / off if off > 0 else 0.0
                report.row(
                    key,
                    [name, width, median_spread(rates["off"]), median_spread(rates["ngram"]),
                     f"{ratio:.2f}x", f"{accepted}/{drafted}", len(rates["off"])],
                    model=loaded.name, workload=name, streams=width, off=rates["off"],
                    ngram=rates["ngram"], ratio=ratio, drafted=drafted, accepted=accepted,
                )  # fmt: skip
    free_memory()


def mtp_cost(report: Report, budget: Budget, loaded: LoadedModel, plan: Plan) -> None:
    """`--speculative mtp` with a random-weight one-layer head vs off, alternating, one
    draft token per step (cost-aware choice off, so every step drafts and verifies). A
    random head's drafts are rejected, so a step emits what a plain one does: the ratio is
    the cost MTP adds per step on this device, and `break-even` the acceptance a trained
    head needs to pay for it (k = 1 emits 1 + a tokens per step at `off / mtp` the cost)."""
    from compat_serve.engine.mtp_head import MTPHead, new_llama_head

    key = f"mtp:{loaded.name}"
    report.table(
        key,
        f"MTP drafting cost, {loaded.name}: random head, 1 draft token, decode tok/s",
        ["streams", "off", "mtp", "ratio", "break-even acceptance", "accepted", "rounds"],
    )
    mx.random.seed(45)
    layer = new_llama_head(loaded.model)
    # The model's float type; evaluated here: the engine's thread has no stream of this one's.
    layer.set_dtype(loaded.model.model.norm.weight.dtype)  # type: ignore[union-attr]
    mx.eval(layer.parameters())
    head = MTPHead(layer, loaded.model)
    mtp = SpeculationConfig("mtp", num_tokens=1, mtp=head, cost_aware=False)
    with (
        running_engine(loaded, EngineConfig(prefix_cache=False)) as plain,
        running_engine(loaded, EngineConfig(prefix_cache=False, speculation=mtp)) as drafting,
    ):
        engines: dict[str, Any] = {"off": plain, "mtp": drafting}
        prompt = random_prompt(loaded.tokenizer.vocab_size, plan.prompt_tokens, 45)
        for width in plan.spec_widths:
            measured = _alternating_rates(budget, engines, "mtp", [prompt] * width, plan)
            if measured is None:
                report.skip(f"{key} x{width}: budget")
                return
            rates, drafted, accepted = measured
            off, with_mtp = median(rates["off"]), median(rates["mtp"])
            ratio = with_mtp / off if off > 0 else 0.0
            break_even = off / with_mtp - 1 if with_mtp > 0 else float("inf")
            report.row(
                key,
                [width, median_spread(rates["off"]), median_spread(rates["mtp"]),
                 f"{ratio:.2f}x", f"{break_even:.0%}", f"{accepted}/{drafted}", len(rates["off"])],
                model=loaded.name, streams=width, off=rates["off"], mtp=rates["mtp"],
                ratio=ratio, break_even=break_even, drafted=drafted, accepted=accepted,
            )  # fmt: skip
    free_memory()


def _alternating_rates(
    budget: Budget,
    engines: dict[str, Any],
    drafting: str,
    prompts: list[tuple[int, ...]],
    plan: Plan,
) -> tuple[dict[str, list[float]], int, int] | None:
    """Decode tok/s of each engine over `prompts` at once, in alternating rounds (round 0
    warms each up and is not kept), until the section's share is spent, with the tokens
    the `drafting` engine drafted and had accepted meanwhile; None when the whole run's
    budget is spent."""
    before = engines[drafting].speculation_status()
    rates: dict[str, list[float]] = {mode: [] for mode in engines}
    for rep in range(plan.repeats + 1):
        if budget.section_left() <= 0 and rep > 1:
            break
        if budget.left() <= 0:
            return None
        for mode, engine in engines.items():
            rate = decode_rate(engine_streams(engine, prompts, plan.spec_tokens))
            if rep:
                rates[mode].append(rate)
    after = engines[drafting].speculation_status()
    drafted = _delta(before, after, "draft_tokens")
    return rates, drafted, _delta(before, after, "accepted_tokens")


def _delta(before: dict[str, Any], after: dict[str, Any], key: str) -> int:
    return int(after.get(key) or 0) - int(before.get(key) or 0)


def guarded(report: Report, name: str, step: Callable[[], None]) -> None:
    """Run one section; an error is written into the report and the run goes on."""
    try:
        step()
    except Exception as exc:  # the kit's job is to return a table, whatever breaks
        import traceback

        traceback.print_exc()
        report.skip(f"{name}: {type(exc).__name__}: {exc}")
        free_memory()
