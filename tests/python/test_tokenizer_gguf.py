"""The tokenizer rebuilt from the embedded GGUF's metadata (models/gguf_tokenizer.py).

Reference: transformers 5.x cannot load a GGUF tokenizer without torch
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)` imports torch in its GGUF reader; checked
in `test_transformers_gguf_loader_needs_torch`). Its torch-free *converter*
(`gguf_tokenizer_mapping.convert_gguf_tokenizer`), fed the same metadata, is an independent
implementation we compare ids against; the digit rule (llama.cpp's `smollm` pre-tokenizer,
which transformers does not special-case) is checked against fixed facts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.python.conftest import CHATML_FRANCE, TOKENIZER_CORPUS

if TYPE_CHECKING:
    from compat_serve.models.gguf_tokenizer import GGUFTokenizerInfo
    from compat_serve.models.tokenizer import Tokenizer


@pytest.mark.parametrize("text", TOKENIZER_CORPUS)
def test_round_trip(gguf_tokenizer: Tokenizer, text: str) -> None:
    ids = gguf_tokenizer.encode(text)
    assert gguf_tokenizer.decode(ids, skip_special_tokens=False) == text


# Bytes with no token in SmolLM2's byte-level vocabulary (never seen in training): text
# containing them cannot round-trip with this model, in llama.cpp or transformers either.
# 0xC0/0xC1/0xF5-0xFF never occur in UTF-8; 0xF1/0xF2 lead planes 4-11 (unassigned); the
# rest are rare ASCII control characters.
MISSING_BYTES = frozenset(
    {0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)}
)


def _representable(char: str) -> bool:
    return not MISSING_BYTES.intersection(char.encode("utf-8"))


def test_missing_byte_tokens(gguf_tokenizer: Tokenizer) -> None:
    from compat_serve.models.gguf_tokenizer import bytes_to_unicode

    vocab = gguf_tokenizer.get_vocab()
    missing = {b for b, ch in bytes_to_unicode().items() if ch not in vocab}
    assert missing == MISSING_BYTES


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8").filter(_representable), max_size=80))
def test_round_trip_any_text(gguf_tokenizer: Tokenizer, text: str) -> None:
    assert gguf_tokenizer.decode(gguf_tokenizer.encode(text), skip_special_tokens=False) == text


def test_stream_decode_matches_decode(gguf_tokenizer: Tokenizer) -> None:
    for text in TOKENIZER_CORPUS:
        ids = gguf_tokenizer.encode(text)
        stream = gguf_tokenizer.decode_stream(skip_special_tokens=False)
        assert "".join(stream.step(i) for i in ids) == text


def test_control_tokens_encode_to_single_ids(gguf_tokenizer: Tokenizer) -> None:
    assert gguf_tokenizer.encode("<|im_start|>") == [1]
    assert gguf_tokenizer.encode("<|im_end|>") == [2]
    assert gguf_tokenizer.encode("<|endoftext|>") == [0]
    ids = gguf_tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n")
    assert ids[0] == 1
    assert ids.count(1) == 1
    assert ids.count(2) == 1
    # Special tokens are dropped from decoded text unless asked for.
    assert gguf_tokenizer.decode(ids) == "user\nHi\n"


def test_special_facts(gguf_tokenizer: Tokenizer) -> None:
    tok = gguf_tokenizer
    assert tok.vocab_size == 49152
    assert tok.bos_token == "<|im_start|>"
    assert tok.bos_token_id == 1
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == 2
    assert tok.eos_token_ids == {2}
    # token_type 3 (control) in the GGUF: ids 0..16.
    assert tok.special_token_ids == set(range(17))
    assert tok.id_to_token(0) == "<|endoftext|>"
    assert tok.token_to_id("<jupyter_code>") == 13
    assert tok.convert_ids_to_tokens([28120, 216]) == ["hello", "Ġ"]
    assert tok.convert_tokens_to_ids(["<|im_end|>", "not-a-token-xyz"]) == [2, None]
    assert tok.add_bos_token is False
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


def test_digits_are_split_individually(gguf_tokenizer: Tokenizer) -> None:
    """llama.cpp's `smollm` pre-tokenizer: every digit is its own pre-token."""
    tok = gguf_tokenizer
    ids = tok.encode("12345")
    assert [tok.id_to_token(i) for i in ids] == ["1", "2", "3", "4", "5"]
    ids = tok.encode("year 2024!")
    assert [tok.id_to_token(i) for i in ids] == ["year", "Ġ", "2", "0", "2", "4", "!"]


def test_known_ids(gguf_tokenizer: Tokenizer) -> None:
    # Fixed ids (equal to transformers' independent converter, below); a regression guard.
    assert gguf_tokenizer.encode("hello 12345") == [28120, 216, 33, 34, 35, 36, 37]
    assert gguf_tokenizer.encode("The capital of France is Paris.") == [
        504,
        3575,
        282,
        4649,
        314,
        7042,
        30,
    ]


def test_chat_prompt_encoding(gguf_tokenizer_info: GGUFTokenizerInfo) -> None:
    info = gguf_tokenizer_info
    assert info.pre == "smollm"
    assert info.chat_template is not None
    assert "<|im_start|>" in info.chat_template
    ids = info.tokenizer.encode(CHATML_FRANCE)
    assert ids[0] == 1
    assert ids[-4:] == [1, 520, 9531, 198]  # "<|im_start|>" "ass" "istant" "\n"
    assert len(ids) == 37


def test_ids_match_transformers_converter(
    gguf_path: Path, gguf_tokenizer: Tokenizer, gguf_tokenizer_info: GGUFTokenizerInfo
) -> None:
    """transformers' own GGUF->tokenizers converter, fed the same metadata, gives equal ids."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    from compat_serve.models.gguf import read_gguf

    _, meta = read_gguf(str(gguf_path))
    tokenizer_dict = {
        "tokenizer_type": meta.get_str("tokenizer.ggml.model"),
        "pre_tokenizer_type": meta.get_str("tokenizer.ggml.pre"),
        "tokens": meta.get_str_list("tokenizer.ggml.tokens"),
        "merges": meta.get_str_list("tokenizer.ggml.merges"),
        "token_type": meta.get_int_list("tokenizer.ggml.token_type"),
    }
    reference, _ = convert_gguf_tokenizer(meta.architecture, tokenizer_dict)
    for text in [*TOKENIZER_CORPUS, CHATML_FRANCE]:
        assert gguf_tokenizer.encode(text) == reference.encode(text).ids, text


def test_transformers_gguf_loader_needs_torch(gguf_path: Path) -> None:
    """Documents why the comparison above uses the converter: the full loader needs torch."""
    if importlib.util.find_spec("torch") is not None:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        assert hf("hello 12345")["input_ids"] == [28120, 216, 33, 34, 35, 36, 37]
        return
    from transformers import AutoTokenizer

    with pytest.raises((ImportError, ModuleNotFoundError)):
        AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
