"""Constrained decoding in the engine on the real embedded model: masks per row, mixed
batches, the grammar's end, errors — each output checked against its grammar."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from compat_serve._native import GrammarError
from compat_serve.engine.config import EngineConfig
from compat_serve.engine.constraints import Grammars, masked_logits
from compat_serve.engine.engine import Engine
from compat_serve.engine.types import (
    EngineEvent,
    EngineRequest,
    FinishReason,
    Grammar,
    SamplingParams,
)
from tests.chat_prompts import chat_ids
from tests.greedy_ties import assert_same_or_near_tie

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0, "maximum": 50_000_000},
        "kind": {"enum": ["capital", "town"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "where": {
            "type": "object",
            "properties": {"country": {"type": "string", "maxLength": 20}},
            "required": ["country"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "population", "kind", "tags", "where"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(embedded_model: LoadedModel) -> Iterator[Engine]:
    eng = Engine(embedded_model, EngineConfig(prefill_chunk=128))
    eng.start()
    yield eng
    eng.shutdown()


def request(
    model: LoadedModel,
    request_id: str,
    text: str,
    grammar: Grammar | None,
    *,
    max_tokens: int = 96,
    temperature: float = 0.0,
    seed: int = 0,
) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    return EngineRequest(request_id, chat_ids(model, text), sampling, grammar=grammar)


async def gather(engine: Engine, requests: list[EngineRequest]) -> list[list[EngineEvent]]:
    async def one(req: EngineRequest) -> list[EngineEvent]:
        return [event async for event in engine.submit(req)]

    return await asyncio.gather(*(one(r) for r in requests))


def text_of(events: list[EngineEvent]) -> str:
    return "".join(e.text for e in events)


def tokens_of(events: list[EngineEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def test_sampled_json_validates_in_a_batch_with_free_rows(
    engine: Engine, embedded_model: LoadedModel
) -> None:
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    ask = "Describe Paris as JSON."
    free = [request(embedded_model, f"free{i}", "Name a color.", None) for i in range(2)]
    alone = asyncio.run(gather(engine, free[:1]))[0]
    constrained = [
        request(embedded_model, f"json{i}", ask, grammar, temperature=0.8, seed=i) for i in range(4)
    ]
    together = asyncio.run(gather(engine, [*constrained, *free]))
    for events in together[:4]:
        assert events[-1].finish_reason is FinishReason.STOP_TOKEN
        jsonschema.validate(json.loads(text_of(events)), SCHEMA)
    # Unconstrained rows sharing the batch generate what they generate alone (up to a
    # near tie: a batch sums in another order).
    for events in together[4:]:
        assert_same_or_near_tie(
            embedded_model, free[0].prompt_ids, tokens_of(alone), tokens_of(events)
        )


def test_regex_and_lark_constrain_greedy_output(
    engine: Engine, embedded_model: LoadedModel
) -> None:
    regex = Grammar("regex", r"(yes|no), because [a-z ]{1,30}\.")
    lark = Grammar("lark", 'start: "Answer: " NUM\nNUM: /[0-9]{1,4}/')
    out = asyncio.run(
        gather(
            engine,
            [
                request(embedded_model, "rx", "Is the sky blue?", regex),
                request(embedded_model, "lk", "What is 12 times 12?", lark),
            ],
        )
    )
    assert re.fullmatch(r"(yes|no), because [a-z ]{1,30}\.", text_of(out[0]))
    assert re.fullmatch(r"Answer: [0-9]{1,4}", text_of(out[1]))
    assert all(events[-1].finish_reason is FinishReason.STOP_TOKEN for events in out)


def test_a_grammar_that_cannot_finish_in_max_tokens_stops_for_length(
    engine: Engine, embedded_model: LoadedModel
) -> None:
    grammar = Grammar("regex", "a{50}")
    (events,) = asyncio.run(
        gather(engine, [request(embedded_model, "len", "Say a.", grammar, max_tokens=5)])
    )
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 5
    assert set(text_of(events)) == {"a"}


def test_a_bad_grammar_is_refused_at_submit_and_the_engine_keeps_serving(
    engine: Engine, embedded_model: LoadedModel
) -> None:
    bad = Grammar("json_schema", '{"type": "integer", "minimum": 9, "maximum": 1}', "x.schema")
    with pytest.raises(GrammarError):
        engine.submit(request(embedded_model, "bad", "hi", bad))
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        engine.submit(request(embedded_model, "bad2", "hi", Grammar("yaml", "a: 1")))
    (events,) = asyncio.run(
        gather(engine, [request(embedded_model, "ok", "hi", None, max_tokens=3)])
    )
    assert events[-1].finish_reason is FinishReason.LENGTH


def test_masked_logits_leave_free_rows_alone_and_forbid_the_rest(
    embedded_model: LoadedModel,
) -> None:
    tokenizer = embedded_model.tokenizer
    grammars = Grammars(tokenizer, tokenizer.vocab_size + 7)  # a padded head
    matcher = grammars.compile(Grammar("regex", "[0-9]"))
    logits = mx.array(np.random.default_rng(0).normal(size=(2, tokenizer.vocab_size + 7)))
    masked, errors = masked_logits(logits, [None, matcher])
    assert errors == [None, None]
    assert mx.array_equal(masked[0], logits[0])
    allowed = np.flatnonzero(np.array(masked[1]) > -1e29)
    assert allowed.size > 0
    assert all(tokenizer.decode([int(i)]) in "0123456789" for i in allowed)
    assert allowed.max() < tokenizer.vocab_size


@pytest.mark.parametrize("reasoning", ["open", "optional"])
def test_an_output_format_starts_after_the_reasoning(
    embedded_model: LoadedModel, reasoning: str
) -> None:
    from compat_serve.parsers.tool_grammar import after_reasoning

    tokenizer = embedded_model.tokenizer
    grammars = Grammars(tokenizer, tokenizer.vocab_size)
    schema = {"type": "object", "properties": {"a/b": {"enum": [1]}}, "required": ["a/b"]}
    for grammar, answer in (
        (Grammar("json_schema", json.dumps(schema), "f"), '{"a/b": 1}'),
        (Grammar("regex", "x/y[0-9]", "f"), "x/y7"),
    ):
        wrapped = after_reasoning(grammar, reasoning)
        assert (wrapped.kind, wrapped.field) == ("lark", "f")
        thought = "Let me think.</think>\n\n" if reasoning == "open" else "<think>Hm.</think>\n"
        matcher = grammars.compile(wrapped)
        for token in tokenizer.encode(thought + answer):
            matcher.consume(token)
        assert matcher.is_accepting()
        assert after_reasoning(grammar, "none") is grammar
    # Without reasoning the answer must come first.
    matcher = grammars.compile(after_reasoning(Grammar("regex", "x/y[0-9]"), "optional"))
    for token in tokenizer.encode("x/y3"):
        matcher.consume(token)
    assert matcher.is_accepting()
