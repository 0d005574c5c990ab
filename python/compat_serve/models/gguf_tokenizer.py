"""Rebuild a `tokenizers.Tokenizer` from a GGUF's `tokenizer.ggml.*` metadata.

Supported: byte-level BPE (`tokenizer.ggml.model == "gpt2"`, what llama.cpp writes for
GPT-2-style vocabularies: SmolLM, Llama 3, Qwen 2...). The pre-tokenizer follows llama.cpp's
`tokenizer.ggml.pre` (`llama-vocab.cpp`):

- `smollm`: each digit on its own, then the GPT-2 byte-level regex (the same as the
  `Digits(individual_digits=True)` + `ByteLevel` of SmolLM's own tokenizer.json);
- `gpt2`/`default`: the GPT-2 regex;
- `llama-bpe`/`llama3`/...: the Llama 3 regex, vocabulary matched before merges;
- `qwen2`/`deepseek-r1-qwen`: the Qwen 2 regex.

Token type 3 (control) becomes a special added token, type 4 (user-defined) a plain added
token, so `<|im_start|>` written in prompt text encodes to its single id.
SentencePiece vocabularies (`tokenizer.ggml.model == "llama"`) are not supported yet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from typing import Final

from tokenizers import AddedToken, Regex, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders as tk_decoders
from tokenizers import models as tk_models

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.gguf_metadata import GGUFMetadata
from compat_serve.models.tokenizer import Tokenizer

__all__ = ["GGUFTokenizerInfo", "build_gguf_tokenizer", "bytes_to_unicode"]

logger = logging.getLogger(__name__)

TOKEN_TYPE_NORMAL: Final = 1
TOKEN_TYPE_CONTROL: Final = 3
TOKEN_TYPE_USER_DEFINED: Final = 4

_GPT2_SPLIT: Final = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_LLAMA3_PRES: Final = frozenset(
    {"llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe", "falcon3", "pixtral"}
)
_QWEN2_PRES: Final = frozenset({"qwen2", "deepseek-r1-qwen"})
_GPT2_PRES: Final = frozenset({"gpt2", "default", ""})


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


@dataclass(frozen=True)
class GGUFTokenizerInfo:
    """The tokenizer and the facts around it that a GGUF's metadata states."""

    tokenizer: Tokenizer
    chat_template: str | None
    pre: str
    add_bos_token: bool


def _pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """(pre-tokenizer, ignore_merges) for llama.cpp's `tokenizer.ggml.pre` value."""
    if pre == "smollm":
        return (
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            ),
            False,
        )
    if pre in _LLAMA3_PRES or pre in _QWEN2_PRES:
        regex = _LLAMA3_SPLIT if pre in _LLAMA3_PRES else _QWEN2_SPLIT
        return (
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            ),
            pre in _LLAMA3_PRES,
        )
    if pre not in _GPT2_PRES:
        logger.warning(
            "GGUF pre-tokenizer %r is not known to compat-serve; using the GPT-2 regex "
            "(token ids may differ from llama.cpp on some text)",
            pre,
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False


def build_gguf_tokenizer(meta: GGUFMetadata) -> GGUFTokenizerInfo:
    """Build the tokenizer a GGUF file describes."""
    model = meta.get_str("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(
            f"{meta.path}: GGUF tokenizer model {model!r} is not supported "
            "(only byte-level BPE, tokenizer.ggml.model == 'gpt2'); "
            "use an MLX/HF model directory instead"
        )
    tokens = meta.get_str_list("tokenizer.ggml.tokens")
    merges_raw = meta.get_str_list("tokenizer.ggml.merges")
    if tokens is None or merges_raw is None:
        raise ModelLoadError(f"{meta.path}: GGUF has no tokenizer.ggml.tokens/merges")
    types = meta.get_int_list("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens)
    pre = meta.get_str("tokenizer.ggml.pre", "default") or "default"

    # Normal tokens are spelled in the byte alphabet already; respell any that are not (some
    # converters store raw text) so BPE can reach them. Control tokens keep their spelling:
    # they are matched whole as added tokens, never built by merges.
    alphabet = set(bytes_to_unicode().values())
    byte_map = bytes_to_unicode()
    vocab: dict[str, int] = {}
    for index, (token, ttype) in enumerate(zip(tokens, types, strict=False)):
        spelled = token
        if ttype != TOKEN_TYPE_CONTROL and not set(token) <= alphabet:
            spelled = "".join(byte_map[b] for b in token.encode("utf-8"))
        vocab.setdefault(spelled, index)
    merges: list[tuple[str, str]] = []
    for merge in merges_raw:
        left, sep, right = merge.partition(" ")
        if sep:
            merges.append((left, right))

    pre_tokenizer, ignore_merges = _pre_tokenizer(pre)
    backend = BackendTokenizer(
        tk_models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=None,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=ignore_merges,
        )
    )
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = tk_decoders.ByteLevel()

    control = [
        AddedToken(tok, special=True, normalized=False)
        for tok, ttype in zip(tokens, types, strict=False)
        if ttype == TOKEN_TYPE_CONTROL
    ]
    user_defined = [
        AddedToken(tok, special=False, normalized=False)
        for tok, ttype in zip(tokens, types, strict=False)
        if ttype == TOKEN_TYPE_USER_DEFINED
    ]
    if control:
        backend.add_special_tokens(control)
    if user_defined:
        backend.add_tokens(user_defined)

    def token_at(key: str) -> str | None:
        tid = meta.get_int(key)
        return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else None

    bos = token_at("tokenizer.ggml.bos_token_id")
    eos = token_at("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get_bool("tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        bos_id = vocab.get(bos, meta.get_int("tokenizer.ggml.bos_token_id"))
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
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
        unk_token=token_at("tokenizer.ggml.unknown_token_id"),
        extra_eos_token_ids=extra_eos,
        add_bos_token=add_bos,
        chat_template=chat_template,
    )
    return GGUFTokenizerInfo(
        tokenizer=tokenizer, chat_template=chat_template, pre=pre, add_bos_token=add_bos
    )
