"""Chat-completions hardening (#20 item 4) on the real embedded model: logprobs and
top_logprobs for real (checked against a direct forward pass of the model), streamed per
chunk, under a grammar and under speculative decoding; `max_tokens: -1`; validation."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import mlx.core as mx
import openai
import pytest

from tests.conftest import RunningServer, start_server
from tests.greedy_ties import assert_chat_same_or_near_tie

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]


def _post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": "m", **body}, timeout=300)


def _reference_logprobs(
    loaded: LoadedModel, prompt: list[int], generated: list[int]
) -> list[float]:
    """Each generated token's log probability from one plain forward pass of the model."""
    ids = mx.array([prompt + generated])
    logits = loaded.model(ids)[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    start = len(prompt) - 1
    return [float(logprobs[start + i, token].item()) for i, token in enumerate(generated)]


def test_completion_logprobs_match_a_direct_forward(
    server: RunningServer, embedded_model: LoadedModel
) -> None:
    prompt = embedded_model.tokenizer.encode(PROMPT)
    reply = _post(
        server,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3, "ignore_eos": True},
    ).json()
    choice = reply["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
    generated = embedded_model.tokenizer.encode(choice["text"])
    assert len(generated) == 6  # these six tokens re-encode to themselves
    expected = _reference_logprobs(embedded_model, prompt, generated)
    for got, want in zip(lp["token_logprobs"], expected, strict=True):
        assert got == pytest.approx(want, abs=2e-2)
    for token, value, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        assert len(top) == 3
        # Greedy: the chosen token is the most likely one.
        assert max(top.values()) == pytest.approx(value)
        assert top[token] == pytest.approx(value)


def test_chat_logprobs_shape_and_greedy_top(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    items = choice.logprobs.content
    assert reply.usage is not None
    # One per generated token except an end-of-turn token, which is never shown.
    assert len(items) in (reply.usage.completion_tokens, reply.usage.completion_tokens - 1)
    assert "".join(item.token for item in items) == choice.message.content
    for item in items:
        assert item.logprob <= 0
        assert bytes(item.bytes or []).decode() == item.token
        assert len(item.top_logprobs) == 5
        values = [alt.logprob for alt in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert item.top_logprobs[0].token == item.token
        assert sum(math.exp(v) for v in values) <= 1 + 1e-4


def _stream_logprobs(
    server: RunningServer, body: dict[str, Any]
) -> tuple[str, list[dict[str, Any]]]:
    text, items = "", []
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/chat/completions",
        json={"model": "m", "stream": True, **body},
        timeout=300,
    ) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
                if choice["logprobs"] is not None:
                    items.extend(choice["logprobs"]["content"])
    return text, items


def test_streamed_logprobs_equal_non_streamed(server: RunningServer) -> None:
    body = {
        "messages": CHAT,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = _post(server, "/v1/chat/completions", body).json()["choices"][0]
    text, items = _stream_logprobs(server, body)
    assert text == whole["message"]["content"]
    assert [i["token"] for i in items] == [i["token"] for i in whole["logprobs"]["content"]]
    for a, b in zip(items, whole["logprobs"]["content"], strict=True):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-3)


def test_no_logprobs_unless_asked(server: RunningServer) -> None:
    reply = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3}).json()
    assert reply["choices"][0]["logprobs"] is None
    _, items = _stream_logprobs(server, {"messages": CHAT, "max_tokens": 3})
    assert items == []
    reply = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).json()
    assert reply["choices"][0]["logprobs"] is None


def test_logprobs_after_the_grammar_mask(server: RunningServer) -> None:
    """Under guided_choice only the allowed tokens have mass: the alternatives are the
    allowed ones, renormalised, never a forbidden token."""
    reply = _post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Is the sky blue?"}],
            "guided_choice": ["yes", "no"],
            "temperature": 0.7,
            "seed": 3,
            "logprobs": True,
            "top_logprobs": 20,
        },
    ).json()
    choice = reply["choices"][0]
    assert choice["message"]["content"] in ("yes", "no")
    first = choice["logprobs"]["content"][0]
    allowed = [alt["token"] for alt in first["top_logprobs"]]
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in allowed), allowed
    assert sum(math.exp(alt["logprob"]) for alt in first["top_logprobs"]) == pytest.approx(
        1.0, abs=1e-3
    )


@pytest.fixture(scope="module")
def speculative_server(embedded_model: LoadedModel) -> Iterator[RunningServer]:
    running = start_server(embedded_model, speculative="ngram", speculative_tokens=4)
    yield running
    running.stop()


def test_speculative_decoding_reports_the_verified_tokens_logprobs(
    server: RunningServer, speculative_server: RunningServer
) -> None:
    """A copy-heavy prompt makes the n-gram drafter propose tokens that are accepted; the
    logprobs must still be those plain decoding computes for the same tokens."""
    passage = (
        "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
        "with a single step. All that glitters is not gold."
    )
    body = {
        "messages": [{"role": "user", "content": f"Repeat this text exactly:\n{passage}"}],
        # 16 tokens: ten of twelve drafts accepted here (22 of 26 at 32 tokens).
        "max_tokens": 16,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
    }
    plain = _post(server, "/v1/chat/completions", body).json()
    before = _metrics(speculative_server)
    spec = _post(speculative_server, "/v1/chat/completions", body).json()
    after = _metrics(speculative_server)
    # The same tokens up to a near tie (verifying drafts sums in another order).
    tie = assert_chat_same_or_near_tie(plain, spec)
    spec_items = spec["choices"][0]["logprobs"]["content"]
    plain_items = plain["choices"][0]["logprobs"]["content"]
    same = tie.position if tie is not None else len(plain_items)
    for a, b in zip(spec_items[:same], plain_items[:same], strict=True):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=2e-2)
    spec_status = httpx.get(f"{speculative_server.base_url}/v1/status").json()["speculation"]
    # Drafted tokens were accepted, so some logprobs came from the verify pass.
    assert spec_status["accepted_tokens"] > 0, spec_status
    _assert_telemetry_matches(speculative_server, spec["usage"], before, after, spec_status)


def _metrics(server: RunningServer) -> dict[str, float]:
    """`/metrics` samples by name and labels, each label set's own: `name{a="1"}`."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def _sum(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def _assert_telemetry_matches(
    server: RunningServer,
    usage: dict[str, int],
    before: dict[str, float],
    after: dict[str, float],
    status: dict[str, Any],
) -> None:
    """Speculation telemetry in /v1/status, /metrics and the dashboard agrees, and with
    what the engine did for the one request: its first token came from the prefill, then
    one per plain decode step, and what the verify steps emitted: per step the accepted
    drafts plus the model's own token, less that token once if an accepted draft ended
    the request (a stop token)."""

    def delta(name: str) -> float:
        return _sum(after, name) - _sum(before, name)

    steps = delta("compat_decode_step_batch_size_count")
    verify = delta("compat_spec_verify_steps_total")
    emitted = delta("compat_spec_emitted_tokens_total")
    accepted = delta("compat_spec_accepted_tokens_total")
    assert usage["completion_tokens"] == 1 + (steps - verify) + emitted, (usage, after)
    assert emitted - verify <= accepted <= emitted - verify + 1, (emitted, verify, accepted)
    positions = status["positions"]
    assert sum(p["draft_tokens"] for p in positions) == status["draft_tokens"]
    assert sum(p["accepted_tokens"] for p in positions) == status["accepted_tokens"]
    for p in positions:
        label = f'{{position="{p["position"]}"}}'
        assert after[f"compat_spec_position_draft_tokens_total{label}"] == p["draft_tokens"]
        assert after[f"compat_spec_position_accepted_tokens_total{label}"] == p["accepted_tokens"]
    assert after["compat_spec_draft_tokens_total"] == status["draft_tokens"]
    assert after["compat_spec_draft_depth"] == status["draft_depth"]["max"] == 4
    assert after["compat_spec_drafting_rows_total"] == positions[0]["draft_tokens"]
    costs = {(c["rows"], c["width"]): c["ms"] for c in status["step_costs"]}
    assert (1, 1) in costs and any(width > 1 for _, width in costs), costs
    for (rows, width), ms in costs.items():
        seconds = after[f'compat_spec_step_cost_seconds{{rows="{rows}",width="{width}"}}']
        assert seconds * 1000 == pytest.approx(ms, abs=0.006), (rows, width)
    dashboard = httpx.get(f"{server.base_url}/v1/dashboard", timeout=30).json()
    assert dashboard["models"][0]["speculation"] == status


@pytest.fixture(scope="module")
def small_context_server(tiny_llama_model: LoadedModel) -> Iterator[RunningServer]:
    # The tiny llama (the embedded model's tokenizer and template): what it writes does not
    # matter here, only where it has to stop.
    running = start_server(tiny_llama_model, context_length=64)
    yield running
    running.stop()


def test_max_tokens_minus_one_runs_to_the_context(small_context_server: RunningServer) -> None:
    prompt = "Count: one two three four five six seven eight"
    for path, body in (
        ("/v1/completions", {"prompt": prompt}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}),
    ):
        reply = _post(
            small_context_server,
            path,
            {**body, "max_tokens": -1, "ignore_eos": True, "temperature": 0},
        ).json()
        usage = reply["usage"]
        assert reply["choices"][0]["finish_reason"] == "length", reply
        # Not a small default: generation went on until the window was full.
        assert usage["prompt_tokens"] + usage["completion_tokens"] >= 63, usage
        assert usage["completion_tokens"] > 16


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
        ("/v1/chat/completions", {"max_tokens": -2}, "max_tokens"),
        ("/v1/chat/completions", {"max_completion_tokens": -5}, "max_completion_tokens"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"max_tokens": -3}, "max_tokens"),
    ],
)
def test_bad_logprobs_and_max_tokens_are_400s_naming_the_field(
    server: RunningServer, path: str, body: dict[str, Any], field: str
) -> None:
    base = {"messages": CHAT} if "chat" in path else {"prompt": PROMPT}
    reply = _post(server, path, {**base, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field
    assert error["message"].startswith(field)
