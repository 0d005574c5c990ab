"""Seeded random-logit walks through a grammar on the embedded model's vocabulary.

No forward passes: logits are random normals, the grammar's mask forbids tokens, and the
sampled token is consumed — what the engine does, with noise in place of the model.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

import numpy as np

from compat_serve.engine.constraints import Grammars
from compat_serve.engine.types import Grammar
from compat_serve.models.types import LoadedModel


@dataclass(frozen=True)
class Vocab:
    grammars: Grammars
    eos_ids: frozenset[int]


def embedded_vocab(model: LoadedModel) -> Vocab:
    tokenizer = model.tokenizer
    grammars = Grammars(tokenizer, tokenizer.backend.get_vocab_size())
    return Vocab(grammars, frozenset(tokenizer.eos_token_ids))


@dataclass
class Walk:
    pieces: list[str]  # the text of each token, as a detokenizer would emit it
    complete: bool  # the grammar finished (end of sequence) within the step bound

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _allowed(mask: bytes, width: int) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
    return bits[:width].astype(bool)


def random_walk(
    vocab: Vocab,
    grammar: Grammar,
    seed: int,
    *,
    max_steps: int = 400,
    closer_bias: float = 4.0,
) -> Walk:
    """Sample under `grammar` with random logits until it ends or `max_steps` tokens.

    Tokens that contain a quote or a closing bracket get `closer_bias` added so strings
    and containers end within the bound; everything else is uniform noise.
    """
    grammars = vocab.grammars
    table = grammars.table
    width = grammars.logits_width
    bias = _closer_bias(grammars, closer_bias)
    matcher = grammars.compile(grammar)
    rng = np.random.default_rng(seed)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    pieces: list[str] = []
    for _ in range(max_steps):
        if matcher.is_stopped():
            return Walk(pieces, True)
        allowed = _allowed(matcher.mask(), width)
        logits = rng.normal(size=width) + bias
        logits[~allowed] = -np.inf
        token = int(np.argmax(logits))
        matcher.consume(token)
        if token in vocab.eos_ids:
            continue
        piece = decoder.decode(table.token_bytes(token))
        if piece:
            pieces.append(piece)
    return Walk(pieces, matcher.is_stopped())


_BIAS_CACHE: dict[int, np.ndarray] = {}


def _closer_bias(grammars: Grammars, amount: float) -> np.ndarray:
    key = id(grammars.table)
    if key not in _BIAS_CACHE:
        width = grammars.logits_width
        bias = np.zeros(width)
        for token in range(min(width, grammars.table.vocab_size)):
            raw = grammars.table.token_bytes(token)
            if any(c in raw for c in b'"}]'):
                bias[token] = 1.0
        _BIAS_CACHE[key] = bias
    return _BIAS_CACHE[key] * amount
