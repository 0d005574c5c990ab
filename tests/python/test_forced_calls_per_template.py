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


# What the templates do, kept as it is (the echo cannot survive it):
# - the next turn cannot start with turn 1's prompt (the history renders the assistant
#   turn's start differently from the generation prompt), or the template refuses it;
HISTORY_DIFFERS = {
    "MiniMaxAI-MiniMax-M2.jinja": "the generation prompt's thinking opener is not kept",
    "Qwen-QwQ-32B.jinja": "the generation prompt's <think> is not kept",
    "Qwen-Qwen3-0.6B.jinja": "the empty <think></think> of thinking-off is not kept",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "the generation prompt's <think> is not kept",
    "google-gemma-4-31B-it.jinja": "the empty thought channel is not kept",
    "nvidia-NVIDIA-Nemotron-Nano-v2.jinja": "the generation prompt's <think> is not kept",
    "ibm-granite-granite-3.0-8b-instruct.jinja": "past calls are not rendered (content only)",
    "ibm-granite-granite-3.3-2b-instruct.jinja": "past calls are not rendered (content only)",
    "moonshotai-Kimi-K2-Instruct.jinja": "list.append: refused by the sandboxed renderer",
}
# - or the next turn keeps turn 1's prompt but renders the call otherwise than generated
#   (less than half of it as the model wrote it).
CALL_RENDERED_OTHERWISE = {
    "HuggingFaceTB-SmolLM3-3B.jinja": "past calls are not rendered",
    "LiquidAI-LFM2.5-Instruct.jinja": "past calls are not rendered",
    "ai-sage-GigaChat3-10B-A1.8B.jinja": "its own call syntax (detected as generic)",
    "unsloth-Apriel-1.5.jinja": "a <tool_calls>[...] list (detected as hermes)",
}


def test_the_next_turn_reads_the_echoed_call_from_the_prefix_cache(
    engine: Engine, first_turns: list[TemplateTurns]
) -> None:
    run_next_turns(engine, first_turns)
    print("\n" + table(first_turns))
    differs = {j.file for j in first_turns if j.next_error or j.kept_prompt < len(j.prompt)}
    assert differs == set(HISTORY_DIFFERS), table(first_turns)
    for job in first_turns:
        if job.next_error:
            continue
        # Everything the template keeps of turn 1's prompt is read from the cache: all of
        # it wherever the history repeats the generation prompt.
        assert job.next_read >= job.kept_prompt, (job.file, job.next_read, job.kept_prompt)
    # Less than half the call repeated as generated: rendered otherwise.
    lost = {j.file for j in first_turns if 2 * j.echo_exact < j.call_tokens}
    lost -= set(HISTORY_DIFFERS)
    assert lost == set(CALL_RENDERED_OTHERWISE), table(first_turns)
    echoing = [j for j in first_turns if j.file not in {*HISTORY_DIFFERS, *lost}]
    # Mistral Small 3.2 (the model's [CALL_ID] is the call's id), Devstral, Kimi-K2 (call
    # positions as indexes), GLM-4.6 (its newline before <tool_call>) and Step-3.5 (its
    # `\n</think>\n` when a forced call closes thinking) among them.
    assert len(echoing) >= 15
    assert mean_survival(echoing) >= 0.8, table(first_turns)
