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


def _find_last(history: list[int], needle: Sequence[int]) -> int:
    """Index just after the last occurrence of `needle` in `history`, or -1."""
    n = len(needle)
    for start in range(len(history) - n, -1, -1):
        if history[start : start + n] == list(needle):
            return start + n
    return -1


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
        keys, _ = cache[0].update_and_fetch(stored, stored)
        histories = np.array(keys[:, 0, :, 0]).astype(np.int64)
        batch, width = inputs.shape[0], inputs.shape[1]
        logits = np.zeros((batch, width, self.vocab_size), dtype=np.float32)
        for row in range(batch):
            history = [int(v) - 1 for v in histories[row] if v > 0]
            logits[row, :, self._next_token(history)] = 100.0
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return mx.array(logits)

    def _next_token(self, history: list[int]) -> int:
        start = _find_last(history, self.reply_start)
        if start < 0:
            return self.eos_id
        prompt = history[:start]
        for trigger, script in self.rules:
            if not trigger or _find_last(prompt, trigger) >= 0:
                produced = len(history) - start
                return script[produced] if produced < len(script) else self.eos_id
        return self.eos_id


def scripted_model(
    embedded: LoadedModel,
    template: str,
    replies: Sequence[tuple[str, str]],
    *,
    reply_start: str = "<|im_start|>assistant\n",
    step_delay_s: float = 0.0,
    context_length: int = 8192,
) -> LoadedModel:
    """The embedded tokenizer with `template`, replying `text` to prompts containing
    `trigger` (first match wins; "" matches every prompt)."""
    tokenizer = embedded.tokenizer.with_chat_template(template)
    eos = tokenizer.token_to_id("<|im_end|>")
    assert eos is not None and eos in tokenizer.eos_token_ids
    rules = [
        (tuple(tokenizer.encode(trigger)) if trigger else (), tokenizer.encode(text))
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
