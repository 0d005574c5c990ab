"""A forced tool call round-trips on every tool-capable template in ../shared/templates:
the embedded model, prompted through the template, generates under the grammar of the
format detected for it, and the format's parser reads back exactly one valid call.

One engine serves every template (requests batched), so this costs about one prefill
per template.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jsonschema
import pytest

from compat_serve.chat.prompt import PromptBuilder, PromptError
from compat_serve.chat.types import ChatRequest
from compat_serve.engine.engine import Engine, EngineConfig
from compat_serve.engine.types import EngineRequest, FinishReason, SamplingParams
from compat_serve.parsers import OutputParsing, RequestTools
from compat_serve.parsers.events import ParsedTurn
from compat_serve.parsers.registry import detect_tool_format, resolve_reasoning
from tests.shared_data import manifest_rows, templates_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

BASH = {
    "type": "function",
    "function": {
        "name": "Bash",
        "description": "Run a shell command",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "maxLength": 40},
                "timeout": {"type": "integer", "minimum": 1, "maximum": 600},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
    },
}
# Templates that cannot render OpenAI-shaped `tools` (they need variables or shapes of
# their own).
NEEDS_OWN_VARIABLES = {
    "fireworks-ai-llama-3-firefunction-v2.jinja": "needs a `functions` string",
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": "needs Cohere `parameter_definitions`",
}
TOOL_TEMPLATES = [
    row["file"]
    for row in manifest_rows()
    if row["tools"].startswith(("yes", "partial")) and row["file"] not in NEEDS_OWN_VARIABLES
]


@pytest.fixture(scope="module")
def engine(embedded_model: LoadedModel) -> Iterator[Engine]:
    eng = Engine(embedded_model, EngineConfig(prefill_chunk=512))
    eng.start()
    yield eng
    eng.shutdown()


def forced_call(model: LoadedModel, file: str) -> tuple[EngineRequest, OutputParsing, Any]:
    template = (templates_dir() / file).read_text(encoding="utf-8")
    builder = PromptBuilder(template, model.tokenizer)
    chat = ChatRequest(
        messages=[{"role": "user", "content": "List the files in /tmp."}],
        sampling=SamplingParams(max_tokens=256, temperature=0),
        tools=[BASH],
        tool_choice="required",
        parallel_tool_calls=False,
        template_kwargs={"enable_thinking": False},
    )
    prompt = builder.build(chat)
    parsing = OutputParsing(
        detect_tool_format(template), resolve_reasoning("auto", template), model.tokenizer
    )
    tools = RequestTools.from_chat_tools([BASH], parallel=False)
    request_parsing = parsing.for_request(
        tools, prompt.text, call_id_prefix="call_", tool_choice="required"
    )
    assert request_parsing.grammar is not None
    request = EngineRequest(
        f"forced-{file}",
        prompt.token_ids,
        chat.sampling,
        request_parsing.visible_special_ids,
        grammar=request_parsing.grammar,
    )
    return request, parsing, request_parsing.parser


def test_templates_that_need_their_own_variables_say_so(embedded_model: LoadedModel) -> None:
    for file in NEEDS_OWN_VARIABLES:
        builder = PromptBuilder(
            (templates_dir() / file).read_text(encoding="utf-8"), embedded_model.tokenizer
        )
        with pytest.raises(PromptError):
            builder.render([{"role": "user", "content": "hi"}], tools=[BASH])


def test_a_forced_call_round_trips_on_every_tool_template(
    engine: Engine, embedded_model: LoadedModel
) -> None:
    assert len(TOOL_TEMPLATES) >= 25
    jobs = [forced_call(embedded_model, file) for file in TOOL_TEMPLATES]

    async def run_all() -> list[tuple[str, FinishReason | None]]:
        async def one(request: EngineRequest) -> tuple[str, FinishReason | None]:
            events = [event async for event in engine.submit(request)]
            return "".join(e.text for e in events), events[-1].finish_reason

        return await asyncio.gather(*(one(request) for request, _, _ in jobs))

    results = asyncio.run(run_all())
    ended = {file: reason for file, (_, reason) in zip(TOOL_TEMPLATES, results, strict=True)}
    assert set(ended.values()) == {FinishReason.STOP_TOKEN}, ended
    outputs = [text for text, _ in results]
    schema = BASH["function"]["parameters"]  # type: ignore[index]
    for file, (_, parsing, parser), text in zip(TOOL_TEMPLATES, jobs, outputs, strict=True):
        turn = ParsedTurn()
        for event in [*parser.feed(text), *parser.finish()]:
            turn.add(event)
        calls = turn.tool_calls
        fmt = parsing.tool_format.name if parsing.tool_format else None
        assert len(calls) == 1, (file, fmt, text)
        assert calls[0].name == "Bash", (file, text)
        jsonschema.validate(json.loads(calls[0].arguments), schema)
        assert turn.text.strip() == "", (file, fmt, text)
