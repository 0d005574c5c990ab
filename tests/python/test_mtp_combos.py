"""`--speculative mtp` combined with the engine's other features, each greedy and token
for token against plain decoding with the same feature (tie-aware, tests/greedy_ties.py),
a random-weight head drafting on every step it can (test_mtp.py's `engine_for`).

The embedded SmolLM2: a JSON-schema grammar (the grammar masks drafts), a thinking budget
(drafts stop short of the forced close) and 4-bit KV, each against a plain engine with
the same configuration. Drafting is checked to have happened in each.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from compat_serve.engine.engine import Engine
from compat_serve.engine.kv_quant import KVFormat
from compat_serve.engine.mtp_head import MTPHead
from compat_serve.engine.reasoning_budget import ReasoningBudget
from compat_serve.engine.types import EngineRequest, Grammar
from tests.chat_prompts import chat_ids
from tests.greedy_ties import assert_same_as_engine_or_near_tie
from tests.python.test_batching import greedy
from tests.python.test_mtp import engine_for, random_head  # noqa: F401 (a fixture)
from tests.python.test_speculative import FREE_PROMPT, outputs, tokens

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel


# 4-bit KV: the verify forward and a plain decode step write the same K/V rows up to float
# order, and a difference of one ulp moves a value across a 4-bit rounding boundary, a
# whole step (1/15 of the group's range, 17 times an 8-bit step). tests/greedy_ties.py
# records the top-two margin moving by up to 1.3 within 24 tokens under 4-bit KV
# (benches/greedy_tie_tolerances.py); a departure on a margin beyond that is a bug.
Q4_KV_TIE = 1.3


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
