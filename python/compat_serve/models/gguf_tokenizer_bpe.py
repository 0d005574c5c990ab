# ruff: noqa: RUF001  (the regexes and the corpus are full of look-alike characters on purpose)
"""Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) rebuilt from GGUF metadata.

llama.cpp names the pre-tokenizer in `tokenizer.ggml.pre` and keeps the regexes for each
name in `src/llama-vocab.cpp` (`llm_tokenizer_bpe`): a list of regexes applied one after the
other, each splitting every piece into its matches and the text between them. That is a
`tokenizers` `Sequence` of `Split(..., "isolated")` followed by a `ByteLevel` without its own
regex, which is how the families' own tokenizer.json files spell it. Where llama.cpp rewrote a
regex for std::regex (case-insensitive groups, `\\p{Lu}` classes emulated by lookaheads), the
original tokenizer.json regex is used: the `tokenizers` regex engine (Oniguruma) has them.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Final

from tokenizers import Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders as tk_decoders
from tokenizers import models as tk_models

__all__ = ["KNOWN_BPE_PRES", "build_bpe_backend", "bytes_to_unicode"]

TOKEN_TYPE_CONTROL: Final = 3
TOKEN_TYPE_USER_DEFINED: Final = 4
_ADDED_TYPES: Final = frozenset({TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED})

_CONTRACTIONS: Final = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2: Final = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3: Final = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2: Final = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35: Final = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN: Final = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O: Final = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek LLM / V2 / V2-Lite (`deepseek-llm`): letters of the Latin, Greek, Cyrillic...
# blocks, ASCII punctuation, trailing spaces, CJK runs and digit runs, each its own piece.
_DEEPSEEK_LLM: Final = (
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    "[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
)
_DEEPSEEK_CODER: Final = (
    "[\r\n]",
    r"\s?\p{L}+",
    r"\s?\p{P}+",
    "[一-龥ࠀ-一가-퟿]+",
    r"\p{N}",
)
# DeepSeek V3 / R1 (`deepseek-v3`): 1-3 digit groups, CJK/kana runs, then words and punctuation.
_DEEPSEEK_V3: Final = (
    r"\p{N}{1,3}",
    "[一-龥\u3040-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_FALCON: Final = (
    r"[\p{P}\$\+<=>\^~\|`]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    "[0-9][0-9][0-9]",
)


def _names(names: str, regexes: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    return dict.fromkeys(names.split(), regexes)


# `tokenizer.ggml.pre` -> the regexes applied in order, as in llama.cpp's llama-vocab.cpp.
_SPLITS: Final[dict[str, tuple[str, ...]]] = {
    **_names(
        "llama3 llama-v3 llama-bpe dbrx smaug-bpe falcon3 falcon-h1 pixtral chatglm-bpe "
        "midm-2.0 lfm2",
        (_LLAMA3,),
    ),
    **_names("qwen2 deepseek-r1-qwen stablelm2 hunyuan megrez kormo", (_QWEN2,)),
    **_names("qwen35", (_QWEN35,)),
    **_names("tekken", (_TEKKEN,)),
    **_names("gpt-4o llama4 minimax-m2", (_GPT4O,)),
    **_names("deepseek-llm", _DEEPSEEK_LLM),
    **_names("deepseek-coder", _DEEPSEEK_CODER),
    **_names("deepseek-v3 hunyuan-dense", _DEEPSEEK_V3),
    **_names("falcon", _FALCON),
    **_names("starcoder refact command-r smollm codeshell exaone minerva", (r"\p{N}", _GPT2)),
    **_names("gpt2 gpt-2 phi-2 mpt olmo jais default", (_GPT2,)),
}
# Pre-tokenizers whose tokenizer.json looks a whole piece up in the vocabulary before merging
# (llama.cpp's `tokenizer_ignore_merges`).
_IGNORE_MERGES: Final = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "tekken", "dbrx", "smaug-bpe", "falcon3", "pixtral"}
)
# Qwen's tokenizer.json NFC-normalizes before splitting (llama.cpp does not, so a decomposed
# "é" tokenizes differently there; the model was trained on the tokenizer.json's ids).
_NFC: Final = frozenset({"qwen2", "qwen35"})

KNOWN_BPE_PRES: Final = frozenset(_SPLITS) | {""}


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


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in ("", "default", "gpt2", "gpt-2"):
        # GPT-2's own tokenizer.json: the byte-level pre-tokenizer with its built-in regex.
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM's tokenizer.json: each digit alone, then the GPT-2 regex.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    splits: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False)
        for regex in _SPLITS[pre]
    ]
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def build_bpe_backend(
    tokens: Sequence[str], types: Sequence[int], merges_raw: Sequence[str], pre: str
) -> BackendTokenizer:
    """The `tokenizers` pipeline (no added tokens yet) for a byte-level BPE vocabulary."""
    # Normal tokens are spelled in the byte alphabet already; respell any that are not (some
    # converters store raw text) so BPE can reach them. Control and user-defined tokens keep
    # their spelling (llama.cpp writes them as text, "    " for a run of spaces): they are
    # matched whole as added tokens under their own id, never built by merges.
    byte_map = bytes_to_unicode()
    alphabet = set(byte_map.values())
    vocab: dict[str, int] = {}
    for index, (token, ttype) in enumerate(zip(tokens, types, strict=False)):
        spelled = token
        if ttype not in _ADDED_TYPES and not set(token) <= alphabet:
            spelled = "".join(byte_map[b] for b in token.encode("utf-8"))
        vocab.setdefault(spelled, index)
    merges: list[tuple[str, str]] = []
    for merge in merges_raw:
        left, sep, right = merge.partition(" ")
        if sep:
            merges.append((left, right))
    backend = BackendTokenizer(
        tk_models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=None,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre in _IGNORE_MERGES,
        )
    )
    if pre in _NFC:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = tk_decoders.ByteLevel()
    return backend
