"""Every GGUF family's tokenizer, rebuilt from a vocab-only GGUF, equals the family's own.

Each family's tokenizer is built the way the family's is (tests/gguf_vocab.py): byte-level BPE
families as a tokenizer.json with their normalizer and pre-tokenizer, trained here; SentencePiece
families as a tiny SentencePiece model, with SentencePiece itself and the tokenizer.json
transformers converts it to as references. The GGUF carries what llama.cpp's converter writes;
`build_gguf_tokenizer` sees only that.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import mlx.core as mx
import pytest

from compat_serve.chat.prompt import PromptBuilder
from compat_serve.models.errors import ModelLoadError
from compat_serve.models.gguf_metadata import GGUFMetadata
from compat_serve.models.gguf_tokenizer import GGUFTokenizerInfo, build_gguf_tokenizer
from tests.gguf_vocab import CORPUS, FAMILIES, Built, build_family, write_vocab_gguf
from tests.shared_data import templates_dir

if TYPE_CHECKING:
    from compat_serve.models.tokenizer import Tokenizer


def _load(path: Path) -> GGUFTokenizerInfo:
    _, raw = mx.load(str(path), return_metadata=True)
    return build_gguf_tokenizer(GGUFMetadata(raw, path=str(path)))


def _template(file: str | None) -> str | None:
    return None if file is None else (templates_dir() / file).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Built, GGUFTokenizerInfo]]:
    directory = tmp_path_factory.mktemp("gguf_vocab")
    out = {}
    for name, family in FAMILIES.items():
        b = build_family(family, directory, _template(family.template))
        out[name] = (b, _load(b.gguf_path))
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_ids_and_text_equal_the_familys_tokenizer(
    built: dict[str, tuple[Built, GGUFTokenizerInfo]], name: str
) -> None:
    b, info = built[name]
    tok = info.tokenizer
    nfc = b.family.normalizer is not None
    for text in CORPUS:
        ids = tok.encode(text)
        assert ids == b.reference.encode(text, add_special_tokens=False).ids, text
        if b.sentencepiece is not None:
            assert ids == b.sentencepiece.encode(text), text
        decoded = tok.decode(ids, skip_special_tokens=False)
        assert decoded == b.reference.decode(ids, skip_special_tokens=False), text
        assert decoded == (unicodedata.normalize("NFC", text) if nfc else text)
    # Not a vacuous pass: the corpus does reach multi-character pieces and, in SentencePiece
    # vocabularies, byte fallback (an emoji the tiny vocabulary lacks).
    pieces = [tok.backend.id_to_token(i) or "" for text in CORPUS for i in tok.encode(text)]
    assert max(len(p) for p in pieces) >= 4
    if b.family.kind == "spm":
        assert any(p.startswith("<0x") for p in pieces)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_special_tokens_and_bos(
    built: dict[str, tuple[Built, GGUFTokenizerInfo]], name: str
) -> None:
    b, info = built[name]
    tok, family = info.tokenizer, b.family
    vocab = b.reference.get_vocab()
    for special in family.special:
        assert tok.encode(special) == [vocab[special]], special
        assert vocab[special] in tok.special_token_ids
        mixed = f"Hi{special} there\n{special}"
        assert tok.encode(mixed) == b.reference.encode(mixed, add_special_tokens=False).ids
        decoded = b.reference.decode(b.reference.encode(mixed, add_special_tokens=False).ids)
        assert tok.decode(tok.encode(mixed)) == decoded
    for added in family.user_defined:
        if added in vocab and not added.strip("\u2581"):
            continue  # whitespace runs: pieces of the vocabulary, checked by the corpus
        assert tok.encode(added) == [vocab[added]], added
    with_bos = tok.encode("Hi", add_special_tokens=True)
    assert info.add_bos_token is family.add_bos
    if family.add_bos:
        assert with_bos == [vocab[family.bos], *tok.encode("Hi")]
    else:
        assert with_bos == tok.encode("Hi")
    assert tok.eos_token == family.eos
    assert tok.eos_token_id == vocab[family.eos]


@pytest.mark.parametrize("name", ["qwen3", "mistral-7b", "gemma3"])
def test_stream_decode_matches_decode(
    built: dict[str, tuple[Built, GGUFTokenizerInfo]], name: str
) -> None:
    tok = built[name][1].tokenizer
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=True)
        stream = tok.decode_stream(skip_special_tokens=True)
        assert "".join(stream.step(i) for i in ids) == tok.decode(ids), text


def _jinja_render(template: str, messages: list[dict[str, Any]], tok: Tokenizer) -> str:
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages,
        add_generation_prompt=True,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
    )


MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Write 1234567 in words."},
]


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.template])
def test_chat_template_from_metadata(
    built: dict[str, tuple[Built, GGUFTokenizerInfo]], name: str
) -> None:
    """The template survives the GGUF string round trip and renders through the Rust
    templating as Jinja2 renders the family's file; its control tokens encode whole."""
    b, info = built[name]
    source = _template(b.family.template)
    assert info.chat_template == source
    assert source is not None
    rendered = PromptBuilder(info.chat_template, info.tokenizer).render(MESSAGES)
    assert rendered == _jinja_render(source, MESSAGES, info.tokenizer)
    ids = info.tokenizer.encode(rendered)
    assert ids == b.reference.encode(rendered, add_special_tokens=False).ids
    specials = {
        t.content: i for i, t in b.reference.get_added_tokens_decoder().items() if t.special
    }
    markers = [t for t in specials if t in rendered]
    assert markers, rendered
    for marker in markers:
        assert ids.count(specials[marker]) == rendered.count(marker), marker
    # SentencePiece with a prefix space writes "▁" after each control token (llama.cpp and
    # the legacy tokenizer.json alike), so the text comes back as the reference decodes it.
    expected = b.reference.decode(ids, skip_special_tokens=False)
    assert info.tokenizer.decode(ids, skip_special_tokens=False) == expected
    if not b.family.dummy_prefix or b.family.kind == "bpe":
        assert expected == rendered


def test_sentencepiece_defaults_follow_llama_cpp(tmp_path: Path) -> None:
    """Without add_bos_token / add_space_prefix keys a SentencePiece vocabulary adds BOS and a
    leading "▁", as llama.cpp does; add_eos_token appends EOS."""
    from tests.gguf_vocab import _spm_vocab, spm_model

    family = FAMILIES["mistral-7b"]
    tokens, types, scores = _spm_vocab(spm_model(family))
    path = tmp_path / "bare.gguf"
    write_vocab_gguf(
        path, family, tokens=tokens, types=types, scores=scores, omit=("add_bos", "space_prefix")
    )
    tok = _load(path).tokenizer
    assert tok.add_bos_token
    ids = tok.encode("Hello", add_special_tokens=True)
    assert ids[0] == tok.bos_token_id == 1
    assert (tok.backend.id_to_token(ids[1]) or "").startswith("\u2581")
    write_vocab_gguf(path, family, tokens=tokens, types=types, scores=scores, add_eos=True)
    tok = _load(path).tokenizer
    assert tok.encode("Hello", add_special_tokens=True)[-1] == tok.eos_token_id == 2
    # Gemma's files say add_space_prefix = false; one that does not still gets none.
    gemma = FAMILIES["gemma3"]
    tokens, types, scores = _spm_vocab(spm_model(gemma))
    write_vocab_gguf(path, gemma, tokens=tokens, types=types, scores=scores, omit=("space_prefix",))
    gemma_tok = _load(path).tokenizer
    first = gemma_tok.backend.id_to_token(gemma_tok.encode("Hello")[0]) or ""
    assert not first.startswith("\u2581"), first


@pytest.mark.parametrize(
    ("model", "pre", "named"),
    [("t5", "default", "'t5'"), ("gpt2", "jais-70b", "'jais-70b'"), ("bert", "", "'bert'")],
)
def test_unsupported_tokenizer_is_a_one_line_refusal(
    tmp_path: Path, model: str, pre: str, named: str
) -> None:
    family = replace(FAMILIES["qwen2.5"], pre=pre)
    path = write_vocab_gguf(
        tmp_path / "x.gguf",
        family,
        tokens=["a", "b", "ab"],
        types=[1, 1, 1],
        merges=["a b"],
        model=model,
    )
    with pytest.raises(ModelLoadError) as caught:
        _load(path)
    message = str(caught.value)
    assert named in message
    assert "\n" not in message


@pytest.mark.parametrize("name", ["gemma3", "phi3", "deepseek-v3"])
def test_converted_directory_keeps_the_tokenizer(
    built: dict[str, tuple[Built, GGUFTokenizerInfo]], name: str, tmp_path: Path
) -> None:
    """What `convert-gguf` writes (models/convert.py: the backend's tokenizer.json and a
    tokenizer_config.json) loads back, in compat-serve and in transformers (what mlx-lm uses),
    to the same ids and text."""
    from transformers import AutoTokenizer

    from compat_serve.models.convert import _tokenizer_config
    from compat_serve.models.hf_tokenizer import load_hf_tokenizer

    info = built[name][1]
    info.tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    config = _tokenizer_config(info.tokenizer, info.chat_template, 4096)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    ours = load_hf_tokenizer(tmp_path, {}).tokenizer
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in [*CORPUS, "Hi" + "".join(FAMILIES[name].special)]:
        ids = info.tokenizer.encode(text, add_special_tokens=True)
        assert ours.encode(text, add_special_tokens=True) == ids, text
        assert hf(text)["input_ids"] == ids, text
        expected = info.tokenizer.decode(ids)
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids) == expected, text


def test_unused_padding_tokens_are_never_produced(
    built: dict[str, tuple[Built, GGUFTokenizerInfo]], tmp_path: Path
) -> None:
    """llama.cpp pads a SentencePiece vocabulary to the model's size with unused "[PADn]"
    tokens (Phi-3: 32011 pieces, 32064 logits): ids stay those of the unpadded vocabulary."""
    from tests.gguf_vocab import _spm_vocab, spm_model

    family = FAMILIES["phi3"]
    tokens, types, scores = _spm_vocab(spm_model(family))
    pads = [f"[PAD{i}]" for i in range(len(tokens), len(tokens) + 8)]
    path = write_vocab_gguf(
        tmp_path / "padded.gguf",
        family,
        tokens=[*tokens, *pads],
        types=[*types, *[5] * len(pads)],  # 5: UNUSED
        scores=[*scores, *[-10000.0] * len(pads)],
    )
    tok = _load(path).tokenizer
    reference = built["phi3"][1].tokenizer
    for text in [*CORPUS, " ".join(pads)]:
        ids = tok.encode(text)
        assert ids == reference.encode(text), text
        assert max(ids, default=0) < len(tokens)
    assert tok.vocab_size == len(tokens) + len(pads)


def test_every_known_pre_tokenizer_builds_and_round_trips(tmp_path: Path) -> None:
    """Each `tokenizer.ggml.pre` name compat-serve accepts compiles to a working pipeline:
    byte-level, so any text (here the corpus) decodes back (NFC for Qwen's)."""
    from compat_serve.models.gguf_tokenizer_bpe import KNOWN_BPE_PRES, bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "\u0120\u0120"]  # "ĠĠ": two spaces
    for pre in sorted(KNOWN_BPE_PRES):
        family = replace(FAMILIES["qwen2.5"], pre=pre, special=(), bos=None, eos=None)
        path = write_vocab_gguf(
            tmp_path / "pre.gguf", family, tokens=tokens, types=[1] * 257, merges=["Ġ Ġ"]
        )
        tok = _load(path).tokenizer
        for text in CORPUS:
            nfc = pre in ("qwen2", "qwen35")
            expected = unicodedata.normalize("NFC", text) if nfc else text
            assert tok.decode(tok.encode(text)) == expected, (pre, text)
