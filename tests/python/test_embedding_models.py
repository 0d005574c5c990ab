"""Embedding and reranker models (#37) against independent references: mlx-embeddings'
encoder modules and mlx-lm's Qwen3 run one input at a time without padding, with the
pooling, normalization and heads written out in numpy (tests/python/embedding_reference.py).
Ours must match to 1e-5 in float32, in a padded batch of different lengths and alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.python import embedding_reference as ref
from tests.tiny_embedding_models import QUERY_INSTRUCTION

if TYPE_CHECKING:
    from compat_serve.embeddings import EmbeddingModel

TOL = 1e-5
TEXTS = [
    "find the cache function",
    "paris",
    "how to parse a token in rust and return the value from the request list",
    "apple orange fruit",
]
QUERY = "what is the capital of france"
DOCUMENTS = [
    "paris is the capital city of france",
    "the apple is a fruit",
    "parse the token and return the value",
    "blue sky over the sea",
    "france",
]

# What each tiny directory's sentence-transformers files say (tests/tiny_embedding_models.py).
EMBEDDERS = {
    "bert_embedding": "mean",
    "modernbert_embedding": "cls",
    "qwen3_embedding": "lasttoken",
}
RERANKERS = (
    "bert_cross_encoder",
    "xlm_roberta_cross_encoder",
    "modernbert_cross_encoder",
    "qwen3_reranker",
)
QWEN3_RERANKERS = ("qwen3_reranker", "qwen3_reranker_seq_cls")

ModelOf = Callable[[str], "EmbeddingModel"]
DirOf = Callable[[str], Path]


def reference_embedding(kind: str, model_dir: Path, rows: list[list[int]]) -> np.ndarray:
    if kind == "qwen3_embedding":
        qwen = ref.qwen3_model(model_dir)
        hidden = [ref.decoder_hidden(qwen, row) for row in rows]
    else:
        module = ref.mlx_embeddings_encoder(model_dir)
        hidden = [ref.encoder_hidden(module, row, [0] * len(row)) for row in rows]
    return np.stack([ref.normalize_np(ref.pool_np(h, EMBEDDERS[kind])) for h in hidden])


@pytest.mark.parametrize("kind", list(EMBEDDERS))
def test_embeddings_match_the_reference_batched_and_alone(
    kind: str, tiny_embedding_model: ModelOf, tiny_embedding_dir: DirOf
) -> None:
    model = tiny_embedding_model(kind)
    assert (model.kind, model.pooling, model.normalize) == ("embedding", EMBEDDERS[kind], True)
    rows = [model.tokenize(text) for text in TEXTS]
    assert len({len(row) for row in rows}) == len(rows)  # every row padded differently
    expected = reference_embedding(kind, tiny_embedding_dir(kind), rows)

    batched = np.array(model.embed(rows))
    alone = np.stack([np.array(model.embed([row]))[0] for row in rows])
    reordered = np.array(model.embed(rows[::-1]))[::-1]

    assert batched.shape == (len(rows), model.dimensions)
    assert batched.dtype == np.float32
    np.testing.assert_allclose(batched, expected, atol=TOL, rtol=0)
    np.testing.assert_allclose(alone, expected, atol=TOL, rtol=0)
    np.testing.assert_allclose(reordered, expected, atol=TOL, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-6)
    # Distinct inputs give distinct vectors: the comparison above is not between constants.
    assert np.min(np.abs(expected[:, None] - expected[None, :]).sum(-1) + np.eye(len(rows))) > 1e-2


def test_modernbert_sliding_window_is_shorter_than_the_long_input(
    tiny_embedding_model: ModelOf, tiny_embedding_dir: DirOf
) -> None:
    """The tiny ModernBERT's local layer sees +-4 tokens: the longest test input spans more,
    so the match above covers the sliding-window mask (and the global layers' full one)."""
    config = ref.read_json(tiny_embedding_dir("modernbert_embedding") / "config.json") or {}
    longest = max(len(tiny_embedding_model("modernbert_embedding").tokenize(t)) for t in TEXTS)
    assert longest > config["local_attention"] + 1


def test_qwen3_embedding_prompts_and_special_tokens(
    tiny_embedding_model: ModelOf, tiny_embedding_dir: DirOf
) -> None:
    model = tiny_embedding_model("qwen3_embedding")
    tok = Tokenizer.from_file(str(tiny_embedding_dir("qwen3_embedding") / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    text = "where is the cache"
    assert model.tokenize(text, query=True) == tok.encode(QUERY_INSTRUCTION + text).ids
    assert model.tokenize(text) == tok.encode(text).ids
    assert model.tokenize(text)[-1] == eot  # last-token pooling reads <|endoftext|>
    assert len(model.tokenize(text, query=True)) > len(model.tokenize(text)) + 10
    # The instruction changes the vector.
    vectors = np.array(model.embed([model.tokenize(text, query=True), model.tokenize(text)]))
    assert np.abs(vectors[0] - vectors[1]).max() > 1e-3


def reference_scores(kind: str, model_dir: Path) -> tuple[list[list[int]], np.ndarray]:
    """The pair tokens each reranker's own recipe gives, and their reference scores."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    weights = ref.weights_np(model_dir)
    rows: list[list[int]] = []
    scores: list[float] = []
    if kind in QWEN3_RERANKERS:
        # Qwen3-Reranker's model card, "Usage".
        prefix = (
            "<|im_start|>system\nJudge whether the Document meets the requirements based on "
            'the Query and the Instruct provided. Note that the answer can only be "yes" or '
            '"no".<|im_end|>\n<|im_start|>user\n'
        )
        suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        instruction = "Given a web search query, retrieve relevant passages that answer the query"
        # Both formats are scored by the causal LM's own yes/no logits (the seq-cls
        # directory's weights are the same backbone and head).
        qwen = ref.qwen3_model(model_dir.with_name("Qwen3-Reranker-tiny"))
        yes, no = tok.token_to_id("yes"), tok.token_to_id("no")
        for doc in DOCUMENTS:
            body = f"<Instruct>: {instruction}\n<Query>: {QUERY}\n<Document>: {doc}"
            ids = tok.encode(prefix + body + suffix, add_special_tokens=False).ids
            rows.append(ids)
            scores.append(ref.softmax_yes_np(ref.decoder_logits(qwen, ids)[-1], yes, no))
        return rows, np.array(scores)
    prefix = {"bert_cross_encoder": "bert.", "xlm_roberta_cross_encoder": "roberta."}
    module = ref.mlx_embeddings_encoder(model_dir, prefix.get(kind, "model."))
    for doc in DOCUMENTS:
        encoding = tok.encode(QUERY, doc)
        rows.append(encoding.ids)
        if kind == "bert_cross_encoder":
            pooled = ref.bert_pooler_output(module, encoding.ids, encoding.type_ids)
            logit = pooled @ weights["classifier.weight"][0] + weights["classifier.bias"][0]
        elif kind == "modernbert_cross_encoder":
            # HF ModernBertForSequenceClassification: mean pooling (the config's
            # classifier_pooling), head = dense -> exact GELU -> LayerNorm (no bias).
            mean = ref.encoder_hidden(module, encoding.ids).mean(axis=0)
            dense = ref.gelu_np(mean @ weights["head.dense.weight"].T)
            normed = ref.layer_norm_np(dense, weights["head.norm.weight"], eps=1e-5)
            logit = normed @ weights["classifier.weight"][0] + weights["classifier.bias"][0]
        else:
            first = ref.encoder_hidden(module, encoding.ids)[0]
            dense = np.tanh(
                first @ weights["classifier.dense.weight"].T + weights["classifier.dense.bias"]
            )
            logit = dense @ weights["classifier.out_proj.weight"][0]
            logit += weights["classifier.out_proj.bias"][0]
        # sentence-transformers' CrossEncoder: Sigmoid on a one-label head by default.
        scores.append(ref.sigmoid_np(float(logit)))
    return rows, np.array(scores)


@pytest.mark.parametrize("kind", [*RERANKERS, "qwen3_reranker_seq_cls"])
def test_rerank_scores_match_the_reference_and_order_documents(
    kind: str, tiny_embedding_model: ModelOf, tiny_embedding_dir: DirOf
) -> None:
    model = tiny_embedding_model(kind)
    assert model.kind == "reranker"
    tiny_embedding_dir("qwen3_reranker")  # the seq-cls reference reads its sibling
    rows, expected = reference_scores(kind, tiny_embedding_dir(kind))
    assert [model.pair_tokens(QUERY, doc) for doc in DOCUMENTS] == rows
    assert len({len(row) for row in rows}) > 1  # the batch is padded

    batched = np.array(model.score(rows))
    alone = np.array([float(model.score([row])[0]) for row in rows])
    assert batched.dtype == np.float32
    np.testing.assert_allclose(batched, expected, atol=TOL, rtol=0)
    np.testing.assert_allclose(alone, expected, atol=TOL, rtol=0)
    # Ordering by our scores is the reference's: the reference's gaps exceed the tolerance.
    gaps = np.diff(np.sort(expected))
    assert gaps.min() > 4 * TOL, f"reference scores too close to order: {expected}"
    assert list(np.argsort(-batched)) == list(np.argsort(-expected))
