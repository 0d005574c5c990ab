"""`/dashboard`'s page and files, and the JSON it polls (`/v1/dashboard`, `/v1/logs`),
against a real server running the tiny random llama. The page itself is driven in a
real browser by tests/browser/test_dashboard_browser.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.conftest import start_server

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

KEY = "dashboard-secret"
CLAUDE_SESSION = "2fa7b109-13cc-4825-8e11-9db81c282c5f"
QUESTION = [{"role": "user", "content": "Name three prime numbers and say why they are prime."}]


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_model: LoadedModel, info_logs: None) -> Iterator[RunningServer]:
    running = start_server(tiny_llama_model)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def keyed_server(tiny_llama_model: LoadedModel) -> Iterator[RunningServer]:
    running = start_server(tiny_llama_model, api_key=KEY)
    yield running
    running.stop()


def chat(base: str, headers: dict[str, str], max_tokens: int = 12) -> dict[str, Any]:
    body = {"model": "m", "messages": QUESTION, "max_tokens": max_tokens}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def test_page_and_files_are_served_with_a_same_origin_policy(tiny_server: RunningServer) -> None:
    base = tiny_server.base_url
    page = httpx.get(f"{base}/dashboard", timeout=10)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert 'data-key-required="false"' in page.text
    # Everything the page loads is on this server: no scheme-qualified URL in any file.
    assert '<script src="/dashboard/static/dashboard.js"' in page.text
    assert '<script src="/dashboard/static/chat.js"' in page.text
    assert '<link rel="stylesheet" href="/dashboard/static/dashboard.css">' in page.text
    assets = (
        ("dashboard.js", "text/javascript"),
        ("chat.js", "text/javascript"),
        ("dashboard.css", "text/css"),
    )
    for name, kind in assets:
        asset = httpx.get(f"{base}/dashboard/static/{name}", timeout=10)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        assert "http://" not in asset.text and "https://" not in asset.text
    assert "http://" not in page.text and "https://" not in page.text


@pytest.mark.parametrize("name", ["index.html", "nope.js", "..%2Fsnapshot.py", "routes.py"])
def test_unknown_files_are_404_in_the_error_shape(tiny_server: RunningServer, name: str) -> None:
    response = httpx.get(f"{tiny_server.base_url}/dashboard/static/{name}", timeout=10)
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    # A name with a slash never reaches the route: the server's own 404.
    expected = "no such endpoint" if "%2F" in name else "no dashboard file"
    assert message.startswith(expected), message


def test_snapshot_follows_finished_requests_per_client(tiny_server: RunningServer) -> None:
    base = tiny_server.base_url
    claude = {
        "user-agent": "claude-cli/2.0.14 (external, cli)",
        "x-claude-code-session-id": CLAUDE_SESSION,
    }
    codex = {
        "user-agent": "codex_exec/0.163.0 (Debian 12.0.0; x86_64)",
        "session-id": "01a2093b-8fa0-7652-9538-d574a215783e",
    }
    first = chat(base, claude)
    second = chat(base, claude)  # the same prompt: read from the prefix cache
    third = chat(base, codex)
    snap = httpx.get(f"{base}/v1/dashboard", timeout=10).json()

    requests = snap["requests"]
    assert requests["live"] == [] and requests["queued"] == 0 and requests["decoding"] == 0
    recent = {row["request_id"]: row for row in requests["recent"]}
    for reply, client in (
        (first, "claude-cli 1c282c5f"),
        (second, "claude-cli 1c282c5f"),
        (third, "codex_exec a215783e"),
    ):
        row = recent[reply["id"]]
        usage = reply["usage"]
        assert row["client"] == client
        assert row["phase"] == "finished"
        assert row["outcome"] in ("length", "stop_token")
        assert row["prompt_tokens"] == usage["prompt_tokens"]
        assert row["generated_tokens"] == usage["completion_tokens"]
        assert row["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert row["ttft_s"] > 0 and row["duration_s"] >= row["ttft_s"]
    assert recent[second["id"]]["cached_tokens"] > 0, "the repeated prompt missed the cache"

    clients = {row["client"]: row for row in snap["cache"]["clients"]}
    claude_reads = clients["claude-cli 1c282c5f"]
    assert claude_reads["requests"] == 2
    assert claude_reads["prompt_tokens"] == first["usage"]["prompt_tokens"] * 2
    assert claude_reads["cached_tokens"] == (
        first["usage"]["prompt_tokens_details"]["cached_tokens"]
        + second["usage"]["prompt_tokens_details"]["cached_tokens"]
    )
    assert clients["codex_exec a215783e"]["requests"] == 1
    assert snap["cache"]["enabled"] and snap["cache"]["hit_tokens"] >= claude_reads["cached_tokens"]


def test_snapshot_describes_the_model_memory_and_window(
    tiny_server: RunningServer, tiny_llama_model: LoadedModel
) -> None:
    from mlx.utils import tree_flatten

    snap = httpx.get(f"{tiny_server.base_url}/v1/dashboard", timeout=10).json()
    state: Any = tiny_server.state
    (model,) = snap["models"]
    assert model["id"] == state.served_model_name and model["state"] == "loaded"
    assert model["context_window"] == state.context_length
    assert model["architecture"] == "llama"
    args = tiny_llama_model.model.args
    # Two plain KVCache layers of float32 K and V: 2 x layers x kv_heads x head_dim x 4 bytes.
    assert model["kv_format"] == {"layers": {"KVCache": args.num_hidden_layers}, "dtype": "float32"}
    assert model["kv_bytes_per_token"] == (
        2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * 4
    )
    memory = snap["memory"]
    params = tree_flatten(tiny_llama_model.model.parameters())
    assert memory["weights_bytes"] == sum(a.size * a.itemsize for _, a in params)
    assert memory["kv_in_use_bytes"] == 0 and memory["kv_tokens_reserved"] == 0
    assert memory["kv_budget_bytes"] > 0 and memory["cache_budget_bytes"] > 0
    assert memory["process_rss_bytes"] > memory["weights_bytes"]
    assert snap["server"]["state"] == "serving" and snap["server"]["api_key_required"] is False


def test_logs_page_forward_from_a_sequence_number(tiny_server: RunningServer) -> None:
    base = tiny_server.base_url
    start = httpx.get(f"{base}/v1/logs", params={"limit": 1}, timeout=10).json()["last"]
    reply = chat(base, {"x-client-name": "log-test"}, max_tokens=3)
    page = httpx.get(f"{base}/v1/logs", params={"after": start}, timeout=10).json()
    finished = [line for line in page["lines"] if line["message"].startswith(reply["id"])]
    assert len(finished) == 1, page["lines"]
    assert finished[0]["level"] == "INFO" and finished[0]["logger"] == "compat_serve.engine"
    assert all(line["seq"] > start for line in page["lines"])
    assert page["last"] == page["lines"][-1]["seq"]
    nothing_new = httpx.get(f"{base}/v1/logs", params={"after": page["last"]}, timeout=10).json()
    assert nothing_new == {"lines": [], "last": page["last"]}


@pytest.mark.parametrize("query", ["after=-1", "limit=0", "limit=100000", "after=x"])
def test_bad_log_queries_are_4xx(tiny_server: RunningServer, query: str) -> None:
    response = httpx.get(f"{tiny_server.base_url}/v1/logs?{query}", timeout=10)
    assert 400 <= response.status_code < 500
    assert "error" in response.json()


def test_with_a_key_the_page_loads_but_no_data_does(keyed_server: RunningServer) -> None:
    base = keyed_server.base_url
    page = httpx.get(f"{base}/dashboard", timeout=10)
    assert page.status_code == 200 and 'data-key-required="true"' in page.text
    state: Any = keyed_server.state
    assert state.served_model_name not in page.text
    assert httpx.get(f"{base}/dashboard/static/dashboard.js", timeout=10).status_code == 200
    for path in ("/v1/dashboard", "/v1/logs"):
        assert httpx.get(f"{base}{path}", timeout=10).status_code == 401
        wrong = httpx.get(f"{base}{path}", headers={"x-api-key": "nope"}, timeout=10)
        assert wrong.status_code == 401
        right = httpx.get(f"{base}{path}", headers={"x-api-key": KEY}, timeout=10)
        assert right.status_code == 200
    snap = httpx.get(f"{base}/v1/dashboard", headers={"x-api-key": KEY}, timeout=10).json()
    assert snap["server"]["api_key_required"] is True


def test_snapshot_without_a_prefix_cache(tiny_llama_model: LoadedModel) -> None:
    running = start_server(tiny_llama_model, prefix_cache=False)
    try:
        reply = chat(running.base_url, {"user-agent": "opencode/1.18.3"}, max_tokens=3)
        snap = httpx.get(f"{running.base_url}/v1/dashboard", timeout=10).json()
    finally:
        running.stop()
    cache = snap["cache"]
    assert cache["enabled"] is False
    assert cache["clients"] == [
        {
            "client": "opencode",
            "requests": 1,
            "prompt_tokens": reply["usage"]["prompt_tokens"],
            "cached_tokens": 0,
            "generated_tokens": reply["usage"]["completion_tokens"],
        }
    ]
    assert snap["memory"]["cache_bytes"] == 0 and snap["memory"]["cache_budget_bytes"] == 0
    assert snap["requests"]["recent"][-1]["request_id"] == reply["id"]
