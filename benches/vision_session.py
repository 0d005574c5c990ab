"""A session whose first turn carries an image (#18): turn-2 TTFT vs turn-1 TTFT, and
how many times the vision encoder runs per session.

A compat-serve binary serves a tiny random Qwen2.5-VL (mlx-vlm's classes, the embedded
model's tokenizer; tests/tiny_vlm.py) written to a temp dir. Each session: turn 1 = a long
system prompt (Claude Code's are thousands of tokens), an image and a question; turn 2 =
turn 1 + the answer + a follow-up, with the image re-sent (as clients do). Sessions
differ in their first system line and their image, so turn 1 is cold every time. TTFT is
measured on streamed chat completions (max_tokens 1); encoder runs are read from
`/metrics` (`compat_vision_encoder_runs_total`) before and after each session.

Targets (#18): turn-2 TTFT <= 1/10 of turn 1; 1 encoder run per session. The model is
tiny, so the image costs little to encode: the ratio here mostly measures prefill of the
text around it, the real-model ratio is better.
"""

from __future__ import annotations

import argparse
import base64
import io
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from _servers import ROOT, log, make_client, start_compat_serve, stream_chat

sys.path.insert(0, str(ROOT))


def data_url(seed: int, size: int) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def system_prompt(session: int, rules: int) -> str:
    lines = [f"Session {session}. You are a coding assistant in a terminal."]
    lines += [f"Rule {i}: keep edits small, run the tests, explain briefly." for i in range(rules)]
    return "\n".join(lines)


def encoder_runs(client: httpx.Client, base_url: str) -> float:
    text = client.get(f"{base_url}/metrics").text
    match = re.search(r"^compat_vision_encoder_runs_total (\S+)$", text, re.MULTILINE)
    if match is None:
        raise RuntimeError("no compat_vision_encoder_runs_total in /metrics")
    return float(match.group(1))


def turn(client: httpx.Client, base_url: str, messages: list[dict[str, Any]]) -> Any:
    body = {"model": "m", "messages": messages, "max_tokens": 1, "temperature": 0}
    result = stream_chat(client, base_url, body)
    if result.status != 200:
        raise RuntimeError(f"HTTP {result.status}: {result.error}")
    return result


def session(
    client: httpx.Client, base_url: str, index: int, rules: int, size: int
) -> tuple[float, float, float, int, int, int]:
    image = {"type": "image_url", "image_url": {"url": data_url(index, size)}}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt(index, rules)},
        {"role": "user", "content": [image, {"type": "text", "text": "What is wrong here?"}]},
    ]
    before = encoder_runs(client, base_url)
    first = turn(client, base_url, messages)
    messages += [
        {"role": "assistant", "content": first.text or "Let me look."},
        {"role": "user", "content": "Fix it, then run the tests."},
    ]
    second = turn(client, base_url, messages)
    runs = encoder_runs(client, base_url) - before
    return (
        first.ttft,
        second.ttft,
        runs,
        first.prompt_tokens,
        second.prompt_tokens,
        second.cached_tokens or 0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=5)
    parser.add_argument("--rules", type=int, default=120, help="system prompt lines")
    parser.add_argument("--image-size", type=int, default=112, help="pixels per side")
    args = parser.parse_args()

    from tests.tiny_vlm import write_qwen25_vl_dir

    from compat_serve.models.loader import load_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_qwen25_vl_dir(Path(tmp) / "tiny-qwen2.5-vl", load_model(None))
        server = start_compat_serve(model_dir, [], Path(tmp))
        try:
            client = make_client()
            session(client, server.base_url, 10_000, args.rules, args.image_size)  # warm-up
            rows = [
                session(client, server.base_url, i, args.rules, args.image_size)
                for i in range(args.sessions)
            ]
        finally:
            server.stop()
    t1 = [r[0] for r in rows]
    t2 = [r[1] for r in rows]
    ratios = [b / a for a, b in zip(t1, t2, strict=True)]
    runs = [r[2] for r in rows]
    log(f"model: tiny Qwen2.5-VL (random), image {args.image_size}px, {args.sessions} sessions")
    log(f"turn 1 prompt {rows[0][3]} tokens; turn 2 prompt {rows[0][4]}, cached {rows[0][5]}")
    for name, values in (("turn-1 TTFT s", t1), ("turn-2 TTFT s", t2), ("turn2/turn1", ratios)):
        log(
            f"{name:>14}: median {statistics.median(values):.4f} "
            f"(min {min(values):.4f}, max {max(values):.4f})"
        )
    log(f"vision-encoder runs per session: {runs} (target 1)")
    verdict = statistics.median(ratios) <= 0.1 and all(r == 1 for r in runs)
    log(f"targets met: {verdict}")


if __name__ == "__main__":
    main()
