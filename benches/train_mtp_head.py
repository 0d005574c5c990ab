"""Fit a one-layer MTP head for the embedded SmolLM2 on its own greedy outputs (#45).

No trained MTP checkpoint can be downloaded here, so this trains one: a llama decoder
layer sized like SmolLM2's, with DeepSeek-V3's `enorm`/`hnorm`/`eh_proj`/`shared_head.norm`
around it (engine/mtp_head.py `MTPLayer`); the model's embedding and tied head are
shared and stay frozen. Data: the model's own greedy replies to generated instructions
(copy-free: questions, stories, explanations), run once more through the model to take
the final-norm hidden state at every position. Each example is (hidden at t, token t+1)
and its label the model's own argmax after token t+1: exactly what a draft must match to
be accepted. The head is trained over one position (no cache of its own); the engine now
runs it with its own KV cache (engine/mtp_cache.py), so a head trained here sees earlier
positions at inference that it never saw in training. Training it as it runs means whole
sequences of (hidden[t], token[t+1]) pairs through the layer with a causal mask
(notes/2026-11-29-mtp-cache.md).

Run: `.venv/bin/python benches/train_mtp_head.py [--minutes 6] [--out FILE]`; it prints
the held-out top-1 agreement (the acceptance rate a one-token draft can expect) and saves
the head as safetensors (8-bit weights with `--bits 8`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
import time
from pathlib import Path
from typing import Any

from compat_serve.models.blas import ensure_fast_blas

ensure_fast_blas()

import mlx.core as mx  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from compat_serve.engine.config import EngineConfig  # noqa: E402
from compat_serve.engine.engine import Engine  # noqa: E402
from compat_serve.engine.mtp_head import (  # noqa: E402
    DRAFT_VOCAB,
    HiddenCapture,
    MTPHead,
    dequantized,
    head_rows,
    new_llama_head,
    quantize_head_weights,
    vocabulary_rows,
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


def replies(
    loaded: Any, prompt_ids: list[tuple[int, ...]], max_tokens: int, temperature: float
) -> list[list[int]]:
    """The model's own replies, 16 at a time (greedy, or sampled with a seed per prompt for
    more varied contexts: the labels are the argmax at every position either way)."""
    engine = Engine(loaded, EngineConfig(max_num_seqs=16, prefix_cache=False))
    engine.start()

    async def one(i: int, ids: tuple[int, ...]) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i)
        request = EngineRequest(f"g{temperature}-{i}", ids, params)
        return [t async for e in engine.submit(request) for t in e.token_ids]

    async def all_of() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompt_ids))))

    try:
        return asyncio.run(all_of())
    finally:
        engine.shutdown()


Data = dict[str, mx.array]


def examples(loaded: Any, sequences: list[list[int]], rows: int = 8) -> Data:
    """For every position t of every sequence: the final-norm hidden state at t (the head's
    input), token t+1, the model's argmax after t+1 (the label a draft must match) and
    the hidden state at t+1 (what the head's normed output is regressed on, as EAGLE
    does). Teacher-forced, `rows` sequences per forward, right-padded (causal attention:
    the padding never reaches a real position)."""
    model = loaded.model
    capture = HiddenCapture(model)
    parts: dict[str, list[mx.array]] = {"hidden": [], "token": [], "label": [], "target": []}
    ordered = sorted(sequences, key=len)
    for start in range(0, len(ordered), rows):
        chunk = ordered[start : start + rows]
        width = max(len(seq) for seq in chunk)
        padded = mx.array([seq + [0] * (width - len(seq)) for seq in chunk], dtype=mx.uint32)
        logits = model(padded)
        hidden, argmax = capture.last, mx.argmax(logits, axis=-1)
        for row, seq in enumerate(chunk):
            n = len(seq)
            parts["hidden"].append(hidden[row, : n - 2].astype(mx.float16))
            parts["token"].append(mx.array(seq[1 : n - 1], dtype=mx.uint32))
            parts["label"].append(argmax[row, 1 : n - 1].astype(mx.uint32))
            parts["target"].append(hidden[row, 1 : n - 1].astype(mx.float16))
        mx.eval(*(part[-1] for part in parts.values()))
    return {name: mx.concatenate(part) for name, part in parts.items()}


def make_data(loaded: Any, args: argparse.Namespace) -> tuple[Data, Data]:
    started = time.perf_counter()
    ids = prompts(loaded)[: args.prompts]
    held = max(4, len(ids) // 10)  # whole prompts held out, so no context leaks across
    sequences: list[list[int]] = []
    for temperature in args.temperatures:
        got = replies(loaded, ids, args.reply_tokens, temperature)
        sequences += [[*p, *r] for p, r in zip(ids, got, strict=True)]
        print(f"replies at temperature {temperature}: {time.perf_counter() - started:.0f}s")
    is_held = [i % len(ids) < held for i in range(len(sequences))]
    train = examples(loaded, [s for s, h in zip(sequences, is_held, strict=True) if not h])
    test = examples(loaded, [s for s, h in zip(sequences, is_held, strict=True) if h])
    print(
        f"data: {len(sequences)} sequences, {train['label'].shape[0]} train / "
        f"{test['label'].shape[0]} held-out positions in {time.perf_counter() - started:.0f}s"
    )
    return train, test


def frequent_labels(data: Data, n: int) -> mx.array:
    """The `n` ids the model writes most often (its labels' counts), ascending."""
    counts = np.bincount(np.asarray(data["label"]).astype(np.int64))
    top = np.argsort(-counts, kind="stable")[:n]
    return mx.array(np.sort(top).astype(np.uint32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="training time")
    parser.add_argument("--prompts", type=int, default=192)
    parser.add_argument("--reply-tokens", type=int, default=96)
    parser.add_argument(
        "--temperatures", type=lambda t: [float(x) for x in t.split(",")], default=[0.0, 0.8]
    )
    parser.add_argument("--data", help="cache of the examples (made once, read after)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--regression", type=float, default=1.0, help="weight of the loss on "
                        "the next hidden state (EAGLE's feature regression)")  # fmt: skip
    parser.add_argument("--draft-vocab", type=int, default=8192, help="drafts are chosen "
                        "among the N most frequent labels (FR-Spec); 0: every id")  # fmt: skip
    parser.add_argument("--bits", type=int, default=8, choices=[0, 8], help="0: float16")
    parser.add_argument("--out", default="mtp_head.safetensors")
    args = parser.parse_args()

    loaded = load_model(None)
    model = loaded.model
    if args.data and Path(args.data).exists():
        saved = mx.load(args.data)
        assert isinstance(saved, dict)
        train = {k.removeprefix("train."): v for k, v in saved.items() if k.startswith("train.")}
        test = {k.removeprefix("test."): v for k, v in saved.items() if k.startswith("test.")}
        print(f"data from {args.data}: {train['label'].shape[0]} / {test['label'].shape[0]}")
    else:
        train, test = make_data(loaded, args)
        if args.data:
            mx.save_safetensors(
                args.data,
                {
                    f"{part}.{k}": v
                    for part, d in (("train", train), ("test", test))
                    for k, v in d.items()
                },
            )

    mx.random.seed(0)
    layer = new_llama_head(model)
    # Start the head's output norm as the main model's final norm: its output is read by
    # the same vocabulary head.
    layer.shared_head.norm.weight = mx.array(model.model.norm.weight)
    draft_vocab = frequent_labels(train, args.draft_vocab) if args.draft_vocab else None
    head = MTPHead(layer, model, draft_vocab=draft_vocab)
    model.freeze()
    # The loss scores the ids drafts are chosen among (all of them without a draft vocab);
    # a label outside them cannot be drafted and only its regression term counts.
    ids = draft_vocab if draft_vocab is not None else mx.arange(vocabulary_rows(model))
    rows = head_rows(model, ids)
    slot = np.full(vocabulary_rows(model), -1, dtype=np.int32)
    slot[np.asarray(ids)] = np.arange(ids.size)
    train["slot"] = mx.array(slot)[train["label"]]
    if draft_vocab is not None:
        covered = float(np.mean(np.asarray(train["slot"]) >= 0))
        print(f"draft vocabulary: {ids.size} ids cover {covered:.1%} of the training labels")

    def loss_fn(layer_: Any, batch: Data) -> tuple[mx.array, mx.array]:
        normed, _ = head._compose(layer_, head._embed(batch["token"]), batch["hidden"])
        logits = (normed @ rows.T).astype(mx.float32)
        inside = batch["slot"] >= 0
        picked = mx.take_along_axis(logits, mx.maximum(batch["slot"], 0)[:, None], -1)[:, 0]
        per_row = mx.where(inside, mx.logsumexp(logits, axis=-1) - picked, 0.0)
        ce = mx.sum(per_row) / mx.maximum(mx.sum(inside), 1)
        diff = mx.abs(normed.astype(mx.float32) - batch["target"].astype(mx.float32))
        smooth_l1 = mx.mean(mx.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5))
        return ce + args.regression * smooth_l1, ce

    step_fn = mx.value_and_grad(loss_fn)
    n = train["label"].shape[0]
    deadline = time.perf_counter() + args.minutes * 60
    optimizer = optim.AdamW(learning_rate=args.lr, weight_decay=0.0)

    def agreement(data: Data) -> float:
        hits = mx.array(0)
        for start in range(0, data["label"].shape[0], 512):
            part = slice(start, start + 512)
            logits, _ = head.step(data["hidden"][part], data["token"][part])
            hits = hits + mx.sum(mx.argmax(logits, axis=-1) == data["label"][part])
        return int(np.asarray(hits)) / data["label"].shape[0]

    step = 0
    started = time.perf_counter()
    while (now := time.perf_counter()) < deadline:
        # Cosine decay over the time given (the number of steps is not known up front).
        optimizer.learning_rate = (
            args.lr
            * 0.5
            * (1 + math.cos(math.pi * min(1.0, (now - started) / (deadline - started))))
        )
        picks = mx.random.randint(0, n, (args.batch,))
        batch = {k: v[picks] for k, v in train.items()}
        (loss, ce), grads = step_fn(layer, batch)
        optimizer.update(layer, grads)
        mx.eval(layer.parameters(), optimizer.state, loss, ce)
        step += 1
        if step % 200 == 0:
            print(
                f"step {step} loss {loss.item():.3f} ce {ce.item():.3f} "
                f"held-out agreement {agreement(test):.3f}",
                flush=True,
            )
    print(f"{step} steps; held-out top-1 agreement (float): {agreement(test):.3f}")
    weights = dict(tree_flatten(layer.parameters()))
    if args.bits:
        weights = quantize_head_weights(weights, args.bits)
        layer.load_weights(list(dequantized(weights, param_shapes(layer), mx.float32).items()))
        print(f"held-out top-1 agreement ({args.bits}-bit): {agreement(test):.3f}")
    else:
        weights = {k: v.astype(mx.float16) for k, v in weights.items()}
    if draft_vocab is not None:
        weights[DRAFT_VOCAB] = draft_vocab.astype(mx.int32)
    mx.save_safetensors(args.out, weights)
    print(f"saved {args.out}: {Path(args.out).stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
