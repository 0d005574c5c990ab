"""Fit a one-layer MTP head for the embedded SmolLM2 on its own greedy outputs (#45).

No trained MTP checkpoint can be downloaded here, so this trains one: a llama decoder
layer sized like SmolLM2's (starting as the model's last layer, `--init`), with
DeepSeek-V3's `enorm`/`hnorm`/`eh_proj`/`shared_head.norm` around it (engine/mtp_head.py
`MTPLayer`); the model's embedding and tied head are shared and stay frozen. Data: the
model's own greedy replies to 808 generated instructions (101 topics x 8 tasks, copy-free;
the speed bench's prompts held out), run once more through the model to take the
final-norm hidden state at every position. The head is trained as the engine runs it with
its own KV cache (engine/mtp_cache.py): a whole sequence of pairs (hidden[t], token[t+1])
through the layer with a causal mask, the label at each pair the model's own argmax after
token t+1 (exactly what a draft must match to be accepted), beside EAGLE's regression on
hidden[t+1]. Whole prompts are held out (every reply to every tenth prompt text).

The replies are the slow part (25 minutes for 75k tokens at 48 tok/s on two cores): those
made so far are kept in benches/data/smollm2_replies.json (`--replies`, the default; a
path that does not exist is generated and written): 808 greedy replies, then 404 sampled
at temperature 0.7 (seeded per prompt: other contexts, the labels still the argmax). The
teacher-forced examples take another 14 minutes; `--data FILE` keeps them.

Run: `.venv/bin/python benches/train_mtp_head.py [--minutes 20] [--out FILE]`; it prints
the held-out top-1 agreement on reply positions (the acceptance a one-token draft can
expect) and on all positions, and saves the head as safetensors (8-bit with `--bits 8`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
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
    "Write a paragraph about {}.",
    "List five things to know about {}.",
]
# The speed bench's prompts (a fox and a key, why the sky is blue, learning the guitar)
# are held out: none of these topics is theirs.
TOPICS = [
    "rain forms in clouds", "a lighthouse keeper", "learning to cook", "the moon", "bees",
    "a city at night", "saving money", "volcanoes", "a lost dog", "the ocean tides",
    "growing tomatoes", "the history of bread", "a train journey", "winter in the mountains",
    "how computers store numbers", "friendship", "a small bakery", "the water cycle",
    "good sleep habits", "a robot that paints", "the planets", "writing a letter",
    "an old library", "photosynthesis", "running a marathon", "a rainy Sunday", "music",
    "the first airplane", "a garden in spring", "recycling", "a chess game", "deserts",
    "a cat who loves boxes", "the human heart", "electricity reaches a home", "a dragon",
    "keeping a diary", "the Roman empire", "a summer fair", "how bridges stand up",
    "penguins", "a grandmother's recipe", "the internet", "an island village",
    "learning a new language", "earthquakes", "a young astronaut", "coffee", "a bicycle",
    "the seasons", "a haunted house", "how vaccines work", "a football match",
    "the rainforest", "a clockmaker", "public speaking", "whales", "a snowy forest",
    "how plants drink water", "a lost letter", "staying focused", "the pyramids",
    "a birthday party", "thunderstorms", "a museum at night", "making friends at school",
    "honey", "a pirate ship", "how magnets work", "a quiet morning", "the printing press",
    "a farmer and his horse", "time management", "rivers", "a mysterious map",
    "how the eye sees", "a street musician", "healthy breakfasts", "the Arctic",
    "a wizard's apprentice", "solar power", "an old photograph", "owls", "a picnic",
    "the stock market", "a night train", "teamwork", "glaciers", "a toy shop",
    "how sound travels", "a brave knight", "drinking enough water", "the stars",
    "a fishing village", "how money was invented", "a kind stranger", "mushrooms",
    "a treehouse", "how airplanes fly", "a long winter", "kindness",
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
    engine = Engine(
        loaded, EngineConfig(max_num_seqs=32, max_queue=len(prompt_ids), prefix_cache=False)
    )
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
REPLIES = Path(__file__).parent / "data" / "smollm2_replies.json"
# (the prompt's ids, the model's reply); cached as JSON (generation is the slow part)
Sequence = tuple[list[int], list[int]]


def examples(loaded: Any, sequences: list[Sequence], rows: int = 8) -> Data:
    """Every sequence teacher-forced once: the final-norm hidden state at every position
    (`hidden`, float16), the token there (`token`) and the model's argmax after it
    (`label`), concatenated, with each sequence's start (`offsets`, one past the last at
    the end) and its prompt's length (`prompt`). `rows` sequences per forward,
    right-padded (causal attention: the padding never reaches a real position)."""
    model = loaded.model
    capture = HiddenCapture(model)
    hidden: list[mx.array] = []
    labels: list[mx.array] = []
    for start in range(0, len(sequences), rows):
        chunk = [prompt + reply for prompt, reply in sequences[start : start + rows]]
        width = max(len(seq) for seq in chunk)
        padded = mx.array([seq + [0] * (width - len(seq)) for seq in chunk], dtype=mx.uint32)
        argmax = mx.argmax(model(padded), axis=-1).astype(mx.uint32)
        normed = capture.last.astype(mx.float16)
        for row, seq in enumerate(chunk):
            hidden.append(normed[row, : len(seq)])
            labels.append(argmax[row, : len(seq)])
        mx.eval(hidden[-len(chunk) :], labels[-len(chunk) :])
    lengths = [len(prompt) + len(reply) for prompt, reply in sequences]
    tokens = [t for prompt, reply in sequences for t in (*prompt, *reply)]
    return {
        "hidden": mx.concatenate(hidden),
        "token": mx.array(tokens, dtype=mx.uint32),
        "label": mx.concatenate(labels),
        "offsets": mx.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)),
        "prompt": mx.array([len(prompt) for prompt, _ in sequences], dtype=mx.int32),
    }


def make_sequences(loaded: Any, args: argparse.Namespace) -> list[Sequence]:
    if args.replies and Path(args.replies).exists():
        with open(args.replies) as f:
            saved = json.load(f)
        print(f"replies from {args.replies}: {len(saved)}")
        return [(list(p), list(r)) for p, r in saved]
    ids = prompts(loaded)[: args.prompts]
    sequences: list[Sequence] = []
    started = time.perf_counter()
    for temperature in args.temperatures:
        got = replies(loaded, ids, args.reply_tokens, temperature)
        sequences += [(list(p), r) for p, r in zip(ids, got, strict=True)]
        print(f"replies at temperature {temperature}: {time.perf_counter() - started:.0f}s")
    if args.replies:
        with open(args.replies, "w") as f:
            json.dump(sequences, f)
    return sequences


def make_data(loaded: Any, args: argparse.Namespace) -> tuple[Data, Data]:
    """Whole prompts are held out (every reply to every tenth prompt text), so no context
    leaks across."""
    sequences = make_sequences(loaded, args)
    started = time.perf_counter()
    order = {p: i for i, p in enumerate(dict.fromkeys(tuple(p) for p, _ in sequences))}
    is_held = [order[tuple(p)] % 10 == 0 for p, _ in sequences]

    def part(held: bool) -> list[Sequence]:  # by length: less padding in each forward
        chosen = [s for s, h in zip(sequences, is_held, strict=True) if h == held]
        return sorted(chosen, key=lambda s: len(s[0]) + len(s[1]))

    train, test = examples(loaded, part(False)), examples(loaded, part(True))
    print(
        f"data: {len(sequences)} sequences, {train['label'].shape[0]} train / "
        f"{test['label'].shape[0]} held-out positions in {time.perf_counter() - started:.0f}s"
    )
    return train, test


def load_or_make_data(loaded: Any, args: argparse.Namespace) -> tuple[Data, Data]:
    if args.data and Path(args.data).exists():
        saved = mx.load(args.data)
        assert isinstance(saved, dict)
        train = {k.removeprefix("train."): v for k, v in saved.items() if k.startswith("train.")}
        test = {k.removeprefix("test."): v for k, v in saved.items() if k.startswith("test.")}
        print(f"data from {args.data}: {train['label'].shape[0]} / {test['label'].shape[0]}")
        return train, test
    train, test = make_data(loaded, args)
    if args.data:
        parts = (("train", train), ("test", test))
        mx.save_safetensors(args.data, {f"{p}.{k}": v for p, d in parts for k, v in d.items()})
    return train, test


def frequent_labels(data: Data, n: int) -> mx.array:
    """The `n` ids the model writes most often (its labels' counts), ascending."""
    counts = np.bincount(np.asarray(data["label"]).astype(np.int64))
    top = np.argsort(-counts, kind="stable")[:n]
    return mx.array(np.sort(top).astype(np.uint32))


def batch_of(data: Data, picked: np.ndarray, slot: np.ndarray) -> Data:
    """Sequences `picked` as the head runs them, right-padded to the longest: the pairs
    (hidden[t], token[t+1]) for t = 0..n-2, the label (the model's argmax after t+1, as a
    slot of the draft vocabulary, -1 outside it), the regression target (hidden[t+1]),
    `valid` (not padding) and `reply` (the label is a reply token's prediction: where a
    draft is proposed while decoding)."""
    offsets, prompt = data["_offsets"], data["_prompt"]
    starts, ends = offsets[picked], offsets[picked + 1]
    width = int((ends - starts).max()) - 1
    pos = np.arange(width)[None, :]
    valid = pos < (ends - starts - 1)[:, None]
    index = np.where(valid, starts[:, None] + pos, 0)
    nxt = np.where(valid, index + 1, 0)
    labels = data["_label"][nxt]
    return {
        "hidden": data["hidden"][mx.array(index)],
        "token": mx.array(data["_token"][nxt]),
        "target": data["hidden"][mx.array(nxt)],
        "slot": mx.array(np.where(valid, slot[labels], -1).astype(np.int32)),
        "label": mx.array(labels.astype(np.uint32)),
        "valid": mx.array(valid),
        "reply": mx.array(valid & (pos + 1 >= prompt[picked][:, None])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="training time")
    parser.add_argument("--prompts", type=int, default=len(TOPICS) * len(TASKS))
    parser.add_argument("--reply-tokens", type=int, default=96)
    parser.add_argument(
        "--temperatures", type=lambda t: [float(x) for x in t.split(",")], default=[0.0]
    )
    parser.add_argument("--replies", default=str(REPLIES), help="the model's replies (JSON)")
    parser.add_argument("--data", help="cache of the teacher-forced examples (safetensors)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30, help="steps of linear warm-up")
    parser.add_argument("--regression", type=float, default=1.0, help="weight of the loss on "
                        "the next hidden state (EAGLE's feature regression)")  # fmt: skip
    parser.add_argument("--soft", type=float, default=0.0, help="weight of EAGLE's soft "
                        "classification loss: cross-entropy against the model's own "
                        "distribution after t+1 (from its hidden state there)")  # fmt: skip
    parser.add_argument("--draft-vocab", type=int, default=4096, help="drafts are chosen "
                        "among the N most frequent labels (FR-Spec); 0: every id")  # fmt: skip
    parser.add_argument("--init", choices=["random", "last-layer"], default="last-layer",
                        help="the head's layer starts random or as the model's last")  # fmt: skip
    parser.add_argument("--report", type=int, default=200, help="steps between reports")
    parser.add_argument("--bits", type=int, default=8, choices=[0, 8], help="0: float16")
    parser.add_argument("--out", default="mtp_head.safetensors")
    args = parser.parse_args()

    loaded = load_model(None)
    model = loaded.model
    train, test = load_or_make_data(loaded, args)
    for data in (train, test):  # index arrays on the host, gathered per batch
        for key in ("offsets", "prompt", "token", "label"):
            data[f"_{key}"] = np.asarray(data[key]).astype(np.int64)  # type: ignore[assignment]

    mx.random.seed(0)
    layer = new_llama_head(model)
    if args.init == "last-layer":  # the decoder layer starts as the model's last one
        own = model.model.layers[-1]
        layer.load_weights(list(tree_flatten(own.parameters())), strict=False)
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
    slot = np.full(vocabulary_rows(model), -1, dtype=np.int64)
    slot[np.asarray(ids)] = np.arange(ids.size)
    if draft_vocab is not None:
        covered = float(np.mean(slot[train["_label"]] >= 0))  # type: ignore[index]
        print(f"draft vocabulary: {ids.size} ids cover {covered:.1%} of the training labels")

    def forward(layer_: Any, batch: Data) -> mx.array:
        """The head over whole sequences, causal (as the engine runs it with its cache)."""
        normed, _ = head._compose(layer_, head._embed(batch["token"]), batch["hidden"], None)
        return normed

    def loss_fn(layer_: Any, batch: Data) -> tuple[mx.array, mx.array]:
        normed = forward(layer_, batch)
        logits = (normed @ rows.T).astype(mx.float32)
        inside = batch["slot"] >= 0
        picked = mx.take_along_axis(logits, mx.maximum(batch["slot"], 0)[..., None], -1)[..., 0]
        normalizer = mx.logsumexp(logits, axis=-1, keepdims=True)
        per_pos = mx.where(inside, normalizer[..., 0] - picked, 0.0)
        ce = mx.sum(per_pos) / mx.maximum(mx.sum(inside), 1)
        diff = mx.abs(normed.astype(mx.float32) - batch["target"].astype(mx.float32))
        smooth_l1 = mx.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5).mean(axis=-1)
        valid = batch["valid"]
        regression = mx.sum(mx.where(valid, smooth_l1, 0.0)) / mx.maximum(mx.sum(valid), 1)
        loss = ce + args.regression * regression
        if args.soft:  # the model's logits after t+1: its final-norm hidden state there
            teacher = mx.softmax((batch["target"] @ rows.T).astype(mx.float32), axis=-1)
            soft = -mx.sum(teacher * (logits - normalizer), -1)
            loss = loss + args.soft * mx.sum(mx.where(valid, soft, 0.0)) / mx.maximum(
                mx.sum(valid), 1
            )
        return loss, ce

    def agreement(data: Data) -> tuple[float, float]:
        """Top-1 agreement with the model's argmax: (reply positions, every position)."""
        hits = [mx.array(0), mx.array(0)]
        counts = [mx.array(0), mx.array(0)]
        n_seq = data["_prompt"].shape[0]
        for start in range(0, n_seq, 32):
            batch = batch_of(data, np.arange(start, min(n_seq, start + 32)), slot)
            normed = forward(layer, batch)
            best = ids[mx.argmax(normed @ rows.T, axis=-1)]
            right = best == batch["label"]
            for i, where in enumerate((batch["reply"], batch["valid"])):
                hits[i] = hits[i] + mx.sum(right & where)
                counts[i] = counts[i] + mx.sum(where)
        return hits[0].item() / counts[0].item(), hits[1].item() / counts[1].item()

    step_fn = mx.value_and_grad(loss_fn)
    n_train = train["_prompt"].shape[0]
    deadline = time.perf_counter() + args.minutes * 60
    optimizer = optim.AdamW(learning_rate=args.lr, weight_decay=0.0)
    rng = np.random.default_rng(0)
    step = 0
    started = time.perf_counter()
    while (now := time.perf_counter()) < deadline:
        # Cosine decay over the time given (the number of steps is not known up front).
        optimizer.learning_rate = (
            args.lr
            * min(1.0, (step + 1) / args.warmup)
            * 0.5
            * (1 + math.cos(math.pi * min(1.0, (now - started) / (deadline - started))))
        )
        batch = batch_of(train, rng.choice(n_train, args.batch, replace=False), slot)
        (loss, ce), grads = step_fn(layer, batch)
        optimizer.update(layer, grads)
        mx.eval(layer.parameters(), optimizer.state, loss, ce)
        step += 1
        if step % args.report == 0:
            reply, every = agreement(test)
            print(
                f"step {step} ({time.perf_counter() - started:.0f}s) loss {loss.item():.3f} "
                f"ce {ce.item():.3f} held-out agreement: replies {reply:.3f}, all {every:.3f}",
                flush=True,
            )
    reply, every = agreement(test)
    print(f"{step} steps; held-out top-1 agreement (float): replies {reply:.3f}, all {every:.3f}")
    weights = dict(tree_flatten(layer.parameters()))
    if args.bits:
        weights = quantize_head_weights(weights, args.bits)
        layer.load_weights(list(dequantized(weights, param_shapes(layer), mx.float32).items()))
        reply, every = agreement(test)
        print(f"held-out top-1 agreement ({args.bits}-bit): replies {reply:.3f}, all {every:.3f}")
    else:
        weights = {k: v.astype(mx.float16) for k, v in weights.items()}
    if draft_vocab is not None:
        weights[DRAFT_VOCAB] = draft_vocab.astype(mx.int32)
    mx.save_safetensors(args.out, weights)
    print(f"saved {args.out}: {Path(args.out).stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
