"""Rebuild a `tokenizers.Tokenizer` from a GGUF's `tokenizer.ggml.*` metadata.

Two vocabulary kinds, as llama.cpp writes them:

- byte-level BPE (`tokenizer.ggml.model == "gpt2"`): SmolLM, Llama 3, Qwen 2/2.5/3 (dense and
  MoE), DeepSeek V2/V3/R1, Mistral's tekken, Phi-4... The pre-tokenizer follows
  `tokenizer.ggml.pre` (gguf_tokenizer_bpe.py);
- SentencePiece BPE (`tokenizer.ggml.model == "llama"`): Llama 2, Mistral/Mixtral, Phi-3,
  Gemma 2/3, with scores, token types and byte fallback (gguf_tokenizer_spm.py).

Token type 3 (control) becomes a special added token, type 4 (user-defined) a plain added
token, so `<|im_start|>` written in prompt text encodes to its single id; in a SentencePiece
vocabulary the unknown token (type 2) is special too, as in the families' tokenizer.json.
Anything else is refused with the name llama.cpp wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as BackendTokenizer

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.gguf_metadata import GGUFMetadata
from compat_serve.models.gguf_tokenizer_bpe import (
    KNOWN_BPE_PRES,
    build_bpe_backend,
    bytes_to_unicode,
)
from compat_serve.models.gguf_tokenizer_spm import build_spm_backend, spm_spelling
from compat_serve.models.tokenizer import Tokenizer

__all__ = ["GGUFTokenizerInfo", "build_gguf_tokenizer", "bytes_to_unicode"]

TOKEN_TYPE_NORMAL: Final = 1
TOKEN_TYPE_UNKNOWN: Final = 2
TOKEN_TYPE_CONTROL: Final = 3
TOKEN_TYPE_USER_DEFINED: Final = 4

# Gemma: SentencePiece merges follow the piece order, not the scores, and no prefix space.
_GEMMA: Final = frozenset({"gemma", "gemma2", "gemma3", "gemma3n"})
# llama.cpp adds BOS for these when the file does not say (`tokenizer_add_bos = true`).
_BOS_BY_DEFAULT_PRES: Final = frozenset({"llama3", "llama-v3", "llama-bpe", "tekken"})


@dataclass(frozen=True)
class GGUFTokenizerInfo:
    """The tokenizer and the facts around it that a GGUF's metadata states."""

    tokenizer: Tokenizer
    chat_template: str | None
    pre: str
    add_bos_token: bool


def _floats(meta: GGUFMetadata, key: str) -> list[float] | None:
    value = meta.get(key)
    if value is None:
        return None
    return [float(v) for v in (value if isinstance(value, list) else [value])]


def _backend(
    meta: GGUFMetadata, model: str | None, tokens: list[str], types: list[int]
) -> tuple[BackendTokenizer, str, bool]:
    """(pipeline, pre-tokenizer name, whether llama.cpp adds BOS by default)."""
    pre = meta.get_str("tokenizer.ggml.pre", "") or ""
    if model == "gpt2":
        if pre not in KNOWN_BPE_PRES:
            raise ModelLoadError(
                f"{meta.path}: GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported"
            )
        merges = meta.get_str_list("tokenizer.ggml.merges")
        if merges is None:
            raise ModelLoadError(f"{meta.path}: GGUF has no tokenizer.ggml.merges")
        return (
            build_bpe_backend(tokens, types, merges, pre),
            pre or "default",
            (pre in _BOS_BY_DEFAULT_PRES),
        )
    if model == "llama":
        unk_id = meta.get_int("tokenizer.ggml.unknown_token_id", 0)
        unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
        gemma = meta.get_str("general.architecture") in _GEMMA
        backend = build_spm_backend(
            tokens,
            types,
            _floats(meta, "tokenizer.ggml.scores"),
            # Gemma never prefixes a space (its files say so; older ones may not).
            add_space_prefix=bool(meta.get_bool("tokenizer.ggml.add_space_prefix", not gemma)),
            rank_by_position=gemma,
            unk_token=unk,
        )
        return backend, pre or "default", True
    raise ModelLoadError(
        f"{meta.path}: GGUF tokenizer model {model!r} (tokenizer.ggml.model) is not supported "
        "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
    )


def _post_processor(
    bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None, add_eos: bool
) -> processors.TemplateProcessing | None:
    """BOS (and EOS where the file asks) around encoded text when special tokens are added."""
    head = [bos] if bos is not None and bos_id is not None else []
    tail = [eos] if add_eos and eos is not None and eos_id is not None else []
    if not head and not tail:
        return None
    special = [
        (t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t in head + tail and i is not None
    ]
    single = " ".join([*head, "$A", *tail])
    pair = " ".join([*head, "$A", *tail, *head, "$B", *tail])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def build_gguf_tokenizer(meta: GGUFMetadata) -> GGUFTokenizerInfo:
    """Build the tokenizer a GGUF file describes."""
    model = meta.get_str("tokenizer.ggml.model")
    tokens = meta.get_str_list("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelLoadError(f"{meta.path}: GGUF has no tokenizer.ggml.tokens")
    types = meta.get_int_list("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens)
    backend, pre, bos_by_default = _backend(meta, model, tokens, types)
    spm = model == "llama"

    special_types = {TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN} if spm else {TOKEN_TYPE_CONTROL}
    vocab = backend.get_vocab(with_added_tokens=False)
    control = [
        AddedToken(tok, special=True, normalized=False)
        for tok, ttype in zip(tokens, types, strict=False)
        if ttype in special_types
    ]
    # A user-defined piece SentencePiece would spell with "▁" stays a vocabulary piece.
    user_defined = [
        AddedToken(tok, special=False, normalized=False)
        for tok, ttype in zip(tokens, types, strict=False)
        if ttype == TOKEN_TYPE_USER_DEFINED and (not spm or spm_spelling(tok, ttype) == tok)
    ]
    if control:
        backend.add_special_tokens(control)
    if user_defined:
        backend.add_tokens(user_defined)

    def token_at(key: str) -> str | None:
        tid = meta.get_int(key)
        return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else None

    if spm:
        bos_id = meta.get_int("tokenizer.ggml.bos_token_id", 1)
        eos_id = meta.get_int("tokenizer.ggml.eos_token_id", 2)
        bos = tokens[bos_id] if bos_id is not None and 0 <= bos_id < len(tokens) else None
        eos = tokens[eos_id] if eos_id is not None and 0 <= eos_id < len(tokens) else None
        unk = token_at("tokenizer.ggml.unknown_token_id") or (tokens[0] if tokens else None)
    else:
        bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
        unk = token_at("tokenizer.ggml.unknown_token_id")
    add_bos = (
        bool(meta.get_bool("tokenizer.ggml.add_bos_token", bos_by_default)) and bos is not None
    )
    add_eos = bool(meta.get_bool("tokenizer.ggml.add_eos_token", False))
    post = _post_processor(
        bos if add_bos else None,
        vocab.get(bos, meta.get_int("tokenizer.ggml.bos_token_id")) if bos else None,
        eos,
        vocab.get(eos, meta.get_int("tokenizer.ggml.eos_token_id")) if eos else None,
        add_eos,
    )
    if post is not None:
        backend.post_processor = post
    extra_eos = [
        tid
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if (tid := meta.get_int(key)) is not None and 0 <= tid < len(tokens)
    ]
    chat_template = meta.get_str("tokenizer.chat_template")
    tokenizer = Tokenizer(
        backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=token_at("tokenizer.ggml.padding_token_id"),
        unk_token=unk,
        extra_eos_token_ids=extra_eos,
        add_bos_token=add_bos,
        add_eos_token=add_eos and eos is not None,
        chat_template=chat_template,
    )
    return GGUFTokenizerInfo(
        tokenizer=tokenizer, chat_template=chat_template, pre=pre, add_bos_token=add_bos
    )
