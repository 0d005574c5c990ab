"""Fit a one-layer MTP head for the embedded SmolLM2 on its own greedy outputs (#45).

No trained MTP checkpoint can be downloaded here, so this trains one: a llama decoder
layer sized like SmolLM2's, with DeepSeek-V3's `enorm`/`hnorm`/`eh_proj`/`shared_head.norm`
around it (engine/mtp_head.py `MTPLayer`); the model's embedding and tied head are
shared and stay frozen. Data: the model's own greedy replies to generated instructions
(copy-free: questions, stories, explanations), run once more through the model to take
the final-norm hidden state at every position. Each example is (hidden at t, token t+1)
and its label the model's own argmax after token t+1: exactly what a draft must match to
be accepted. The head runs over one position (no cache of its own), as the engine runs it.

Run: `.venv/bin/python benches/train_mtp_head.py [--minutes 6] [--out FILE]`; it prints
the held-out top-1 agreement (the acceptance rate a one-token draft can expect) and saves
the head as safetensors (8-bit weights with `--bits 8`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import time
from pathlib import Path
from typing import Any

from compat_serve.models.blas import ensure_fast_blas

ensure_fast_blas()

import mlx.core as mx  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from compat_serve.engine.config import EngineConfig  # noqa: E402
from compat_serve.engine.engine import Engine  # noqa: E402
from compat_serve.engine.mtp_head import (  # noqa: E402
    HiddenCapture,
    MTPHead,
    dequantized,
    new_llama_head,
    quantize_head_weights,
)
from compat_serve.engine.types import EngineRequest, SamplingParams  # noqa: E402
from compat_serve.models.loader import load_model  # noqa: E402
from compat_serve.models.weights import param_shapes  # noqa: E402

TASKS = [
    "Explain in a few sentences how {}.",
    "Write a short story about {}.",
    "Give three tips about {}.",
    "What are the main facts about {}?",
    "Describe {} to a child.",
    "Write a short poem about {}.",
]
TOPICS = [
    "rain forms in clouds", "a lighthouse keeper", "learning to cook", "the moon", "bees",
    "a city at night", "saving money", "volcanoes", "a lost dog", "the ocean tides",
    "growing tomatoes", "the history of bread", "a train journey", "winter in the mountains",
    "how computers store numbers", "friendship", "a small bakery", "the water cycle",
    "good sleep habits", "a robot that paints", "the planets", "writing a letter",
    "an old library", "photosynthesis", "running a marathon", "a rainy Sunday", "music",
    "the first airplane", "a garden in spring", "recycling", "a chess game", "deserts",
]  # fmt: skip


def prompts(loaded: Any) -> list[tuple[int, ...]]:
    texts = [task.format(topic) for topic, task in itertools.product(TOPICS, TASKS)]
    random.Random(0).shuffle(texts)
    return [chat_ids(loaded, t) for t in texts]


def chat_ids(loaded: Any, text: str) -> tuple[int, ...]:
    """One ChatML user turn asking for the reply (SmolLM2's template)."""
    prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return tuple(loaded.tokenizer.encode(prompt))


def greedy_replies(
    loaded: Any, prompt_ids: list[tuple[int, ...]], max_tokens: int
) -> list[list[int]]:
    engine = Engine(loaded, EngineConfig(max_num_seqs=8, prefix_cache=False))
    engine.start()

    async def one(i: int, ids: tuple[int, ...]) -> list[int]:
        request = EngineRequest(f"g{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0))
        return [t async for e in engine.submit(request) for t in e.token_ids]

    async def all_of() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompt_ids))))

    try:
        return asyncio.run(all_of())
    finally:
        engine.shutdown()


def examples(loaded: Any, sequences: list[list[int]]) -> tuple[mx.array, mx.array, mx.array]:
    """(hidden at t, token t+1, the model's argmax after t+1) for every position."""
    model = loaded.model
    capture = HiddenCapture(model)
    hiddens, tokens, labels = [], [], []
    for seq in sequences:
        logits = model(mx.array(seq, dtype=mx.uint32)[None])[0]
        hidden = capture.last[0]
        argmax = mx.argmax(logits, axis=-1)
        hiddens.append(hidden[:-2])
        tokens.append(mx.array(seq[1:-1], dtype=mx.uint32))
        labels.append(argmax[1:-1])
        mx.eval(hiddens[-1], labels[-1])
    return mx.concatenate(hiddens), mx.concatenate(tokens), mx.concatenate(labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=6.0, help="training time")
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--reply-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bits", type=int, default=8, choices=[0, 8], help="0: float16")
    parser.add_argument("--out", default="mtp_head.safetensors")
    args = parser.parse_args()

    loaded = load_model(None)
    model = loaded.model
    started = time.perf_counter()
    ids = prompts(loaded)[: args.prompts]
    replies = greedy_replies(loaded, ids, args.reply_tokens)
    sequences = [[*p, *r] for p, r in zip(ids, replies, strict=True)]
    held = max(4, len(sequences) // 10)
    train_x = examples(loaded, sequences[held:])
    test_x = examples(loaded, sequences[:held])
    print(
        f"data: {len(sequences)} replies, {train_x[0].shape[0]} train / {test_x[0].shape[0]} "
        f"held-out positions in {time.perf_counter() - started:.0f}s"
    )

    mx.random.seed(0)
    layer = new_llama_head(model)
    head = MTPHead(layer, model)
    model.freeze()

    def loss_fn(layer_: Any, hidden: mx.array, tokens: mx.array, labels: mx.array) -> mx.array:
        head.layer = layer_
        logits, _ = head.step(hidden, tokens)
        return mx.mean(
            mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, labels[:, None], -1)[:, 0]
        )

    step_fn = mx.value_and_grad(loss_fn)
    optimizer = optim.AdamW(learning_rate=args.lr, weight_decay=0.0)

    def agreement(data: tuple[mx.array, mx.array, mx.array]) -> float:
        head.layer = layer  # the loss swapped in the traced one
        hits = 0
        for start in range(0, data[0].shape[0], 512):
            logits, _ = head.step(data[0][start : start + 512], data[1][start : start + 512])
            hits += int(mx.sum(mx.argmax(logits, axis=-1) == data[2][start : start + 512]).item())
        return hits / data[0].shape[0]

    n = train_x[0].shape[0]
    deadline = time.perf_counter() + args.minutes * 60
    step = 0
    while time.perf_counter() < deadline:
        batch = mx.random.randint(0, n, (args.batch,))
        loss, grads = step_fn(layer, train_x[0][batch], train_x[1][batch], train_x[2][batch])
        optimizer.update(layer, grads)
        mx.eval(layer.parameters(), optimizer.state, loss)
        step += 1
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    print(f"{step} steps; held-out top-1 agreement (float): {agreement(test_x):.3f}")
    weights = dict(tree_flatten(layer.parameters()))
    if args.bits:
        weights = quantize_head_weights(weights, args.bits)
        layer.load_weights(list(dequantized(weights, param_shapes(layer), mx.float32).items()))
        print(f"held-out top-1 agreement ({args.bits}-bit): {agreement(test_x):.3f}")
    else:
        weights = {k: v.astype(mx.float16) for k, v in weights.items()}
    mx.save_safetensors(args.out, weights)
    print(f"saved {args.out}: {Path(args.out).stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
