"""`/dashboard` in a real browser: Debian's chromium (make system-libs installs it) driven
by Playwright, against a real server running the tiny random llama.

Every request the page makes is recorded: none may leave the server's origin. Console
errors and uncaught exceptions fail the test. A screenshot of the dashboard taken while
a chat request runs is saved under test-artifacts/ (or $COMPAT_TEST_ARTIFACTS), and its
path is printed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Request, expect, sync_playwright

from tests.conftest import start_server

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

CHROMIUM = os.environ.get("COMPAT_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(
    os.environ.get("COMPAT_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts")
)
KEY = "browser-secret"
SESSION = "2fa7b109-13cc-4825-8e11-9db81c282c5f"
# The page polls this often (ms) in the tests, so a request of a few seconds is seen.
POLL_MS = 200
# Each decode step of the paced server takes at least this long (s): the chat's answer
# streams for a few seconds, long enough to watch it run.
STEP_DELAY_S = 0.03
CHAT_MAX_TOKENS = 48


@dataclass
class Watched:
    """What a page did: every request's URL, console errors, uncaught exceptions."""

    page: Page
    requests: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)

    def off_origin(self, base_url: str) -> list[str]:
        return [url for url in self.requests if not url.startswith(f"{base_url}/")]


def watch(page: Page) -> Watched:
    watched = Watched(page)

    def on_request(request: Request) -> None:
        watched.requests.append(request.url)

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            watched.console_errors.append(message.text)

    page.on("request", on_request)
    page.on("console", on_console)
    page.on("pageerror", lambda error: watched.page_errors.append(str(error)))
    return watched


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: run make setup (as root on Debian)"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def paced_server(tiny_llama_model: LoadedModel, info_logs: None) -> Iterator[RunningServer]:
    """The tiny llama with every decode step slowed to STEP_DELAY_S, so a chat answer
    streams for a few seconds while the page polls."""
    running = start_server(tiny_llama_model)
    runner: Any = running.state.engine._runner  # type: ignore[attr-defined]
    real = runner.decode_logits

    def paced(*args: Any) -> Any:
        time.sleep(STEP_DELAY_S)
        return real(*args)

    runner.decode_logits = paced
    yield running
    running.stop()


@pytest.fixture(scope="module")
def keyed_server(tiny_llama_model: LoadedModel) -> Iterator[RunningServer]:
    running = start_server(tiny_llama_model, api_key=KEY)
    yield running
    running.stop()


def model_id(server: RunningServer) -> str:
    name: str = server.state.served_model_name  # type: ignore[attr-defined]
    return name


def test_dashboard_shows_a_streaming_chat_live(
    browser: Browser, paced_server: RunningServer
) -> None:
    base = paced_server.base_url
    page = browser.new_page(viewport={"width": 1400, "height": 1300})
    watched = watch(page)
    page.goto(f"{base}/dashboard?interval={POLL_MS}")

    # Rendered by the page's scripts from /v1/dashboard: the static HTML has no model id.
    expect(page.locator("#model-id")).to_have_text(model_id(paced_server))
    expect(page.locator("#server-state")).to_have_text("serving")
    expect(page.locator("#live-count")).to_have_text("0")
    expect(page.locator("#model-facts")).to_contain_text("2 KVCache, float32")

    # An agent's two turns with the same prompt: the second reads it from the cache, and
    # the page lists the session's reads.
    agent = {"user-agent": "claude-cli/2.0.14 (external, cli)", "x-claude-code-session-id": SESSION}
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "List the files."}],
        "max_tokens": 4,
    }
    replies = []
    for _ in range(2):
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, headers=agent, timeout=60)
        assert reply.status_code == 200, reply.text
        replies.append(reply.json()["usage"])
    assert replies[1]["prompt_tokens_details"]["cached_tokens"] > 0
    # A pinned prompt (OpenAI's prompt_cache_retention) is listed with its tokens and TTL.
    pinned = {**body, "messages": [{"role": "user", "content": "Pin this. " * 12}]}
    reply = httpx.post(
        f"{base}/v1/chat/completions",
        json={**pinned, "prompt_cache_retention": "24h"},
        headers=agent,
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    replies.append(reply.json()["usage"])
    (pin,) = httpx.get(f"{base}/v1/status", timeout=30).json()["cache_pins"]
    pin_row = page.locator("#pin-rows tr")
    expect(pin_row.locator("td").nth(0)).to_have_text(pin["prefix_hash"][:12])
    expect(pin_row.locator("td").nth(1)).to_have_text(str(pin["tokens"]))
    expect(pin_row.locator("td").nth(2)).to_have_text("1h")
    prompt = sum(u["prompt_tokens"] for u in replies)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in replies)
    session_row = page.locator("#client-rows tr", has_text="claude-cli 1c282c5f")
    expect(session_row.locator("td")).to_have_text(
        [
            "claude-cli 1c282c5f",
            "3",
            str(prompt),
            str(cached),
            f"{100 * cached / prompt:.1f}%",
        ]
    )

    page.fill("#chat-max-tokens", str(CHAT_MAX_TOKENS))
    page.fill("#chat-input", "Hello! What can you do?")
    page.press("#chat-input", "Enter")
    expect(page.locator(".msg.user")).to_have_text("Hello! What can you do?")

    # The answer streams: text shows (a few dozen characters of it) while the request is
    # still running, and the live count has risen to 1.
    page.wait_for_function(
        """() => {
            const bubble = document.querySelector('.msg.assistant');
            return bubble && bubble.dataset.state === 'streaming'
                && bubble.querySelector('.content').textContent.length > 40
                && document.getElementById('live-count').textContent === '1';
        }""",
        timeout=15_000,
    )
    partial = page.locator(".msg.assistant .content").text_content() or ""
    expect(page.locator("#live-rows tr")).to_have_count(1)
    expect(page.locator("#live-rows")).to_contain_text("dashboard")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard-running.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"\ndashboard screenshot during a running request: {shot}")

    # It finishes: the answer is complete, the count falls back to 0, and the request is
    # listed as finished, with its log line.
    bubble = page.locator(".msg.assistant")
    expect(bubble).to_have_attribute("data-state", "done", timeout=20_000)
    answer = page.locator(".msg.assistant .content").text_content() or ""
    assert answer.startswith(partial) and len(answer) > len(partial), (partial, answer)
    expect(page.locator(".msg.assistant .usage")).to_contain_text("generated")
    expect(page.locator("#live-count")).to_have_text("0")
    expect(page.locator("#live-rows tr")).to_have_count(0)
    first_finished = page.locator("#recent-rows tr").first
    expect(first_finished).to_contain_text("dashboard")
    request_id = first_finished.locator("td").first.text_content() or ""
    assert request_id.startswith("chatcmpl-")
    expect(page.locator("#log-lines")).to_contain_text(f"{request_id}: ")

    assert watched.off_origin(base) == []
    assert watched.console_errors == [] and watched.page_errors == []
    assert any(url.startswith(f"{base}/v1/dashboard") for url in watched.requests)
    page.close()


def test_with_a_key_nothing_shows_before_the_key(
    browser: Browser, keyed_server: RunningServer
) -> None:
    base = keyed_server.base_url
    page = browser.new_page()
    watched = watch(page)
    page.goto(f"{base}/dashboard?interval={POLL_MS}")

    expect(page.locator("#key-form")).to_be_visible()
    expect(page.locator("#main")).to_be_hidden()
    page.wait_for_timeout(3 * POLL_MS)  # time for any poll that should not happen
    assert model_id(keyed_server) not in page.content()
    assert [url for url in watched.requests if "/v1/" in url] == [], "data fetched before the key"

    page.fill("#key-input", "not-the-key")
    page.click("#key-form button[type=submit]")
    expect(page.locator("#key-error")).to_have_text("invalid API key")
    expect(page.locator("#main")).to_be_hidden()
    assert model_id(keyed_server) not in page.content()
    # The browser reports the refused request itself; nothing else may fail.
    refused = [e for e in watched.console_errors if "401" in e]
    assert refused and len(refused) == len(watched.console_errors), watched.console_errors

    page.fill("#key-input", KEY)
    page.click("#key-form button[type=submit]")
    expect(page.locator("#main")).to_be_visible()
    expect(page.locator("#model-id")).to_have_text(model_id(keyed_server))
    expect(page.locator("#key-form")).to_be_hidden()

    # The chat sends the key too.
    page.fill("#chat-max-tokens", "4")
    page.fill("#chat-input", "Hi")
    page.press("#chat-input", "Enter")
    expect(page.locator(".msg.assistant")).to_have_attribute("data-state", "done", timeout=20_000)
    expect(page.locator(".msg.assistant .usage")).to_contain_text("generated")
    assert "error" not in (page.locator(".msg.assistant").get_attribute("class") or "")

    assert watched.off_origin(base) == []
    assert len(watched.console_errors) == len(refused) and watched.page_errors == []
    page.close()
