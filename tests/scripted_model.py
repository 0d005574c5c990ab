"""A scripted model: a real mlx `nn.Module` that writes predetermined tokens.

It runs through the real engine (its mlx-lm cache, batching, sampling, detokenizer) with
the embedded model's real tokenizer and any chat template, so end-to-end tests can make
"the model" emit exact tool-call or reasoning markup.

How: its one layer's cache (`mlx_lm` `KVCache`, merged into `BatchKVCache` by the
batching engine) stores every input token id + 1 as keys (0 is left padding). Logits for
a row come from that history: the generation starts after the last occurrence of
`reply_start` (e.g. the ids of `<|im_start|>assistant\\n`); the n-th generated token is
`script[n]`, then EOS. Scripts are chosen per request by a trigger: the first
`(trigger ids, script)` whose trigger occurs in the prompt.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx_lm.models.cache import KVCache

from compat_serve.models.types import LoadedModel

Rule = tuple[tuple[int, ...], list[int]]
# Floats of V per position (unread): with K that makes 0.5 KB a position, a small real
# model's size, so the engine sizes its prefix-cache block pool as for one. At 8 bytes a
# position the pool held tens of millions of blocks: ~1.2 CPU-s and gigabytes per engine.
VALUE_WIDTH = 127


def _find_last(history: np.ndarray, needle: Sequence[int]) -> int:
    """Index just after the last occurrence of `needle` in `history`, or -1."""
    n = len(needle)
    if n == 0:
        return len(history)
    if len(history) < n:
        return -1
    # Every window of n tokens compared at once: a Python scan of a Codex-sized prompt
    # (8.7k tokens) took ~3 ms, once per rule and per decode step (0.5 ms now).
    windows = np.lib.stride_tricks.sliding_window_view(history, n)
    hits = np.flatnonzero((windows == np.asarray(needle)).all(axis=1))
    return int(hits[-1]) + n if hits.size else -1


class ScriptedModel(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        reply_start: Sequence[int],
        rules: Sequence[Rule],
        eos_id: int,
        *,
        step_delay_s: float = 0.0,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.reply_start = tuple(reply_start)
        self.rules = list(rules)
        self.eos_id = eos_id
        self.step_delay_s = step_delay_s
        # One real parameter so the module looks like a model to MLX tooling.
        self.layers = [nn.Linear(1, 1)]

    def make_cache(self) -> list[Any]:
        return [KVCache()]

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        assert cache is not None, "the scripted model needs its cache"
        stored = (inputs.astype(mx.float32) + 1)[:, None, :, None]
        values = mx.broadcast_to(stored, (*stored.shape[:3], VALUE_WIDTH))
        keys, _ = cache[0].update_and_fetch(stored, values)
        histories = np.array(keys[:, 0, :, 0]).astype(np.int64)
        batch, width = inputs.shape[0], inputs.shape[1]
        tokens = np.empty((batch, width), dtype=np.uint32)
        for row in range(batch):
            history = histories[row][histories[row] > 0] - 1
            # Each position predicts from the history up to it (a speculative verify feeds
            # several tokens at once and reads every position).
            tokens[row] = self._next_tokens(history, width)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        # One-hot logits (100 at the scripted token), left lazy: the logits of a prefill
        # chunk's leading positions are never evaluated (the engine feeds the last token
        # in a forward of its own), so no [width, vocab] block is built per chunk.
        hot = mx.array(tokens)[:, :, None] == mx.arange(self.vocab_size, dtype=mx.uint32)
        return hot.astype(mx.float32) * 100.0

    def _next_tokens(self, history: np.ndarray, width: int) -> list[int]:
        """The token after each of the last `width` positions of `history`."""
        start = _find_last(history, self.reply_start)
        if start < 0:
            return [self.eos_id] * width
        prompt = history[:start]
        script = next(
            (s for trigger, s in self.rules if not trigger or _find_last(prompt, trigger) >= 0),
            None,
        )
        tokens: list[int] = []
        for end in range(len(history) - width + 1, len(history) + 1):
            produced = end - start
            ok = script is not None and 0 <= produced < len(script)
            tokens.append(script[produced] if ok else self.eos_id)  # type: ignore[index]
        return tokens


def embedded_tokenizer_only() -> LoadedModel:
    """What `scripted_model` keeps of the embedded model (its tokenizer, its fallback
    sampling), read from the GGUF's metadata alone: no weight is read or dequantized, so a
    scripted server process (tests/e2e/scripted_serve.py) starts without the model's load.
    Its `model` is a placeholder that `scripted_model` replaces."""
    from compat_serve.models.embedded import (
        EMBEDDED_FILE,
        EMBEDDED_SAMPLING,
        EMBEDDED_SAMPLING_SOURCE,
        embedded_model_path,
    )
    from compat_serve.models.gguf_header import read_header
    from compat_serve.models.gguf_metadata import GGUFMetadata
    from compat_serve.models.gguf_tokenizer import build_gguf_tokenizer

    path = str(embedded_model_path())
    info = build_gguf_tokenizer(GGUFMetadata(read_header(path).metadata, path=path))
    return LoadedModel(
        model=nn.Module(),
        tokenizer=info.tokenizer,
        chat_template=info.chat_template,
        context_length=8192,
        name="embedded tokenizer",
        source=f"embedded:{EMBEDDED_FILE}",
        dtype="float32",
        model_type="llama",
        fallback_sampling=dict(EMBEDDED_SAMPLING),
        fallback_sampling_source=EMBEDDED_SAMPLING_SOURCE,
    )


def scripted_model(
    embedded: LoadedModel,
    template: str,
    replies: Sequence[tuple[str, str | Sequence[int]]],
    *,
    reply_start: str = "<|im_start|>assistant\n",
    step_delay_s: float = 0.0,
    context_length: int = 8192,
) -> LoadedModel:
    """The embedded tokenizer with `template`, replying `text` (or exact token ids) to
    prompts containing `trigger` (first match wins; "" matches every prompt)."""
    tokenizer = embedded.tokenizer.with_chat_template(template)
    eos = tokenizer.token_to_id("<|im_end|>")
    assert eos is not None and eos in tokenizer.eos_token_ids
    rules = [
        (
            tuple(tokenizer.encode(trigger)) if trigger else (),
            tokenizer.encode(text) if isinstance(text, str) else list(text),
        )
        for trigger, text in replies
    ]
    model = ScriptedModel(
        tokenizer.vocab_size,
        tokenizer.encode(reply_start),
        rules,
        eos,
        step_delay_s=step_delay_s,
    )
    return dataclasses.replace(
        embedded,
        model=model,
        tokenizer=tokenizer,
        chat_template=template,
        context_length=context_length,
        name="scripted",
        source="scripted",
        dtype="float32",
        model_type="scripted",
        extra={},
    )
