# ruff: noqa: RUF001  (the regexes and the corpus are full of look-alike characters on purpose)
"""Tiny tokenizers of each GGUF family, and vocab-only GGUF files written the way llama.cpp's
`convert_hf_to_gguf.py` writes them (tests/python/test_gguf_tokenizers.py).

- Byte-level BPE families (Qwen 2/2.5/3, Llama 3, DeepSeek V2 and V3, Mistral tekken): a
  `tokenizers` tokenizer with the family's tokenizer.json normalizer and pre-tokenizer, its
  BPE trained here on a small multilingual corpus, the family's special tokens added.
- SentencePiece families (Llama 2 / Mistral / Mixtral, Phi-3, Gemma 2/3): a tiny SentencePiece
  BPE model trained here with the family's trainer options (byte fallback, dummy prefix or
  not, its special pieces), plus the tokenizer.json transformers converts it to.

`write_vocab_gguf` writes tokens, token types, merges or scores, special ids and the chat
template with the `gguf` package (what llama.cpp's converter uses), and no tensors.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import sentencepiece as spm
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

SPACE = "\u2581"

# What the families' tokens must survive: several scripts, emoji (ZWJ, skin tone, flags),
# code with tabs and indentation, numbers, repeated spaces and newlines, a decomposed accent.
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "I'm sure you've seen it; they'll say we'd DON'T it's HTTPServer getURL",
    "Grüße aus München: Über die Brücke gehen Mädchen und Jungen, straße.",
    "Le cœur a ses raisons que la raison ne connaît point, n'est-ce pas ? À bientôt.",
    "我们今天去北京看长城，天气很好。",
    "今日は良い天気ですね。東京タワーに行きましょう！カタカナ",
    "안녕하세요, 만나서 반갑습니다. 한국어를 배우고 있어요.",
    "Привет, мир! Как дела? Съешь же ещё этих мягких французских булок.",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "Emoji: 😀🎉👍🏽 and ❤️ family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "def fib(n: int) -> int:\n\tif n < 2:\n\t\treturn n\n\treturn fib(n - 1) + fib(n - 2)\n",
    "function add(a, b) {\n    return a + b; // sum\n}\nconsole.log(add(1234567, 3.14159));",
    'fn main() {\n    let v: Vec<u32> = (0..10).collect();\n    println!("{:?}", v);\n}\n',
    "Numbers: 1234567 and 3.14159, 2026-11-27, 0x1F, 1e-5, 100,000 and 42.",
    "Spaces:    four   three  two\n\n\nnewlines\r\nand\ttabs\t\tend   ",
    "  leading spaces and a trailing newline\n",
    "Cafe\u0301 de\u0301ja\u0300 vu",
    "x" * 40 + " " + "        " * 3 + "indented",
]


@dataclass(frozen=True)
class Family:
    """How one family's tokenizer is built and what llama.cpp writes for it."""

    name: str
    arch: str  # general.architecture
    kind: str  # "bpe" (tokenizer.ggml.model "gpt2") or "spm" ("llama")
    pre: str = "default"
    template: str | None = None  # a file of ../shared/templates
    special: tuple[str, ...] = ()  # control tokens (BPE: added; SPM: pieces)
    user_defined: tuple[str, ...] = ()  # added tokens that are not special
    bos: str | None = None
    eos: str | None = None
    add_bos: bool = False
    # BPE: the family's tokenizer.json pieces.
    normalizer: dict[str, Any] | None = None
    splits: tuple[str, ...] = ()
    ignore_merges: bool = False
    # SPM: trainer options.
    dummy_prefix: bool = True
    spm_ids: dict[str, Any] = field(default_factory=dict)


_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_V2 = (
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    "[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
)
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[一-龥\u3040-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_DS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
_SPM_LLAMA_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1}
_SPM_GEMMA_IDS = {
    "pad_id": 0,
    "eos_id": 1,
    "bos_id": 2,
    "unk_id": 3,
    "pad_piece": "<pad>",
    "eos_piece": "<eos>",
    "bos_piece": "<bos>",
}

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family(
            "qwen2.5",
            "qwen2",
            "bpe",
            "qwen2",
            "Qwen-Qwen2.5-7B-Instruct.jinja",
            _CHATML,
            eos="<|im_end|>",
            normalizer={"type": "NFC"},
            splits=(_QWEN2,),
        ),
        Family(
            "qwen3",
            "qwen3",
            "bpe",
            "qwen2",
            "Qwen-Qwen3-0.6B.jinja",
            _CHATML,
            ("<think>", "</think>", "<tool_call>", "</tool_call>"),
            eos="<|im_end|>",
            normalizer={"type": "NFC"},
            splits=(_QWEN2,),
        ),
        Family(
            "qwen3moe",
            "qwen3moe",
            "bpe",
            "qwen2",
            "Qwen-Qwen3-Coder.jinja",
            _CHATML,
            # Whitespace runs as added tokens, which llama.cpp writes as text.
            ("<think>", "</think>", "    ", "\t\t"),
            eos="<|im_end|>",
            normalizer={"type": "NFC"},
            splits=(_QWEN2,),
        ),
        Family(
            "llama3",
            "llama",
            "bpe",
            "llama-bpe",
            "meta-llama-Llama-3.3-70B-Instruct.jinja",
            (
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
            ),
            bos="<|begin_of_text|>",
            eos="<|eot_id|>",
            add_bos=True,
            splits=(_LLAMA3,),
            ignore_merges=True,
        ),
        Family(
            "deepseek-v2",
            "deepseek2",
            "bpe",
            "deepseek-llm",
            "deepseek-ai-DeepSeek-V2.jinja",
            _DS,
            bos=_DS[0],
            eos=_DS[1],
            add_bos=True,
            splits=_DEEPSEEK_V2,
        ),
        Family(
            "deepseek-v3",
            "deepseek2",
            "bpe",
            "deepseek-v3",
            "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
            (*_DS, "<｜User｜>", "<｜Assistant｜>"),
            ("<think>", "</think>"),
            bos=_DS[0],
            eos=_DS[1],
            add_bos=True,
            splits=_DEEPSEEK_V3,
        ),
        Family(
            "mistral-nemo",
            "llama",
            "bpe",
            "tekken",
            "mistralai-Mistral-Nemo-Instruct-2407.jinja",
            ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]"),
            bos="<s>",
            eos="</s>",
            add_bos=True,
            splits=(_TEKKEN,),
            ignore_merges=True,
        ),
        Family(
            "phi4",
            "phi3",
            "bpe",
            "gpt-4o",
            "microsoft-phi-4.jinja",
            ("<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"),
            eos="<|im_end|>",
            splits=(_GPT4O,),
        ),
        Family(
            "mistral-7b",
            "llama",
            "spm",
            template="mistralai-Mistral-7B-Instruct-v0.1.jinja",
            bos="<s>",
            eos="</s>",
            add_bos=True,
            spm_ids=_SPM_LLAMA_IDS,
        ),
        Family(
            "phi3",
            "phi3",
            "spm",
            template="microsoft-Phi-3.5-mini-instruct.jinja",
            special=("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
            bos="<s>",
            eos="<|endoftext|>",
            add_bos=False,
            spm_ids=_SPM_LLAMA_IDS,
        ),
        Family(
            "gemma2",
            "gemma2",
            "spm",
            template="google-gemma-2-2b-it.jinja",
            special=("<start_of_turn>", "<end_of_turn>"),
            user_defined=("\n\n", SPACE * 2, SPACE * 4, SPACE * 8),
            bos="<bos>",
            eos="<eos>",
            add_bos=True,
            dummy_prefix=False,
            spm_ids=_SPM_GEMMA_IDS,
        ),
        Family(
            "gemma3",
            "gemma3",
            "spm",
            template="google-gemma-3n.jinja",
            special=("<start_of_turn>", "<end_of_turn>", "<start_of_image>"),
            user_defined=(SPACE * 2, SPACE * 3, SPACE * 4),
            bos="<bos>",
            eos="<eos>",
            add_bos=True,
            dummy_prefix=False,
            spm_ids=_SPM_GEMMA_IDS,
        ),
    ]
}

# Training text: the corpus, so that most pieces are real merges, and more of each script.
_TRAINING = [
    *CORPUS,
    "Die Würde des Menschen ist unantastbar. Sie zu achten und zu schützen ist Pflicht.",
    "Tous les êtres humains naissent libres et égaux en dignité et en droits.",
    "人人生而自由，在尊严和权利上一律平等。他们赋有理性和良心。",
    "すべての人間は、生まれながらにして自由であり、かつ、尊厳と権利とについて平等である。",
    "모든 인간은 태어날 때부터 자유로우며 그 존엄과 권리에 있어 동등하다.",
    "Все люди рождаются свободными и равными в своем достоинстве и правах.",
    "يولد جميع الناس أحرارًا متساوين في الكرامة والحقوق.",
    "import os\n\nfor i in range(10):\n    print(i, os.getcwd())\n",
    "const xs = [1, 2, 3].map((x) => x * 2);\nlet total = 0;\n",
    "impl Display for Point {\n    fn fmt(&self, f: &mut Formatter) -> Result {\n    }\n}\n",
]


def _pre_tokenizer(family: Family) -> pre_tokenizers.PreTokenizer:
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(pattern=Regex(r), behavior="isolated") for r in family.splits
    ]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def bpe_reference(family: Family, vocab_size: int = 1200) -> Tokenizer:
    """The family's tokenizer.json shape with a BPE trained on the corpus."""
    tok = Tokenizer(models.BPE())
    if family.normalizer is not None:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(family)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(family.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TRAINING * 2, trainer)
    if family.ignore_merges:
        # tokenizer.json's `"ignore_merges": true` (Llama 3, tekken).
        spec = json.loads(tok.to_str())
        spec["model"]["ignore_merges"] = True
        tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.user_defined])
    return tok


def spm_model(family: Family, vocab_size: int = 900) -> bytes:
    """A tiny SentencePiece BPE model trained with the family's options."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_TRAINING * 2),
        model_writer=out,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        # Below 1: rare characters (some CJK, emoji) stay out and go through byte fallback.
        character_coverage=0.98,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        add_dummy_prefix=family.dummy_prefix,
        normalization_rule_name="identity",
        control_symbols=list(family.special),
        user_defined_symbols=list(family.user_defined),
        hard_vocab_limit=False,
        minloglevel=2,
        **family.spm_ids,
    )
    return out.getvalue()


def spm_reference(model: bytes) -> Tokenizer:
    """The tokenizer.json transformers converts the SentencePiece model to."""
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    proto = import_protobuf().ModelProto()
    proto.ParseFromString(model)
    vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
    tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    assert tok is not None
    specials = [p.piece for p in proto.pieces if p.type in (2, 3)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def _bpe_vocab(tok: Tokenizer) -> tuple[list[str], list[int], list[str]]:
    """Tokens, types and merges as llama.cpp's `_set_vocab_gpt2` writes them."""
    vocab = tok.get_vocab(with_added_tokens=True)
    added = tok.get_added_tokens_decoder()
    tokens = [""] * len(vocab)
    types = [gguf.TokenType.NORMAL] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
        if index in added:
            special = added[index].special
            types[index] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
    merges = [
        " ".join(m) if isinstance(m, list) else m
        for m in json.loads(tok.to_str())["model"]["merges"]
    ]
    return tokens, [int(t) for t in types], merges


def _spm_vocab(model: bytes) -> tuple[list[str], list[int], list[float]]:
    """Tokens, types and scores as llama.cpp's `_create_vocab_sentencepiece` writes them, with
    the tokenizer_config pass: special pieces become control, the other added pieces
    user-defined with their "▁" written as spaces."""
    sp = spm.SentencePieceProcessor(model_proto=model)
    tokens, types, scores = [], [], []
    for i in range(sp.GetPieceSize()):
        piece = sp.IdToPiece(i)
        ttype = gguf.TokenType.NORMAL
        if sp.IsUnknown(i):
            ttype = gguf.TokenType.UNKNOWN
        elif sp.IsControl(i):
            ttype = gguf.TokenType.CONTROL
        elif sp.IsUnused(i):
            ttype = gguf.TokenType.UNUSED
        elif sp.IsByte(i):
            ttype = gguf.TokenType.BYTE
        tokens.append(piece)
        types.append(int(ttype))
        scores.append(float(sp.GetScore(i)))
    proto_types = _proto_types(model)
    for i, ptype in enumerate(proto_types):
        if ptype == 4:  # USER_DEFINED in the model proto: an added, non-special token
            tokens[i] = tokens[i].replace(SPACE, " ")
            types[i] = int(gguf.TokenType.USER_DEFINED)
    return tokens, types, scores


def _proto_types(model: bytes) -> list[int]:
    from transformers.convert_slow_tokenizer import import_protobuf

    proto = import_protobuf().ModelProto()
    proto.ParseFromString(model)
    return [p.type for p in proto.pieces]


def write_vocab_gguf(
    path: Path,
    family: Family,
    *,
    tokens: Sequence[str],
    types: Sequence[int],
    merges: Sequence[str] | None = None,
    scores: Sequence[float] | None = None,
    chat_template: str | None = None,
    model: str | None = None,
    pre: str | None = None,
    add_eos: bool = False,
    omit: Sequence[str] = (),
) -> Path:
    """A GGUF with only the tokenizer metadata, as llama.cpp's converter writes it
    (`omit`: "add_bos", "space_prefix" leave those keys out, as older files do)."""
    writer = gguf.GGUFWriter(str(path), family.arch)
    writer.add_tokenizer_model(model or ("gpt2" if family.kind == "bpe" else "llama"))
    writer.add_tokenizer_pre(pre if pre is not None else family.pre)
    writer.add_token_list(list(tokens))
    writer.add_token_types(list(types))
    if merges is not None:
        writer.add_token_merges(list(merges))
    if scores is not None:
        writer.add_token_scores(list(scores))
    for key, token in (("bos", family.bos), ("eos", family.eos)):
        if token is not None and token in tokens:
            getattr(writer, f"add_{key}_token_id")(list(tokens).index(token))
    if family.kind == "spm":
        writer.add_unk_token_id(family.spm_ids.get("unk_id", 0))
        if "space_prefix" not in omit:
            writer.add_add_space_prefix(family.dummy_prefix)
    if "add_bos" not in omit:
        writer.add_add_bos_token(family.add_bos)
    writer.add_add_eos_token(add_eos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclass(frozen=True)
class Built:
    """One family's reference tokenizer and its vocab-only GGUF."""

    family: Family
    reference: Tokenizer
    gguf_path: Path
    sentencepiece: spm.SentencePieceProcessor | None


def build_family(family: Family, directory: Path, chat_template: str | None) -> Built:
    if family.kind == "bpe":
        reference = bpe_reference(family)
        tokens, types, merges = _bpe_vocab(reference)
        path = write_vocab_gguf(
            directory / f"{family.name}.gguf",
            family,
            tokens=tokens,
            types=types,
            merges=merges,
            chat_template=chat_template,
        )
        return Built(family, reference, path, None)
    model = spm_model(family)
    tokens, types, scores = _spm_vocab(model)
    path = write_vocab_gguf(
        directory / f"{family.name}.gguf",
        family,
        tokens=tokens,
        types=types,
        scores=scores,
        chat_template=chat_template,
    )
    return Built(family, spm_reference(model), path, spm.SentencePieceProcessor(model_proto=model))
