"""Model discovery as other servers' clients read it (server/discovery.py), real server.

The embedded SmolLM2-135M has an 8192-token window (its GGUF metadata), a llama
architecture and no reasoning tags; each client's field must carry exactly that.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

from tests.conftest import RunningServer, start_server

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

SMOLLM2_CONTEXT = 8192
NAME = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def strict_server(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    running = start_server(embedded_model, strict_model_names=True, context_length=4096)
    yield running
    running.stop()


def test_the_embedded_model_window_is_8192(embedded_model: LoadedModel) -> None:
    # The expectations below rest on this, read from the model file, not from our routes.
    assert embedded_model.context_length == SMOLLM2_CONTEXT
    assert embedded_model.model_type == "llama"


def test_v1_models_carries_every_context_field(server: RunningServer) -> None:
    card = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]
    for field in (
        "context_length",
        "max_model_len",
        "max_context_length",
        "loaded_context_length",
        "context_window",
    ):
        assert card[field] == SMOLLM2_CONTEXT, field
    assert card["top_provider"]["context_length"] == SMOLLM2_CONTEXT
    assert card["meta"]["n_ctx_train"] == SMOLLM2_CONTEXT
    assert card["meta"]["n_vocab"] == 49152
    # The official SDK still parses the list.
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    models = client.models.list().data
    assert models[0].id == NAME
    assert models[0].model_extra is not None
    assert models[0].model_extra["context_length"] == SMOLLM2_CONTEXT


def test_context_override_reaches_every_client(strict_server: RunningServer) -> None:
    base = strict_server.base_url
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["max_model_len"] == 4096
    assert httpx.get(f"{base}/props").json()["default_generation_settings"]["n_ctx"] == 4096
    show = httpx.post(f"{base}/api/show", json={"model": NAME}).json()
    assert show["model_info"]["llama.context_length"] == 4096
    assert httpx.get(f"{base}/api/v0/models").json()["data"][0]["loaded_context_length"] == 4096
    assert httpx.get(f"{base}/api/ps").json()["models"][0]["context_length"] == 4096


def test_llama_cpp_props(server: RunningServer) -> None:
    props = httpx.get(f"{server.base_url}/props").json()
    assert props["default_generation_settings"]["n_ctx"] == SMOLLM2_CONTEXT
    assert props["total_slots"] == 16
    assert "<|im_start|>" in props["chat_template"]
    assert props["modalities"] == {"vision": False, "audio": False}


def test_lmstudio_models(server: RunningServer) -> None:
    listing = httpx.get(f"{server.base_url}/api/v0/models").json()
    card = listing["data"][0]
    assert card["type"] == "llm" and card["state"] == "loaded"
    assert card["max_context_length"] == card["loaded_context_length"] == SMOLLM2_CONTEXT
    assert card["arch"] == "llama"
    one = httpx.get(f"{server.base_url}/api/v0/models/{NAME}").json()
    assert one == card


def test_ollama_version_tags_ps(server: RunningServer) -> None:
    version = httpx.get(f"{server.base_url}/api/version").json()["version"]
    # GitHub Copilot's BYOK Ollama provider refuses servers older than 0.6.4.
    assert tuple(int(p) for p in version.split(".")) >= (0, 6, 4)
    tags = httpx.get(f"{server.base_url}/api/tags").json()["models"]
    assert [t["name"] for t in tags] == [f"{NAME}:latest"]
    assert tags[0]["details"]["family"] == "llama"
    assert tags[0]["details"]["format"] == "gguf"
    assert tags[0]["size"] > 50_000_000  # the real Q4_1 file
    assert len(tags[0]["digest"]) == 64
    running = httpx.get(f"{server.base_url}/api/ps").json()["models"]
    assert running[0]["name"] == tags[0]["name"]


def test_ollama_show_context_and_capabilities(server: RunningServer) -> None:
    for body in ({"model": f"{NAME}:latest"}, {"name": "anything"}):
        show = httpx.post(f"{server.base_url}/api/show", json=body).json()
        assert show["model_info"]["general.architecture"] == "llama"
        assert show["model_info"]["llama.context_length"] == SMOLLM2_CONTEXT
        # Tools always (the JSON envelope); SmolLM2 has no reasoning tags and no vision.
        assert show["capabilities"] == ["completion", "tools"]
        assert f"num_ctx {SMOLLM2_CONTEXT}" in show["parameters"]


@pytest.mark.parametrize(
    ("content", "status", "message"),
    [
        (b"{not json", 400, "invalid JSON body"),
        (b"[1]", 400, "the body must be a JSON object"),
        (b"{}", 400, "model is required"),
        (b'{"model": 3}', 400, "model is required"),
    ],
)
def test_ollama_show_bad_input(
    server: RunningServer, content: bytes, status: int, message: str
) -> None:
    reply = httpx.post(
        f"{server.base_url}/api/show",
        content=content,
        headers={"content-type": "application/json"},
    )
    assert reply.status_code == status
    assert reply.json() == {"error": message}


def test_strict_names_are_404s_in_each_shape(strict_server: RunningServer) -> None:
    base = strict_server.base_url
    reply = httpx.post(f"{base}/api/show", json={"model": "llama3:8b"})
    assert reply.status_code == 404
    assert reply.json() == {"error": "model 'llama3:8b' not found"}
    assert httpx.post(f"{base}/api/show", json={"model": f"{NAME}:latest"}).status_code == 200
    reply = httpx.get(f"{base}/api/v0/models/other")
    assert reply.status_code == 404 and "not found" in reply.json()["error"]


def test_discovery_routes_need_the_api_key(embedded_model: LoadedModel) -> None:
    running = start_server(embedded_model, api_key="sekret")
    try:
        for path in ("/props", "/api/tags", "/api/version", "/api/v0/models"):
            assert httpx.get(f"{running.base_url}{path}").status_code == 401, path
            ok = httpx.get(f"{running.base_url}{path}", headers={"authorization": "Bearer sekret"})
            assert ok.status_code == 200, path
    finally:
        running.stop()
