"""Embeddings and rerank in the chat server (#37), through the clients users point at it:
the official `openai` SDK (`embeddings.create`, whose default encoding is base64), the
`ollama` client (`embed`) and the `cohere` SDK (`ClientV2(base_url=...).rerank`), plus
every error path in its API's own shape.

One server for the module, as `--models FILE` under `--memory-budget`: the tiny chat
model (`--model`), a tiny BERT embedding model (mean pooling, 64-token limit: long
inputs are cheap to make) preloaded, and a tiny BERT cross-encoder loaded on its first
request (tests/tiny_embedding_models.py)."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cohere
import httpx
import numpy as np
import ollama
import openai
import pytest

from compat_serve.bootstrap import ServeOptions, build_state
from compat_serve.serve_models import ModelFlags, build_hub
from compat_serve.server.app import create_app
from tests.conftest import RunningServer, run_app

if TYPE_CHECKING:
    from compat_serve.embeddings.model import EmbeddingModel
    from compat_serve.models.types import LoadedModel

BUDGET = 3 * 2**30
TEXTS = [
    "how to parse a token",
    "the capital of france is paris",
    "rust function",
    "find the error in this python code and return the value",
]
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital city of france", "apple and orange fruit", "rust code"]


@pytest.fixture(scope="module")
def model_dirs(tiny_embedding_dir: Callable[[str], Path]) -> dict[str, Path]:
    return {
        "embed": tiny_embedding_dir("bert_embedding"),
        "rerank": tiny_embedding_dir("bert_cross_encoder"),
    }


@pytest.fixture(scope="module")
def embedder(tiny_embedding_model: Callable[[str], EmbeddingModel]) -> EmbeddingModel:
    """The embedding model loaded on its own: its tokenizer and limits, for the tests."""
    return tiny_embedding_model("bert_embedding")


@pytest.fixture(scope="module")
def served(
    tiny_llama_model: LoadedModel,
    model_dirs: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningServer]:
    file = tmp_path_factory.mktemp("models-file") / "models.yaml"
    file.write_text(
        "models:\n"
        f"  - id: embed\n    path: {model_dirs['embed']}\n    preload: true\n"
        f"  - id: rerank\n    path: {model_dirs['rerank']}\n"
    )
    options = ServeOptions(kv_memory="64MB", cache_memory="64MB")
    chat = build_state(
        ServeOptions(kv_memory="64MB", cache_memory="64MB", served_model_name="chat"),
        loaded=tiny_llama_model,
    )
    hub = build_hub(
        options, ModelFlags(models_file=str(file), memory_budget=str(BUDGET)), single_state=chat
    )
    running = run_app(create_app(hub), hub)
    yield running
    running.stop()


def _post(served: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{served.base_url}{path}", json=body, timeout=60)


def _openai(served: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="none", max_retries=0)


def _floats(served: RunningServer, texts: list[str] | list[list[int]], **extra: Any) -> np.ndarray:
    response = _post(served, "/v1/embeddings", {"model": "embed", "input": texts, **extra})
    assert response.status_code == 200, response.text
    return np.array([item["embedding"] for item in response.json()["data"]], dtype=np.float32)


# --- OpenAI ------------------------------------------------------------------------------


def test_openai_sdk_float_and_base64_decode_to_the_same_floats(served: RunningServer) -> None:
    client = _openai(served)
    default = client.embeddings.create(model="embed", input=TEXTS)  # base64 on the wire
    floats = client.embeddings.create(model="embed", input=TEXTS, encoding_format="float")
    raw = _post(
        served, "/v1/embeddings", {"model": "embed", "input": TEXTS, "encoding_format": "base64"}
    )
    wire = [
        np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw.json()["data"]
    ]
    assert [d.index for d in default.data] == [0, 1, 2, 3]
    assert np.array_equal(np.array(default.data[3].embedding, dtype=np.float32), wire[3])
    for a, b in zip(default.data, floats.data, strict=True):
        assert np.array_equal(np.array(a.embedding, np.float32), np.array(b.embedding, np.float32))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)
    assert floats.model == "embed"


def test_a_batch_embeds_as_each_input_alone(served: RunningServer) -> None:
    """Inputs of different lengths padded into one forward give each input's own vector."""
    together = _floats(served, TEXTS)
    for i, text in enumerate(TEXTS):
        alone = _floats(served, [text])[0]
        np.testing.assert_allclose(together[i], alone, atol=1e-5)
    # Normalized (the model's modules list Normalize), and distinct texts differ.
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    assert not np.allclose(together[0], together[1], atol=1e-3)


def test_token_ids_embed_as_their_text(served: RunningServer, embedder: EmbeddingModel) -> None:
    ids = [embedder.tokenize(text) for text in TEXTS[:2]]
    np.testing.assert_allclose(_floats(served, ids), _floats(served, TEXTS[:2]), atol=1e-6)
    np.testing.assert_allclose(_floats(served, ids[0]), _floats(served, TEXTS[:1]), atol=1e-6)


def test_dimensions_truncate_then_renormalize(
    served: RunningServer, embedder: EmbeddingModel
) -> None:
    full = _floats(served, TEXTS[:2])
    width = embedder.dimensions // 2
    short = _floats(served, TEXTS[:2], dimensions=width)
    assert short.shape == (2, width)
    expected = full[:, :width] / np.linalg.norm(full[:, :width], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=1e-6)
    assert not np.allclose(np.linalg.norm(full[:, :width], axis=1), 1.0, atol=1e-3)


def test_a_long_openai_input_is_a_400_naming_the_limit(
    served: RunningServer, embedder: EmbeddingModel
) -> None:
    long_text = " ".join(["search"] * (embedder.max_tokens + 10))
    response = _post(served, "/v1/embeddings", {"model": "embed", "input": ["ok", long_text]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "input"
    assert f"max_tokens of {embedder.max_tokens}" in error["message"]
    assert "input[1]" in error["message"]


# --- Ollama ------------------------------------------------------------------------------


def test_ollama_client_embed_and_the_legacy_route(served: RunningServer) -> None:
    client = ollama.Client(host=served.base_url)
    response = client.embed(model="embed", input=TEXTS[:2])
    np.testing.assert_allclose(np.array(response.embeddings), _floats(served, TEXTS[:2]), atol=1e-6)
    assert response.prompt_eval_count == sum(len(_tokens(served, t)) for t in TEXTS[:2])
    assert response.total_duration is not None and response.total_duration > 0
    assert response.load_duration is not None and response.load_duration >= 0
    single = client.embed(model="embed", input=TEXTS[0])
    assert len(single.embeddings) == 1
    legacy = _post(served, "/api/embeddings", {"model": "embed", "prompt": TEXTS[0]})
    assert legacy.status_code == 200
    np.testing.assert_allclose(legacy.json()["embedding"], single.embeddings[0], atol=1e-6)


def _tokens(served: RunningServer, text: str) -> list[int]:
    usage = _post(served, "/v1/embeddings", {"model": "embed", "input": text}).json()["usage"]
    return [0] * usage["prompt_tokens"]


def test_ollama_truncates_by_default_and_refuses_when_asked_not_to(
    served: RunningServer, embedder: EmbeddingModel
) -> None:
    long_text = " ".join(["search"] * (embedder.max_tokens + 10))
    cut = _post(served, "/api/embed", {"model": "embed", "input": long_text})
    assert cut.status_code == 200
    assert cut.json()["prompt_eval_count"] == embedder.max_tokens
    refused = _post(served, "/api/embed", {"model": "embed", "input": long_text, "truncate": False})
    assert refused.status_code == 400
    assert f"max_tokens of {embedder.max_tokens}" in refused.json()["error"]
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=served.base_url).embed(model="embed", input=long_text, truncate=False)
    assert info.value.status_code == 400


# --- rerank and score --------------------------------------------------------------------


def _scores(served: RunningServer, text_1: Any, text_2: Any) -> list[float]:
    response = _post(served, "/v1/score", {"model": "rerank", "text_1": text_1, "text_2": text_2})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    assert all(d["object"] == "score" for d in data)
    return [d["score"] for d in data]


def test_cohere_sdk_rerank_orders_by_the_models_scores(served: RunningServer) -> None:
    scores = _scores(served, QUERY, DOCUMENTS)
    assert len(set(scores)) == len(scores)  # a strict order to check
    client = cohere.ClientV2(base_url=served.base_url, api_key="none")
    response = client.rerank(model="rerank", query=QUERY, documents=DOCUMENTS)
    expected = sorted(range(len(DOCUMENTS)), key=lambda i: scores[i], reverse=True)
    assert [r.index for r in response.results] == expected
    for r in response.results:
        assert r.relevance_score == pytest.approx(scores[r.index], abs=1e-5)
    top = client.rerank(model="rerank", query=QUERY, documents=DOCUMENTS, top_n=2)
    assert [r.index for r in top.results] == expected[:2]


def test_rerank_top_n_and_return_documents_as_cohere(served: RunningServer) -> None:
    docs = [{"text": d} for d in DOCUMENTS]
    for path in ("/v1/rerank", "/rerank"):
        body = {"model": "rerank", "query": QUERY, "documents": docs, "return_documents": True}
        response = _post(served, path, {**body, "top_n": 10})  # more than given: all
        assert response.status_code == 200, response.text
        results = response.json()["results"]
        assert len(results) == len(DOCUMENTS)
        assert [r["document"]["text"] for r in results] == [DOCUMENTS[r["index"]] for r in results]
        scores = [r["relevance_score"] for r in results]
        assert scores == sorted(scores, reverse=True)
        plain = _post(
            served, path, {"model": "rerank", "query": QUERY, "documents": DOCUMENTS, "top_n": 1}
        )
        assert [set(r) for r in plain.json()["results"]] == [{"index", "relevance_score"}]
        assert plain.json()["usage"]["total_tokens"] > 0


def test_score_one_to_many_and_pairwise(served: RunningServer) -> None:
    one_to_many = _scores(served, QUERY, DOCUMENTS)
    pairwise = _scores(served, [QUERY] * len(DOCUMENTS), DOCUMENTS)
    np.testing.assert_allclose(pairwise, one_to_many, atol=1e-5)
    assert len(_scores(served, [QUERY], DOCUMENTS[:2])) == 2


# --- model lists and kinds ---------------------------------------------------------------


def test_model_lists_say_what_each_model_serves(served: RunningServer) -> None:
    cards = {c["id"]: c for c in httpx.get(f"{served.base_url}/v1/models").json()["data"]}
    assert {k: c["kind"] for k, c in cards.items()} == {
        "chat": "chat",
        "embed": "embedding",
        "rerank": "reranker",
    }
    assert cards["embed"]["capabilities"] == ["embedding"]
    assert cards["rerank"]["capabilities"] == ["rerank", "score"]
    tags = {t["name"]: t for t in httpx.get(f"{served.base_url}/api/tags").json()["models"]}
    assert tags["embed:latest"]["capabilities"] == ["embedding"]
    assert "completion" in tags["chat:latest"]["capabilities"]
    lmstudio = {c["id"]: c for c in httpx.get(f"{served.base_url}/api/v0/models").json()["data"]}
    assert lmstudio["embed"]["type"] == "embeddings"


def test_chat_and_embedding_models_share_the_memory_budget(served: RunningServer) -> None:
    _floats(served, TEXTS[:1])
    _scores(served, QUERY, DOCUMENTS[:1])  # the reranker loads on demand
    reply = _post(
        served,
        "/v1/chat/completions",
        {"model": "chat", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert reply.status_code == 200, reply.text
    status = httpx.get(f"{served.base_url}/v1/status").json()
    states = {m["id"]: (m["kind"], m["state"]) for m in status["models"]}
    assert states == {
        "chat": ("chat", "loaded"),
        "embed": ("embedding", "loaded"),
        "rerank": ("reranker", "loaded"),
    }
    sizes = {m["id"]: m["resident_bytes"] for m in status["models"]}
    assert 0 < sizes["embed"] < sizes["chat"]
    assert status["memory_budget_bytes"] == BUDGET
    assert status["resident_bytes"] == sum(sizes.values()) <= BUDGET


# --- errors ------------------------------------------------------------------------------

_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    ("path", "body", "kind"),
    [
        ("/v1/chat/completions", {"model": "embed", **_CHAT}, "embedding"),
        ("/v1/messages", {"model": "embed", **_CHAT}, "embedding"),
        ("/v1/responses", {"model": "rerank", "input": "Hi"}, "reranker"),
        ("/api/chat", {"model": "embed", "messages": _CHAT["messages"]}, "embedding"),
        ("/api/generate", {"model": "embed", "prompt": "Hi"}, "embedding"),
        ("/v1/embeddings", {"model": "chat", "input": "Hi"}, "chat"),
        ("/api/embed", {"model": "chat", "input": "Hi"}, "chat"),
        ("/v1/embeddings", {"model": "rerank", "input": "Hi"}, "reranker"),
        ("/v1/rerank", {"model": "embed", "query": "q", "documents": ["d"]}, "embedding"),
        ("/v1/score", {"model": "chat", "text_1": "q", "text_2": "d"}, "chat"),
    ],
)
def test_a_model_of_the_wrong_kind_is_a_400_naming_it(
    served: RunningServer, path: str, body: dict[str, Any], kind: str
) -> None:
    response = _post(served, path, body)
    assert response.status_code == 400, response.text
    payload = response.json()
    if path.startswith("/api/"):
        message = payload["error"]
    elif path == "/v1/messages":
        assert payload["type"] == "error"
        message = payload["error"]["message"]
    else:
        assert payload["error"]["code"] == "wrong_model_kind"
        message = payload["error"]["message"]
    assert f"is a {kind} model" in message or f"is an {kind} model" in message


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/v1/embeddings", {"model": "embed"}, "input: field required"),
        ("/v1/embeddings", {"model": "embed", "input": ""}, "input[0]: must not be empty"),
        ("/v1/embeddings", {"model": "embed", "input": []}, "input: must be a non-empty"),
        ("/v1/embeddings", {"model": "embed", "input": [[]]}, "input[0]: must not be empty"),
        ("/v1/embeddings", {"model": "embed", "input": ["a", [1, 2]]}, "not a mix"),
        ("/v1/embeddings", {"model": "embed", "input": [[10**9]]}, "out of range"),
        (
            "/v1/embeddings",
            {"model": "embed", "input": "a", "encoding_format": "int8"},
            "float or base64",
        ),
        ("/v1/embeddings", {"model": "embed", "input": "a", "dimensions": 0}, "between 1 and"),
        ("/v1/embeddings", {"model": "embed", "input": "a", "dimensions": 10**6}, "between 1 and"),
        ("/api/embed", {"model": "embed", "input": ""}, "input[0]: must not be empty"),
        ("/api/embed", {"input": "a"}, "model is required"),
        ("/api/embeddings", {"model": "embed", "prompt": ""}, "prompt: must be a non-empty"),
        ("/v1/rerank", {"model": "rerank", "query": "", "documents": ["d"]}, "query: must be"),
        ("/v1/rerank", {"model": "rerank", "query": "q", "documents": []}, "documents: must be"),
        ("/rerank", {"model": "rerank", "query": "q", "documents": [{"t": 1}]}, "documents[0]"),
        ("/v1/rerank", {"model": "rerank", "query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
        ("/v1/score", {"model": "rerank", "text_1": ["a", "b"], "text_2": ["c"]}, "pairwise"),
        ("/v1/score", {"model": "rerank", "text_1": "a"}, "text_2: must be"),
    ],
)
def test_bad_input_is_a_400_in_the_apis_shape(
    served: RunningServer, path: str, body: dict[str, Any], fragment: str
) -> None:
    response = _post(served, path, body)
    assert response.status_code == 400, response.text
    payload = response.json()
    message = payload["error"] if path.startswith("/api/") else payload["error"]["message"]
    assert fragment in message


def test_a_long_rerank_pair_is_a_400_naming_the_limit(served: RunningServer) -> None:
    long_doc = " ".join(["paris"] * 200)
    response = _post(
        served, "/v1/rerank", {"model": "rerank", "query": "q", "documents": ["d", long_doc]}
    )
    assert response.status_code == 400
    assert "documents[1]" in response.json()["error"]["message"]
    assert "max_tokens of" in response.json()["error"]["message"]


def test_an_embedding_model_alone_is_served_with_model(model_dirs: dict[str, Path]) -> None:
    """`--model DIR` of an embedding model: it is the server's one model."""
    hub = build_hub(ServeOptions(model=str(model_dirs["embed"])), ModelFlags())
    running = run_app(create_app(hub), hub)
    try:
        base = running.base_url
        response = httpx.post(f"{base}/v1/embeddings", json={"model": "x", "input": "sky"})
        assert response.status_code == 200, response.text
        assert len(response.json()["data"][0]["embedding"]) > 0
        chat = httpx.post(f"{base}/v1/chat/completions", json={"model": "x", **_CHAT})
        assert chat.status_code == 400
        assert "is an embedding model" in chat.json()["error"]["message"]
        assert httpx.get(f"{base}/health").status_code == 200
        (card,) = httpx.get(f"{base}/v1/models").json()["data"]
        assert card["kind"] == "embedding"
        assert httpx.get(f"{base}/v1/status").json()["models"][0]["state"] == "loaded"
    finally:
        running.stop()
