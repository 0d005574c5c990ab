"""A forced tool call round-trips on every tool-capable template in ../shared/templates,
and the next turn reads it back from the prefix cache.

Turn 1: the embedded model, prompted through the template, generates under the grammar of
the format detected for it, and the format's parser reads back exactly one valid call.
Turn 2: the reply as the server returned it and a tool result go back through the OpenAI
adapter and the template (tests/python/echo_turns.py); the prefix cache must serve at
least all of turn 1's prompt, and on average at least 80% of the generated call
(benches/echo_survival.py prints the same table).

One engine serves every template (requests batched), so this costs about one prefill per
template, plus each next turn's new tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING

import jsonschema
import pytest

from compat_serve.chat.prompt import PromptBuilder, PromptError
from compat_serve.engine.engine import Engine, EngineConfig
from compat_serve.engine.types import FinishReason
from tests.python.echo_turns import (
    BASH,
    NEEDS_OWN_VARIABLES,
    TemplateTurns,
    first_turn,
    mean_survival,
    run_first_turns,
    run_next_turns,
    table,
    tool_templates,
)
from tests.shared_data import templates_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

TOOL_TEMPLATES = tool_templates()


@pytest.fixture(scope="module")
def engine(embedded_model: LoadedModel) -> Iterator[Engine]:
    eng = Engine(embedded_model, EngineConfig(prefill_chunk=512))
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def first_turns(engine: Engine, embedded_model: LoadedModel) -> list[TemplateTurns]:
    jobs = [first_turn(embedded_model, file) for file in TOOL_TEMPLATES]
    run_first_turns(engine, jobs)
    return jobs


def test_templates_that_need_their_own_variables_say_so(embedded_model: LoadedModel) -> None:
    for file in NEEDS_OWN_VARIABLES:
        builder = PromptBuilder(
            (templates_dir() / file).read_text(encoding="utf-8"), embedded_model.tokenizer
        )
        with pytest.raises(PromptError):
            builder.render([{"role": "user", "content": "hi"}], tools=[BASH])


def test_a_forced_call_round_trips_on_every_tool_template(
    first_turns: list[TemplateTurns],
) -> None:
    assert len(TOOL_TEMPLATES) >= 25
    ended = {job.file: job.finish for job in first_turns}
    assert set(ended.values()) == {FinishReason.STOP_TOKEN}, ended
    schema = BASH["function"]["parameters"]  # type: ignore[index]
    for job in first_turns:
        assert job.turn is not None
        calls = job.turn.tool_calls
        assert len(calls) == 1, (job.file, job.format, job.text)
        assert calls[0].name == "Bash", (job.file, job.text)
        jsonschema.validate(json.loads(calls[0].arguments), schema)
        assert job.turn.text.strip() == "", (job.file, job.format, job.text)


def test_the_next_turn_reads_the_echoed_call_from_the_prefix_cache(
    engine: Engine, first_turns: list[TemplateTurns]
) -> None:
    run_next_turns(engine, first_turns)
    print("\n" + table(first_turns))
    short = {
        j.file: (j.next_read, len(j.prompt)) for j in first_turns if j.next_read < len(j.prompt)
    }
    assert short == {}, short
    assert mean_survival(first_turns) >= 0.8, table(first_turns)
