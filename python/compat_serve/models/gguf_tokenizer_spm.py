"""SentencePiece BPE vocabularies (`tokenizer.ggml.model == "llama"`) rebuilt from GGUF metadata.

Llama 2, Mistral/Mixtral (before tekken), Phi-3 and Gemma 2/3 ship a SentencePiece BPE model;
llama.cpp stores its pieces, their scores and their types (normal, unknown, control,
user-defined, unused, byte `<0xNN>`). SentencePiece merges the adjacent pair whose merged piece
has the best score; a `tokenizers` BPE does the same when its merge list is ranked by the merged
piece's score, which is how the families' tokenizer.json files were converted from their
tokenizer.model. Spaces become "▁"; with `add_space_prefix` (the default) every run of text
starts with one, as llama.cpp and the legacy Llama tokenizer.json do (also after a special
token); characters missing from the vocabulary fall back to their UTF-8 byte tokens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

from tokenizers import Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders as tk_decoders
from tokenizers import models as tk_models

__all__ = ["SPACE", "build_spm_backend", "spm_spelling"]

SPACE: Final = "\u2581"  # SentencePiece's visible space, "▁"

TOKEN_TYPE_NORMAL: Final = 1
TOKEN_TYPE_USER_DEFINED: Final = 4
TOKEN_TYPE_BYTE: Final = 6


def spm_spelling(token: str, ttype: int) -> str:
    """The piece as the tokenizer.json spells it.

    llama.cpp's converter writes a tokenizer_config added token that is not special with its
    "▁" turned back into spaces (Gemma's whitespace-run tokens come out as "  "); the pieces
    the model matches are spelled with "▁".
    """
    if ttype == TOKEN_TYPE_USER_DEFINED and token and not token.strip(" "):
        return SPACE * len(token)
    return token


def _merges(
    vocab: dict[str, int], ranks: dict[str, float], mergeable: set[str]
) -> list[tuple[str, str]]:
    """Every split of a mergeable piece into two mergeable pieces, best merged piece first."""
    # Pieces in rank order, then their splits: no sort over the (many more) merges. A
    # comprehension, since a 262k-piece vocabulary (Gemma 3) has millions of cuts to try.
    ordered = sorted(mergeable, key=lambda piece: (-ranks[piece], vocab[piece]))
    return [
        (piece[:cut], piece[cut:])
        for piece in ordered
        for cut in range(1, len(piece))
        if piece[:cut] in mergeable and piece[cut:] in mergeable
    ]


def build_spm_backend(
    tokens: Sequence[str],
    types: Sequence[int],
    scores: Sequence[float] | None,
    *,
    add_space_prefix: bool,
    rank_by_position: bool,
    unk_token: str | None,
) -> BackendTokenizer:
    """The `tokenizers` pipeline (no added tokens yet) for a SentencePiece BPE vocabulary.

    `rank_by_position`: merges follow the pieces' order in the file instead of their scores
    (Gemma: its scores do not follow its merge order, its piece order does).
    """
    vocab: dict[str, int] = {}
    ranks: dict[str, float] = {}
    mergeable: set[str] = set()
    user_defined: list[str] = []
    for index, (token, ttype) in enumerate(zip(tokens, types, strict=False)):
        spelled = spm_spelling(token, ttype)
        if spelled in vocab:
            continue
        vocab[spelled] = index
        if ttype == TOKEN_TYPE_USER_DEFINED:
            user_defined.append(spelled)
        if ttype == TOKEN_TYPE_NORMAL or spelled != token:
            mergeable.add(spelled)
            score = scores[index] if scores is not None and index < len(scores) else 0.0
            ranks[spelled] = -float(index) if rank_by_position or scores is None else score
    byte_fallback = TOKEN_TYPE_BYTE in types
    backend = BackendTokenizer(
        tk_models.BPE(
            vocab=vocab,
            merges=_merges(vocab, ranks, mergeable),
            unk_token=unk_token if unk_token in vocab else None,
            fuse_unk=True,
            byte_fallback=byte_fallback,
            # A user-defined piece is isolated below and must come out whole.
            ignore_merges=bool(user_defined),
        )
    )
    escape = normalizers.Replace(" ", SPACE)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if add_space_prefix else escape
    )
    if user_defined:
        # SentencePiece emits user-defined pieces whole (longest first), never merged into
        # their neighbours: Gemma's whitespace runs "▁▁", "▁▁▁"...
        longest_first = sorted(user_defined, key=len, reverse=True)
        pattern = "|".join(re.escape(piece) for piece in longest_first)
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    steps: list[tk_decoders.Decoder] = [tk_decoders.Replace(SPACE, " ")]
    if byte_fallback:
        steps.append(tk_decoders.ByteFallback())
    steps.append(tk_decoders.Fuse())
    if add_space_prefix:
        steps.append(tk_decoders.Strip(" ", 1, 0))
    backend.decoder = tk_decoders.Sequence(steps)
    return backend
