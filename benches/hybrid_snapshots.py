"""How much of a repeated or continued prompt hybrid and sliding-window models read from
the prefix cache (issue #44), in-process on the tiny random models of tests/tiny_models.py.

1. An exact repeat: the LFM2-style hybrid with a 300-token prompt and gemma3_text with a
   593-token one, each sent twice; the second request's cached tokens are printed
   (at best prompt - 1: one token is computed for its logits).
2. A 10-turn agent replay on the hybrid: each turn echoes the previous prompt and reply
   and appends a tool result; per turn, the cached tokens over the shared prefix (the
   common prefix with the previous turn's prompt + reply, minus the token the cache never
   holds: the reply's last, never fed).
3. The state snapshot and state point memory the cache holds after the replay, per
   session (one session ran).

Usage: .venv/bin/python benches/hybrid_snapshots.py
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from pathlib import Path
from typing import Any

from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.types import EngineRequest, SamplingParams, Usage
from compat_serve.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.tiny_models import tiny_model

BLOCK = 16
_ids = itertools.count()


def run(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], Usage]:
    async def go() -> tuple[list[int], Usage]:
        request = EngineRequest(
            f"b{next(_ids)}", tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0)
        )
        events = [e async for e in engine.submit(request)]
        usage = events[-1].usage
        assert usage is not None, events[-1].error
        return [t for e in events for t in e.token_ids], usage

    return asyncio.run(go())


def words(tokenizer: Any, n: int, tag: str) -> list[int]:
    """Exactly `n` token ids of filler text."""
    ids: list[int] = tokenizer.encode(" ".join(f"{tag} item {i} is noted." for i in range(n)))
    assert len(ids) >= n
    return ids[:n]


def exact_repeat(like: Any, model_type: str, length: int) -> None:
    engine = Engine(tiny_model(model_type, like), EngineConfig(block_size=BLOCK))
    engine.start()
    try:
        prompt = words(like.tokenizer, length, model_type)
        run(engine, prompt, 4)
        _, usage = run(engine, prompt, 4)
        print(f"{model_type}: exact repeat reads {usage.cached_tokens}/{length}")
    finally:
        engine.shutdown()


def agent_replay(like: Any, turns: int = 10) -> None:
    engine = Engine(tiny_model("lfm2", like), EngineConfig(block_size=BLOCK))
    engine.start()
    try:
        tok = like.tokenizer
        prompt = tok.encode("<|im_start|>system\nYou are an agent with tools.<|im_end|>\n")
        prompt += words(tok, 200, "context")
        previous: list[int] = []
        ratios = []
        for turn in range(turns):
            prompt += tok.encode(f"<|im_start|>user\nTool result {turn}: ok.<|im_end|>\n")
            prompt += tok.encode("<|im_start|>assistant\n")
            shared = 0
            for a, b in zip(previous, prompt, strict=False):
                if a != b:
                    break
                shared += 1
            shared = min(shared, len(prompt) - 1)
            reply, usage = run(engine, prompt, 12)
            if turn:
                ratios.append(usage.cached_tokens / shared)
                print(
                    f"turn {turn}: prompt {len(prompt)}, shared {shared}, "
                    f"read {usage.cached_tokens} ({usage.cached_tokens / shared:.3f})"
                )
            # The cache holds the reply's K/V except its last token (never fed).
            previous = prompt + reply[:-1]
            prompt = prompt + reply + tok.encode("<|im_end|>\n")
        print(f"lfm2 replay: min read/shared {min(ratios):.3f} over {turns - 1} turns")
        prefix = engine.prefix
        assert prefix is not None
        store, points = prefix.store, getattr(prefix, "points", None)
        print(
            f"state memory after one {turns}-turn session: {store.num_snapshots} block "
            f"snapshots {getattr(store, 'snapshot_bytes', '?')} B, "
            f"{len(points) if points is not None else 0} state points "
            f"{points.bytes_in_use if points is not None else 0} B"
        )
    finally:
        engine.shutdown()


def main() -> None:
    like = load_model(None, dtype="float32")
    exact_repeat(like, "lfm2", 300)
    exact_repeat(like, "gemma3_text", 593)
    exact_repeat(like, "gemma3_text", 300)  # off the 16-token grid
    agent_replay(like)


if __name__ == "__main__":
    main()
