"""A call forced by name round-trips on every tool-capable template in
../shared/templates, and the next turn, which no longer forces it, reads turn 1 and the
call back from the prefix cache (#34: a forced call used to render its prompt with
thinking off, so the next turn's history broke the prefix or the echo).

Turn 1: an OpenAI request naming the tool, through the server's adapter; the embedded
model, prompted through the template, generates under the grammar of the format detected
for it, and the format's parser reads back exactly one valid call. Turn 2: the reply as
the server returned it and a tool result go back through the OpenAI adapter and the
template with no `tool_choice` (tests/python/echo_turns.py). `any` (`required`) is
measured by benches/echo_survival.py; its grammar differs from the named one only in
allowing more calls (tests/python/test_tool_grammars.py). With the echoed reply spliced in as
generated (the server's default) the prefix cache must serve all of turn 1's prompt and
all of the generated call on every template that accepts the conversation; the
templates' own rendering is measured too, and what each keeps of the echo is pinned
(benches/echo_survival.py prints the same table).

One engine serves every template (requests batched), so this costs about one prefill per
template, plus each next turn's new tokens. CI runs one template per tool format; the
extended run (tests/extended.py) runs all of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING

import jsonschema
import pytest

from compat_serve.chat.prompt import PromptBuilder, PromptError
from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.types import FinishReason
from compat_serve.parsers.registry import detect_tool_format
from tests.extended import EXTENDED
from tests.python.echo_turns import (
    BASH,
    MODES,
    NEEDS_OWN_VARIABLES,
    TOOL_RESULT,
    TemplateTurns,
    build_next_turns,
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


# The tool formats of the models most run under coding agents. Every format's grammar and
# parser are checked in CI on scripted replies (tests/python/test_forced_calls_scripted.py,
# test_argument_schemas_per_format.py); this real-model round trip takes these in CI.
CI_FORMATS = (
    "hermes",
    "qwen3_coder",
    "harmony",
    "llama3",
)


def _one_per_format(files: list[str], formats: tuple[str, ...]) -> list[str]:
    """The first template (manifest order) of each of `formats`."""
    by_format: dict[str, str] = {}
    for file in files:
        found = detect_tool_format((templates_dir() / file).read_text(encoding="utf-8"))
        by_format.setdefault(found.name if found is not None else "none", file)
    missing = [name for name in formats if name not in by_format]
    assert not missing, f"no template of {missing} in ../shared/templates"
    return [by_format[name] for name in formats]


ALL_TOOL_TEMPLATES = tool_templates()
# CI runs one template of each of CI_FORMATS (4 of the 28 templates, 18 formats); the
# extended run (tests/extended.py) runs every one.
TOOL_TEMPLATES = ALL_TOOL_TEMPLATES if EXTENDED else _one_per_format(ALL_TOOL_TEMPLATES, CI_FORMATS)


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
    assert len(ALL_TOOL_TEMPLATES) >= 25
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


# What the templates do with the echo on their own (the builder in "template" mode, which
# substitutes no generated ids: the prompt is the tokenizer's ids of the template's text):
# - the next turn cannot start with turn 1's prompt because the history renders the
#   assistant turn's start differently from the generation prompt, or the template
#   refuses it (more templates differ only at turn 1's last token, which the whole-text
#   tokenization merges with the reply's first characters);
HISTORY_DIFFERS = {
    "MiniMaxAI-MiniMax-M2.jinja": "the generation prompt's thinking opener is not kept",
    "Qwen-QwQ-32B.jinja": "the generation prompt's <think> is not kept",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "the generation prompt's <think> is not kept",
    "google-gemma-4-31B-it.jinja": "the empty thought channel is not kept",
    "nvidia-NVIDIA-Nemotron-Nano-v2.jinja": "the generation prompt's <think> is not kept",
    "ibm-granite-granite-3.0-8b-instruct.jinja": "past calls are not rendered (content only)",
    "ibm-granite-granite-3.3-2b-instruct.jinja": "past calls are not rendered (content only)",
}
# - or the next turn keeps turn 1's prompt but renders the call otherwise than generated.
CALL_RENDERED_OTHERWISE = {
    "HuggingFaceTB-SmolLM3-3B.jinja": "past calls are not rendered",
    "LiquidAI-LFM2.5-Instruct.jinja": "past calls are not rendered",
    "ai-sage-GigaChat3-10B-A1.8B.jinja": "its own call syntax (detected as generic)",
    "unsloth-Apriel-1.5.jinja": "a <tool_calls>[...] list (detected as hermes)",
}
# With the echoed reply spliced in as generated (the server's default, "loop"), only a
# template that refuses the conversation keeps its turn 2 from the cache. None does since
# templates may change lists (#34: Kimi-K2-Instruct's `tool_response_queue.ids.append`).
REFUSED: set[str] = set()


@pytest.fixture(scope="module")
def next_turns(engine: Engine, first_turns: list[TemplateTurns]) -> list[TemplateTurns]:
    template_mode, spliced_mode = MODES
    build_next_turns(first_turns, template_mode)  # rendered only: see echo_turns.MODES
    run_next_turns(engine, first_turns, spliced_mode)
    print("\n" + table(first_turns))
    return first_turns


def test_what_the_templates_keep_of_the_echo_on_their_own(
    next_turns: list[TemplateTurns], embedded_model: LoadedModel
) -> None:
    mode = "template"
    refused = {j.file for j in next_turns if j.next[mode].error}
    assert refused == REFUSED, table(next_turns)
    differs = {j.file for j in next_turns if j.kept_prompt(mode) < len(j.prompt)} | refused
    assert set(HISTORY_DIFFERS) & set(TOOL_TEMPLATES) <= differs, table(next_turns)
    for job in next_turns:
        turn = job.next[mode]
        if job.file in refused:
            continue
        # No generated ids stand in for the tokenizer's (#25 item 4): the prompt is the
        # whole text tokenized, so the same request always renders the same ids.
        assert list(turn.prompt) == embedded_model.tokenizer.encode(
            turn.text, add_special_tokens=False
        ), job.file
        # A template that drops or rewrites the call keeps (almost) none of it.
        if job.file in CALL_RENDERED_OTHERWISE:
            assert 2 * job.echo_exact(mode) < job.call_tokens, (job.file, table(next_turns))


def test_the_next_turn_reads_turn_1_and_the_echoed_call_from_the_prefix_cache(
    next_turns: list[TemplateTurns],
) -> None:
    mode = "loop"
    refused = {j.file for j in next_turns if j.next[mode].error}
    assert refused == REFUSED, table(next_turns)
    for job in next_turns:
        if job.file in REFUSED:
            continue
        # The next prompt repeats all of turn 1's prompt and of the call the model wrote,
        # and the cache serves all of it but the call's last token: a forced call ends
        # when its grammar completes, so that token is never fed and has no K/V.
        assert job.kept_prompt(mode) == len(job.prompt), (job.file, table(next_turns))
        assert job.echo_exact(mode) == job.call_tokens, (job.file, table(next_turns))
        assert job.next[mode].read >= len(job.prompt) + job.call_tokens - 1, job.file
        # What follows the reply is the template's: the tool result (unless the
        # template drops it: Granite 3.0 renders only its own `tool_response` role), then
        # its generation prompt, as the template alone renders them.
        after = job.next[mode].text[len(job.built.text) :]
        result = TOOL_RESULT.splitlines()[0]
        assert (result in after) == (result in job.next["template"].text), job.file
        ending = job.next["template"].text[-12:]
        assert job.next[mode].text.endswith(ending), job.file
    assert mean_survival(next_turns, mode) >= 0.8, table(next_turns)
    assert mean_survival(next_turns, mode) > mean_survival(next_turns, "template")
