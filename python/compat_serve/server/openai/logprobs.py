"""OpenAI's `logprobs` shapes from the engine's per-token log probabilities.

Chat completions: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`.
A token's text and bytes come from the grammar engine's token table (exact bytes for
every tokenizer kind); a token that is not whole UTF-8 shows its bytes as `\\xNN`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from compat_serve._native import TokenTable
from compat_serve.engine.types import TokenLogprob
from compat_serve.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from compat_serve.server.state import ServerState

_SPECIAL_MARK = b"\xff"  # llguidance's prefix on special tokens' bytes


class TokenTexts:
    """Token id → (text, bytes), for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer, logits_width: int) -> None:
        eos = sorted(tokenizer.eos_token_ids)
        self._table = TokenTable(tokenizer.backend.to_str(), eos, logits_width)

    def token(self, token_id: int) -> tuple[str, list[int]]:
        try:
            raw = self._table.token_bytes(token_id)
        except (ValueError, IndexError):
            raw = b""
        if raw.startswith(_SPECIAL_MARK):
            raw = raw[len(_SPECIAL_MARK) :]
        return raw.decode("utf-8", errors="backslashreplace"), list(raw)


_TABLES: dict[int, tuple[Tokenizer, TokenTexts]] = {}
_LOCK = threading.Lock()


def token_texts(tokenizer: Tokenizer, logits_width: int) -> TokenTexts:
    """The table for `tokenizer`, built once (about 0.3 s for a 49k vocabulary)."""
    with _LOCK:
        cached = _TABLES.get(id(tokenizer))
        if cached is None or cached[0] is not tokenizer:
            cached = (tokenizer, TokenTexts(tokenizer, logits_width))
            _TABLES[id(tokenizer)] = cached
        return cached[1]


async def engine_token_texts(state: ServerState) -> TokenTexts:
    """The table of the model `state` serves, built off the event loop the first time."""
    engine = state.engine
    return await asyncio.to_thread(token_texts, engine.model.tokenizer, engine.logits_width)


def chat_logprobs(texts: TokenTexts, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    content = []
    for item in logprobs:
        text, raw = texts.token(item.token_id)
        top = []
        for token_id, value in item.top:
            alt_text, alt_raw = texts.token(token_id)
            top.append({"token": alt_text, "logprob": value, "bytes": alt_raw})
        content.append({"token": text, "logprob": item.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(
    texts: TokenTexts, logprobs: Sequence[TokenLogprob], text_offset: int
) -> dict[str, Any]:
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for item in logprobs:
        text, _ = texts.token(item.token_id)
        tokens.append(text)
        values.append(item.logprob)
        tops.append({texts.token(token_id)[0]: value for token_id, value in item.top})
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
