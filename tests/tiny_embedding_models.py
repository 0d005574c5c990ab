"""Tiny randomly initialised embedding and reranker model directories, written as users
have them: config.json, a real `tokenizers` tokenizer.json + tokenizer_config.json,
model.safetensors with Hugging Face's parameter names, and the sentence-transformers files
(modules.json, 1_Pooling/config.json, config_sentence_transformers.json,
sentence_bert_config.json).

Kinds (`TINY_KINDS`): a Qwen3-Embedding-shaped decoder (last-token pooling, Normalize, a
query instruction), BERT (mean + Normalize), ModernBERT (CLS + Normalize, a sliding window
shorter than the test inputs), a Qwen3-Reranker-shaped causal LM and its
sequence-classification conversion (same weights, a `score` row = "yes" - "no"), and
cross-encoders: BERT, XLM-RoBERTa (bge-reranker's architecture) and ModernBERT.

Encoder weights are drawn with numpy from a fixed seed (so layer norms and biases are not
their trivial 1/0 init); decoder weights are mlx-lm's own random init under a fixed seed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

TINY_KINDS = (
    "qwen3_embedding",
    "bert_embedding",
    "modernbert_embedding",
    "qwen3_reranker",
    "qwen3_reranker_seq_cls",
    "bert_cross_encoder",
    "xlm_roberta_cross_encoder",
    "modernbert_cross_encoder",
)

# Words of the tiny vocabularies (and the BPE training text): enough for short code-search
# and memory queries; anything else falls back to sub-words or [UNK].
WORDS = (
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "is",
    "it",
    "for",
    "on",
    "with",
    "as",
    "and",
    "or",
    "not",
    "this",
    "that",
    "how",
    "what",
    "where",
    "which",
    "function",
    "class",
    "method",
    "file",
    "code",
    "search",
    "query",
    "document",
    "memory",
    "agent",
    "server",
    "model",
    "python",
    "rust",
    "test",
    "error",
    "parse",
    "token",
    "cache",
    "prefix",
    "block",
    "hash",
    "request",
    "response",
    "value",
    "list",
    "dict",
    "string",
    "number",
    "return",
    "import",
    "def",
    "fn",
    "let",
    "mut",
    "self",
    "none",
    "true",
    "false",
    "embedding",
    "rerank",
    "vector",
    "score",
    "relevant",
    "passage",
    "answer",
    "question",
    "find",
    "read",
    "write",
    "paris",
    "france",
    "capital",
    "city",
    "river",
    "apple",
    "orange",
    "fruit",
    "blue",
    "green",
    "sky",
    "sea",
)
QUERY_INSTRUCTION = (
    "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
)
_BPE_TEXT = [
    *(" ".join(WORDS[i : i + 9]) for i in range(0, len(WORDS), 9)),
    "Judge whether the Document meets the requirements based on the Query and the Instruct",
    'provided. Note that the answer can only be "yes" or "no".',
    "<Instruct>: Given a web search query\n<Query>: x\n<Document>: y",
    *["yes\nno\nyes no\n"] * 20,
]


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def wordpiece_tokenizer() -> Any:
    """A BERT-style WordPiece tokenizer: [CLS] a [SEP] (b [SEP], type 1)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    chars = "abcdefghijklmnopqrstuvwxyz0123456789"
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    pieces = [*specials, *WORDS, *chars, *(f"##{c}" for c in chars), *".,:;!?()[]{}=_-+*/'\""]
    vocab = {piece: i for i, piece in enumerate(dict.fromkeys(pieces))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tok.decoder = decoders.WordPiece()
    return tok


def bpe_tokenizer(specials: list[str], template: tuple[str, str] | None) -> Any:
    """A byte-level BPE trained on `_BPE_TEXT` (Qwen- and RoBERTa-style), `specials`
    first; `template` = (single, pair) post-processor templates, or none."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_BPE_TEXT, trainer)
    if template is not None:
        used = [s for s in specials if s in " ".join(template)]
        tok.post_processor = processors.TemplateProcessing(
            single=template[0],
            pair=template[1],
            special_tokens=[(s, tok.token_to_id(s)) for s in used],
        )
    return tok


def _save_tokenizer(model_dir: Path, tok: Any, config: dict[str, Any]) -> int:
    model_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    _write_json(model_dir / "tokenizer_config.json", config)
    return int(tok.get_vocab_size(with_added_tokens=True))


def _sentence_transformers(
    model_dir: Path, pooling: str, *, normalize: bool, width: int, prompts: dict[str, str]
) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    _write_json(model_dir / "modules.json", modules)
    flags = {
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": pooling == "lasttoken",
        "include_prompt": True,
    }
    _write_json(
        model_dir / "1_Pooling" / "config.json", {"word_embedding_dimension": width, **flags}
    )
    _write_json(
        model_dir / "config_sentence_transformers.json",
        {"prompts": prompts, "default_prompt_name": None, "similarity_fn_name": "cosine"},
    )
    _write_json(
        model_dir / "sentence_bert_config.json", {"max_seq_length": 48, "do_lower_case": False}
    )


def _random_like(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, mx.array]:
    """Seeded random parameters: norms' weights near 1, everything else N(0, 0.1)."""
    rng = np.random.default_rng(seed)
    out: dict[str, mx.array] = {}
    for name, shape in sorted(shapes.items()):
        values = rng.normal(0.0, 0.1, size=shape).astype(np.float32)
        if ("LayerNorm" in name or "norm" in name) and name.endswith("weight"):
            values += 1.0
        out[name] = mx.array(values)
    return out


def _shapes(module: Any) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tree_flatten(module.parameters())}


def _save_weights(model_dir: Path, weights: dict[str, mx.array]) -> None:
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights, metadata={"format": "pt"})


_BERT_SIZES = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
}


def _bert_config(arch: str, model_type: str, vocab: int, **extra: Any) -> dict[str, Any]:
    return {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": vocab,
        **_BERT_SIZES,
        **extra,
    }


def write_bert_embedding(model_dir: Path) -> Path:
    from compat_serve.embeddings.encoders import BertModel, EncoderConfig

    vocab = _save_tokenizer(
        model_dir,
        wordpiece_tokenizer(),
        {"tokenizer_class": "BertTokenizer", "do_lower_case": True},
    )
    config = _bert_config("BertModel", "bert", vocab, type_vocab_size=2, pad_token_id=0)
    _write_json(model_dir / "config.json", config)
    module = BertModel(EncoderConfig.from_dict(config, 3), pooler=True)
    _save_weights(model_dir, _random_like(_shapes(module), seed=1))
    _sentence_transformers(model_dir, "mean", normalize=True, width=32, prompts={})
    return model_dir


def write_bert_cross_encoder(model_dir: Path) -> Path:
    from compat_serve.embeddings.encoders import BertForSequenceClassification, EncoderConfig

    vocab = _save_tokenizer(
        model_dir,
        wordpiece_tokenizer(),
        {"tokenizer_class": "BertTokenizer", "do_lower_case": True},
    )
    config = _bert_config(
        "BertForSequenceClassification",
        "bert",
        vocab,
        type_vocab_size=2,
        pad_token_id=0,
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
    )
    _write_json(model_dir / "config.json", config)
    module = BertForSequenceClassification(EncoderConfig.from_dict(config, 3), 1)
    _save_weights(model_dir, _random_like(_shapes(module), seed=2))
    return model_dir


def write_xlm_roberta_cross_encoder(model_dir: Path) -> Path:
    from compat_serve.embeddings.encoders import EncoderConfig, XLMRobertaForSequenceClassification

    tok = bpe_tokenizer(
        ["<s>", "<pad>", "</s>", "<unk>"], ("<s> $A </s>", "<s> $A </s> </s> $B </s>")
    )
    vocab = _save_tokenizer(model_dir, tok, {"tokenizer_class": "XLMRobertaTokenizer"})
    config = _bert_config(
        "XLMRobertaForSequenceClassification",
        "xlm-roberta",
        vocab,
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        layer_norm_eps=1e-5,
        max_position_embeddings=66,
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
    )
    _write_json(model_dir / "config.json", config)
    module = XLMRobertaForSequenceClassification(EncoderConfig.from_dict(config, None), 1)
    _save_weights(model_dir, _random_like(_shapes(module), seed=3))
    return model_dir


def _modernbert_config(vocab: int, **extra: Any) -> dict[str, Any]:
    return {
        "architectures": ["ModernBertModel"],
        "model_type": "modernbert",
        "vocab_size": vocab,
        "hidden_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "intermediate_size": 48,
        "max_position_embeddings": 64,
        "norm_eps": 1e-5,
        "norm_bias": False,
        "hidden_activation": "gelu",
        # Layer 0 and 2 global, layer 1 local with a window of +-4 tokens: shorter than
        # the tests' inputs, so the sliding mask matters.
        "global_attn_every_n_layers": 2,
        "local_attention": 8,
        "global_rope_theta": 160000.0,
        "local_rope_theta": 10000.0,
        "pad_token_id": 0,
        "cls_token_id": 2,
        "sep_token_id": 3,
        **extra,
    }


def write_modernbert_embedding(model_dir: Path) -> Path:
    from compat_serve.embeddings.modernbert import ModernBertConfig, ModernBertModel

    vocab = _save_tokenizer(
        model_dir, wordpiece_tokenizer(), {"tokenizer_class": "PreTrainedTokenizerFast"}
    )
    config = _modernbert_config(vocab)
    _write_json(model_dir / "config.json", config)
    module = ModernBertModel(ModernBertConfig.from_dict(config))
    _save_weights(model_dir, _random_like(_shapes(module), seed=4))
    _sentence_transformers(model_dir, "cls", normalize=True, width=32, prompts={})
    return model_dir


def write_modernbert_cross_encoder(model_dir: Path) -> Path:
    """`ModernBertForSequenceClassification` with mean `classifier_pooling` (gte-reranker-
    modernbert's architecture), one label."""
    from compat_serve.embeddings.modernbert import (
        ModernBertConfig,
        ModernBertForSequenceClassification,
    )

    vocab = _save_tokenizer(
        model_dir, wordpiece_tokenizer(), {"tokenizer_class": "PreTrainedTokenizerFast"}
    )
    config = _modernbert_config(
        vocab,
        architectures=["ModernBertForSequenceClassification"],
        classifier_pooling="mean",
        classifier_activation="gelu",
        classifier_bias=False,
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
    )
    _write_json(model_dir / "config.json", config)
    module = ModernBertForSequenceClassification(ModernBertConfig.from_dict(config), 1)
    _save_weights(model_dir, _random_like(_shapes(module), seed=7))
    return model_dir


QWEN3_SIZES = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}


def _qwen3_model(config: dict[str, Any], seed: int) -> Any:
    from mlx_lm.models import qwen3

    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def write_qwen3_embedding(model_dir: Path) -> Path:
    """Qwen3-Embedding-0.6B's layout: `Qwen3ForCausalLM` config, tied embeddings, the
    weights saved from `Qwen3Model` (no `model.` prefix, no head), a tokenizer that appends
    <|endoftext|>, last-token pooling + Normalize and the query instruction."""
    tok = bpe_tokenizer(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        ("$A <|endoftext|>", "$A <|endoftext|> $B:1 <|endoftext|>:1"),
    )
    vocab = _save_tokenizer(
        model_dir, tok, {"tokenizer_class": "Qwen2Tokenizer", "padding_side": "left"}
    )
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        **QWEN3_SIZES,
        "vocab_size": vocab,
        "tie_word_embeddings": True,
    }
    _write_json(model_dir / "config.json", config)
    model = _qwen3_model(config, seed=5)
    weights = dict(tree_flatten(model.model.parameters()))
    _save_weights(model_dir, weights)
    _sentence_transformers(
        model_dir,
        "lasttoken",
        normalize=True,
        width=64,
        prompts={"query": QUERY_INSTRUCTION, "document": ""},
    )
    return model_dir


def write_qwen3_reranker(model_dir: Path) -> Path:
    """Qwen3-Reranker's layout: a plain `Qwen3ForCausalLM` (untied head here, so "yes" and
    "no" have their own rows) in a directory named like the release."""
    tok = bpe_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None)
    assert tok.token_to_id("yes") is not None and tok.token_to_id("no") is not None
    vocab = _save_tokenizer(model_dir, tok, {"tokenizer_class": "Qwen2Tokenizer"})
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        **QWEN3_SIZES,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
    }
    _write_json(model_dir / "config.json", config)
    model = _qwen3_model(config, seed=6)
    _save_weights(model_dir, dict(tree_flatten(model.parameters())))
    return model_dir


def write_qwen3_reranker_seq_cls(model_dir: Path) -> Path:
    """The Qwen3-Reranker above converted the way vLLM and sentence-transformers load it
    (`Qwen3ForSequenceClassification`): the same backbone, and a one-row `score` head =
    the LM head's "yes" row minus its "no" row, so sigmoid(score) = p("yes")."""
    tok = bpe_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None)
    vocab = _save_tokenizer(model_dir, tok, {"tokenizer_class": "Qwen2Tokenizer"})
    config = {
        "architectures": ["Qwen3ForSequenceClassification"],
        **QWEN3_SIZES,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
    }
    _write_json(model_dir / "config.json", config)
    model = _qwen3_model({**config, "architectures": ["Qwen3ForCausalLM"]}, seed=6)
    head = model.lm_head.weight
    weights = {f"model.{k}": v for k, v in tree_flatten(model.model.parameters())}
    weights["score.weight"] = head[tok.token_to_id("yes")][None] - head[tok.token_to_id("no")][None]
    _save_weights(model_dir, weights)
    return model_dir


_WRITERS = {
    "qwen3_embedding": ("Qwen3-Embedding-tiny", write_qwen3_embedding),
    "bert_embedding": ("bert-embedding-tiny", write_bert_embedding),
    "modernbert_embedding": ("modernbert-embed-tiny", write_modernbert_embedding),
    "qwen3_reranker": ("Qwen3-Reranker-tiny", write_qwen3_reranker),
    "qwen3_reranker_seq_cls": ("Qwen3-Reranker-tiny-seq-cls", write_qwen3_reranker_seq_cls),
    "bert_cross_encoder": ("bert-cross-encoder-tiny", write_bert_cross_encoder),
    "xlm_roberta_cross_encoder": ("bge-reranker-tiny", write_xlm_roberta_cross_encoder),
    "modernbert_cross_encoder": ("modernbert-reranker-tiny", write_modernbert_cross_encoder),
}


def write_tiny_model(kind: str, parent: Path) -> Path:
    """Write the tiny model directory of `kind` (one of `TINY_KINDS`) under `parent`."""
    name, writer = _WRITERS[kind]
    return writer(parent / name)
