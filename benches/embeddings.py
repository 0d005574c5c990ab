"""Embeddings beside the chat model (#37): two tables.

1. Inputs per second at batch 1, 32 and 256 of 128-token texts: ours (the embedding
   engine's scheduler and forward, embeddings/scheduler.py, on its host thread) against
   `mlx-embeddings`' own batched call (its BERT module, one padded forward per batch,
   mean pooling and normalization as its `text_embeds`) on the same weights: a small
   random BERT (4 layers, hidden 256, 4 heads, FFN 1024: 3.2M parameters besides its
   tiny vocabulary's embeddings, f32), written as a sentence-transformers directory
   (tests/tiny_embedding_models.py's writer). Rounds alternate; medians with min-max.
2. The chat model's decode (embedded SmolLM2-135M, greedy, 48 tokens, one stream)
   through a real `compat-serve --models FILE --memory-budget 4GiB` holding both models,
   alone and while two clients send embedding batches of 32 such texts back to back
   (the issue's target: >= 0.8x of the solo tok/s). Rounds alternate; medians with
   min-max. Then the same with the embedding step's fairness weight at 1
   (COMPAT_SERVE_EMBEDDING_STEP_WEIGHT=1: the host's plain virtual-time fairness), the
   reference the weight of 5 is measured against.

`--rounds N` (default 3), `--only throughput|decode`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _servers import BIN, _spawn, _wait_ready, free_port, log, make_client, stream_chat  # noqa: E402
from compat_serve.models.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()

TEXT_TOKENS = 128
EMBEDDING_CLIENTS = 2
BENCH_SIZES = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "intermediate_size": 1024,
    "max_position_embeddings": 512,
}


def write_small_bert(parent: Path) -> Path:
    """A small random BERT (BENCH_SIZES), as users have it (sentence-transformers files)."""
    import json

    from tests import tiny_embedding_models as tiny

    saved = dict(tiny._BERT_SIZES)
    tiny._BERT_SIZES.update(BENCH_SIZES)
    try:
        model_dir = tiny.write_bert_embedding(parent / "bert-small")
    finally:
        tiny._BERT_SIZES.clear()
        tiny._BERT_SIZES.update(saved)
    (model_dir / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 256, "do_lower_case": False})
    )
    pooling = model_dir / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    pooling.write_text(
        json.dumps({**config, "word_embedding_dimension": BENCH_SIZES["hidden_size"]})
    )
    return model_dir


def texts(count: int) -> list[str]:
    """`count` distinct texts of 128 tokens each (126 one-token words + [CLS] [SEP])."""
    from tests.tiny_embedding_models import WORDS

    return [
        " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(TEXT_TOKENS - 2))
        for i in range(count)
    ]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} ({min(values):.1f}-{max(values):.1f})"


# --- 1. throughput -----------------------------------------------------------------------


def ours(model_dir: Path) -> Callable[[list[list[int]]], None]:
    from compat_serve.embeddings.loader import load_embedding_model
    from compat_serve.embeddings.scheduler import EmbeddingEngine

    engine = EmbeddingEngine(load_embedding_model(model_dir))
    engine.start()

    def run(rows: list[list[int]]) -> None:
        async def one() -> None:
            await asyncio.wrap_future(engine.submit("embed", rows))

        asyncio.run(one())

    return run


def theirs(model_dir: Path) -> Callable[[list[list[int]]], None]:
    """mlx-embeddings' BERT on the same weights: one padded forward per call, its
    `text_embeds` (mean pooling over the mask, normalized) evaluated."""
    import mlx.core as mx
    from mlx_embeddings.utils import load

    model, _ = load(str(model_dir))

    def run(rows: list[list[int]]) -> None:
        width = max(len(r) for r in rows)
        ids = mx.array([r + [0] * (width - len(r)) for r in rows])
        mask = mx.array([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        out = model(ids, attention_mask=mask)
        mx.eval(out.text_embeds)

    return run


def throughput(rounds: int) -> list[str]:
    from compat_serve.embeddings.loader import load_embedding_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_small_bert(Path(tmp))
        tokens = load_embedding_model(model_dir)
        rows_all = [tokens.tokenize(t) for t in texts(256)]
        assert {len(r) for r in rows_all} == {TEXT_TOKENS}, {len(r) for r in rows_all}
        runners = {"ours": ours(model_dir), "mlx-embeddings": theirs(model_dir)}
        lines = [
            "inputs/s, 128-token texts, random BERT (4 layers, hidden 256, f32), "
            f"median (min-max) of {rounds} alternating rounds",
            f"{'batch':>6} {'ours':>22} {'mlx-embeddings':>22} {'ratio':>6}",
        ]
        for batch in (1, 32, 256):
            rows = rows_all[:batch]
            repeats = max(1, 64 // batch)
            rates: dict[str, list[float]] = {name: [] for name in runners}
            for run in runners.values():
                run(rows)  # warm-up (shapes compiled, buffers allocated)
            for _ in range(rounds):
                for name, run in runners.items():
                    started = time.perf_counter()
                    for _ in range(repeats):
                        run(rows)
                    rates[name].append(batch * repeats / (time.perf_counter() - started))
            ratio = statistics.median(rates["ours"]) / statistics.median(rates["mlx-embeddings"])
            lines.append(
                f"{batch:>6} {spread(rates['ours']):>22} {spread(rates['mlx-embeddings']):>22} "
                f"{ratio:>5.2f}x"
            )
            log(lines[-1])
    return lines


# --- 2. chat decode beside embedding batches ---------------------------------------------


def decode_beside_embeddings(rounds: int) -> list[str]:
    from compat_serve.embeddings.scheduler import STEP_WEIGHT

    lines = []
    for weight in (f"{STEP_WEIGHT:g}", "1"):
        lines += [f"embedding step weight {weight}:", *_decode_server(rounds, weight)]
    return lines


def _decode_server(rounds: int, weight: str) -> list[str]:
    import os

    from compat_serve.models.embedded import embedded_model_path

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_small_bert(root)
        file = root / "models.yaml"
        file.write_text(
            "models:\n"
            f"  - id: chat\n    path: {embedded_model_path()}\n    preload: true\n"
            f"  - id: embed\n    path: {model_dir}\n    preload: true\n"
        )
        port = free_port()
        cmd = [str(BIN / "compat-serve"), "--models", str(file), "--memory-budget", "4GiB",
               "--port", str(port), "--kv-memory", "64MB", "--cache-memory", "64MB",
               "--no-prefix-cache", "--log-level", "warning"]  # fmt: skip
        os.environ["COMPAT_SERVE_EMBEDDING_STEP_WEIGHT"] = weight
        try:
            server = _spawn("compat-serve", cmd, root, port)
        finally:
            del os.environ["COMPAT_SERVE_EMBEDDING_STEP_WEIGHT"]
        try:
            _wait_ready(server, "/health", 300)
            return _decode_rounds(server.base_url, rounds)
        finally:
            server.stop()


def _decode_tok_s(client: httpx.Client, base: str) -> float:
    body = {
        "model": "chat",
        "max_tokens": 96,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Count from 1 to 100, separated by commas."}],
    }
    result = stream_chat(client, base, body)
    assert result.status == 200 and result.first_token is not None, result.error
    tokens = result.completion_tokens
    return (tokens - 1) / (result.done - result.first_token)


def _embed_loop(base: str, batch: list[str], stop: threading.Event, done: list[int]) -> None:
    """Embedding batches back to back until `stop`; inputs embedded added to `done[0]`."""
    with httpx.Client(timeout=300) as client:
        while not stop.is_set():
            r = client.post(f"{base}/v1/embeddings", json={"model": "embed", "input": batch})
            assert r.status_code == 200, r.text
            done[0] += len(batch)


def _decode_rounds(base: str, rounds: int) -> list[str]:
    batch = texts(32)
    client = make_client()
    _decode_tok_s(client, base)  # warm-up
    warm = httpx.post(f"{base}/v1/embeddings", json={"model": "embed", "input": batch}, timeout=300)
    assert warm.status_code == 200, warm.text
    alone: list[float] = []
    beside: list[float] = []
    embedded: list[float] = []
    solo: list[float] = []  # embedding inputs/s with the chat model idle
    for _ in range(rounds):
        started = time.perf_counter()
        reply = httpx.post(f"{base}/v1/embeddings", json={"model": "embed", "input": batch * 2})
        assert reply.status_code == 200, reply.text
        solo.append(2 * len(batch) / (time.perf_counter() - started))
        alone.append(_decode_tok_s(client, base))
        stop = threading.Event()
        done = [0]
        # Two clients, so a batch is always queued while the other's response travels:
        # the embedding engine never idles and the host's fairness alone decides.
        workers = [
            threading.Thread(target=_embed_loop, args=(base, batch, stop, done), daemon=True)
            for _ in range(EMBEDDING_CLIENTS)
        ]
        for worker in workers:
            worker.start()
        time.sleep(0.5)  # the embedding stream is under way
        started = time.perf_counter()
        count0 = done[0]
        beside.append(_decode_tok_s(client, base))
        embedded.append((done[0] - count0) / (time.perf_counter() - started))
        stop.set()
        for worker in workers:
            worker.join()
        log(f"decode alone {alone[-1]:.1f} tok/s, beside embeddings {beside[-1]:.1f} tok/s")
    ratio = statistics.median(beside) / statistics.median(alone)
    return [
        "chat decode (SmolLM2-135M, 96 greedy tokens) with embedding batches of 32 x 128 "
        f"tokens from {EMBEDDING_CLIENTS} clients beside it, median (min-max) of {rounds} "
        "alternating rounds",
        f"{'decode alone, tok/s':<38} {spread(alone)}",
        f"{'decode beside embeddings, tok/s':<38} {spread(beside)}",
        f"{'embedding inputs/s meanwhile':<38} {spread(embedded)}",
        f"{'embedding inputs/s, chat idle':<38} {spread(solo)}",
        f"{'ratio (target >= 0.80)':<38} {ratio:8.2f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=("throughput", "decode"))
    args = parser.parse_args()
    lines: list[str] = []
    if args.only != "decode":
        lines += [*throughput(args.rounds), ""]
    if args.only != "throughput":
        lines += decode_beside_embeddings(args.rounds)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
