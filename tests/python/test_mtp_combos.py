"""`--speculative mtp` combined with the engine's other features, each greedy and token
for token against plain decoding with the same feature (tie-aware, tests/greedy_ties.py),
a random-weight head drafting on every step it can (test_mtp.py's `engine_for`).

The embedded SmolLM2: a JSON-schema grammar and a forced tool call (the grammar masks
drafts), a thinking budget (drafts stop short of the forced close) and 4-bit KV, each
against a plain engine with the same configuration. A tiny random llama (cheap long
prompts): the prefix cache's disk tier after RAM is flooded, and LoRA rows mixed with base
rows. Drafting is checked to have happened in each.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import pytest

from compat_serve.engine.engine import Engine
from compat_serve.engine.kv_quant import KVFormat
from compat_serve.engine.mtp_head import MTPHead, new_llama_head
from compat_serve.engine.reasoning_budget import ReasoningBudget
from compat_serve.engine.speculation import SpeculationConfig
from compat_serve.engine.types import EngineRequest, Grammar, Usage
from compat_serve.parsers.events import ToolCallArgsDelta, ToolCallStart
from compat_serve.parsers.registry import TOOL_FORMATS
from compat_serve.parsers.request_tools import RequestTools
from compat_serve.parsers.tool_calls import ToolCallParser
from compat_serve.parsers.tool_grammar import tool_call_grammar
from tests.chat_prompts import chat_ids
from tests.greedy_ties import (
    Q4_KV_TIE,
    assert_same_as_engine_or_near_tie,
    assert_same_or_near_tie,
)
from tests.python.test_batching import greedy
from tests.python.test_lora_engine import (
    adapter_dirs,  # noqa: F401 (a fixture)
    tiny_with_fast_paths,
)
from tests.python.test_lora_engine import prompt as lora_prompt
from tests.python.test_lora_engine import request as lora_request
from tests.python.test_lora_engine import run_all as lora_run_all
from tests.python.test_lora_engine import start as lora_start
from tests.python.test_lora_engine import tokens as lora_tokens
from tests.python.test_mtp import engine_for, random_head  # noqa: F401 (a fixture)
from tests.python.test_prefix_cache import run, started
from tests.python.test_prefix_disk import prompt_of, tiny  # noqa: F401 (a fixture)
from tests.python.test_speculative import FREE_PROMPT, outputs, tokens

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel


def drafted(engine: Engine) -> int:
    return int(engine.speculation_status()["draft_tokens"])  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def engines(
    embedded_model: LoadedModel,
    random_head: MTPHead,  # noqa: F811
) -> Iterator[tuple[Engine, Engine]]:
    """A plain engine and an MTP one, shared by the grammar and budget tests."""
    plain = engine_for(embedded_model, None)
    mtp = engine_for(embedded_model, random_head)
    yield plain, mtp
    plain.shutdown()
    mtp.shutdown()


def test_a_json_schema_masks_mtp_drafts_and_decodes_as_plain(
    engines: tuple[Engine, Engine], embedded_model: LoadedModel
) -> None:
    plain, mtp = engines
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    prompt = chat_ids(embedded_model, "Plan a trip: which city, and how many days? Answer in JSON.")
    grammar = Grammar("json_schema", json.dumps(schema))
    req = EngineRequest("j", prompt, greedy(32), grammar=grammar)
    before = drafted(mtp)
    want, got = outputs(plain, [req])[0], outputs(mtp, [req])[0]
    assert drafted(mtp) > before
    if assert_same_as_engine_or_near_tie(plain, req, tokens(want), tokens(got)):
        return  # parted on a near tie: the texts after it are not comparable
    reply = json.loads("".join(e.text for e in got))
    assert set(reply) == {"city", "days"} and isinstance(reply["days"], int), reply


def test_a_forced_tool_call_masks_mtp_drafts_and_decodes_as_plain(
    engines: tuple[Engine, Engine], embedded_model: LoadedModel
) -> None:
    """tool_choice forcing a call: the whole output is the format's call grammar
    (hermes, SmolLM2's), one call to the one tool; the call parses."""
    plain, mtp = engines
    fmt = TOOL_FORMATS["hermes"]
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = RequestTools({"get_weather": schema}, max_calls=1)
    source = tool_call_grammar(fmt, tools, mode="required")
    assert source is not None
    prompt = chat_ids(embedded_model, "What is the weather like in Paris today?")
    req = EngineRequest("c", prompt, greedy(40), grammar=Grammar("lark", source))
    before = drafted(mtp)
    want, got = outputs(plain, [req])[0], outputs(mtp, [req])[0]
    assert drafted(mtp) > before
    if assert_same_as_engine_or_near_tie(plain, req, tokens(want), tokens(got)):
        return  # parted on a near tie: the texts after it are not comparable
    parser = ToolCallParser(fmt, dict(tools.schemas), new_id=lambda: "call_0")
    parsed = [o for e in got for o in parser.feed(e.text)] + parser.finish()
    starts = [o for o in parsed if isinstance(o, ToolCallStart)]
    assert [s.name for s in starts] == ["get_weather"], parsed
    arguments = json.loads("".join(o.fragment for o in parsed if isinstance(o, ToolCallArgsDelta)))
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str), arguments


def test_a_thinking_budget_closes_at_the_same_token_with_mtp(
    engines: tuple[Engine, Engine], embedded_model: LoadedModel
) -> None:
    """The prompt opens the block; after 6 reasoning tokens the engine forces the close:
    drafts never run past it, and the forced tokens land where plain decoding has them."""
    plain, mtp = engines
    forced = tuple(embedded_model.tokenizer.encode("</think>\n\n"))
    budget = ReasoningBudget(6, "", "</think>", forced)
    prompt = (*chat_ids(embedded_model, FREE_PROMPT), *embedded_model.tokenizer.encode("<think>\n"))
    req = EngineRequest("r", prompt, greedy(20), reasoning_budget=budget)
    before = drafted(mtp)
    want, got = tokens(outputs(plain, [req])[0]), tokens(outputs(mtp, [req])[0])
    assert drafted(mtp) > before
    assert_same_as_engine_or_near_tie(plain, req, want, got)
    assert tuple(want[6 : 6 + len(forced)]) == forced, want
    assert tuple(got[6 : 6 + len(forced)]) == forced, got


def test_mtp_with_4_bit_kv_decodes_as_plain_4_bit_kv(
    embedded_model: LoadedModel,
    random_head: MTPHead,  # noqa: F811
) -> None:
    q4 = KVFormat(4, 64)
    req = EngineRequest("q", chat_ids(embedded_model, FREE_PROMPT), greedy(16))
    plain = engine_for(embedded_model, None, kv_format=q4)
    try:
        want = tokens(outputs(plain, [req])[0])
        mtp = engine_for(embedded_model, random_head, kv_format=q4)
        try:
            got = tokens(outputs(mtp, [req])[0])
            assert drafted(mtp) > 0
        finally:
            mtp.shutdown()
        assert_same_as_engine_or_near_tie(plain, req, want, got, tolerance=Q4_KV_TIE)
    finally:
        plain.shutdown()


# ---- a tiny random llama: the disk tier and LoRA rows -----------------------------------


def tiny_head(loaded: LoadedModel) -> SpeculationConfig:
    mx.random.seed(45)
    head = MTPHead(new_llama_head(loaded.model), loaded.model)
    return SpeculationConfig("mtp", num_tokens=3, mtp=head, cost_aware=False)


@dataclasses.dataclass
class DiskSession:
    reply_a: list[int]  # session A's reply (before the flood)
    continued: tuple[int, ...]  # A, its reply and 20 new tokens: read back from disk
    tokens: list[int]  # the continuation's reply
    usage: Usage
    from_disk: int  # tokens read from disk for the continuation


def disk_session(loaded: LoadedModel, cache_dir: Path, **config: Any) -> DiskSession:
    """test_prefix_disk's flood: session A, then B pushes A out of an 8-block RAM budget,
    then A continued is read back from disk."""
    engine = started(loaded, cache_dir=str(cache_dir), cache_memory_bytes=64 * 1024, **config)
    try:
        prefix = engine.prefix
        assert prefix is not None and prefix.cache.num_blocks == 8
        session_a = prompt_of(400, seed=2)
        reply_a, _ = run(engine, session_a)
        run(engine, prompt_of(400, seed=3))
        assert prefix.cache.lookup(list(session_a)) == 0
        before = prefix.metrics()["disk_hit_tokens"]
        continued = (*session_a, *reply_a, *prompt_of(20, seed=4))
        got, usage = run(engine, continued, max_tokens=12)
        from_disk = prefix.metrics()["disk_hit_tokens"] - before
        if config:
            assert drafted(engine) > 0
    finally:
        engine.shutdown()
    return DiskSession(reply_a, continued, got, usage, from_disk)


def test_a_repeat_read_back_from_disk_after_ram_is_flooded_is_the_same_with_mtp(
    tiny: LoadedModel,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Drafts never reach the disk tier: what is read back, and what is then generated,
    is exactly what the same session reads and generates without MTP."""
    plain = disk_session(tiny, tmp_path / "plain")
    mtp = disk_session(tiny, tmp_path / "mtp", speculation=tiny_head(tiny))
    session_a = prompt_of(400, seed=2)
    if assert_same_or_near_tie(tiny, session_a, plain.reply_a, mtp.reply_a):
        return  # session A parted on a near tie: the continuations are not comparable
    assert plain.from_disk >= 0.9 * len(session_a)
    assert mtp.from_disk == plain.from_disk
    assert (mtp.usage.cached_tokens, mtp.usage.cache_creation_tokens) == (
        plain.usage.cached_tokens,
        plain.usage.cache_creation_tokens,
    )
    assert_same_or_near_tie(tiny, plain.continued, plain.tokens, mtp.tokens)


def test_lora_rows_mixed_with_base_rows_decode_as_plain_with_mtp(
    embedded_model: LoadedModel,
    adapter_dirs: dict[str, Path],  # noqa: F811
) -> None:
    """Base rows and rows of two adapters in one batch, drafting from the base model's
    head (the adapters change the hidden state it reads, not the verification)."""
    loaded = tiny_with_fast_paths(embedded_model)
    # (adapter, prompt length, prompt salt): rows 1, 3 and 4 share a prompt.
    rows = [(None, 41, 0), ("style", 27, 1), ("peft", 9, 2), (None, 27, 1), ("commit", 27, 1)]
    reqs = [
        lora_request(f"l{i}", lora_prompt(n, salt), name) for i, (name, n, salt) in enumerate(rows)
    ]
    plain = lora_start(loaded, adapter_dirs, prefix_cache=False)
    try:
        want = [lora_tokens(e) for e in lora_run_all(plain, reqs)]
        mtp = lora_start(loaded, adapter_dirs, prefix_cache=False, speculation=tiny_head(loaded))
        try:
            got = [lora_tokens(e) for e in lora_run_all(mtp, reqs)]
            assert drafted(mtp) > 0
        finally:
            mtp.shutdown()
        for req, w, g in zip(reqs, want, got, strict=True):
            assert_same_as_engine_or_near_tie(plain, req, w, g)
    finally:
        plain.shutdown()
    assert want[1] != want[3] and want[4] != want[3]  # the adapters change the output
