"""Forced calls end on every native format when the model keeps writing calls (#25
item 1), with what clients send by default (parallel calls allowed).

The realistic failure: after the forced call, the model writes the same call again, and
again, until `max_tokens`. A scripted model (tests/scripted_model.py) does exactly that
in each format (the call to `run_command` three times, as the format lays out several
calls); the server's own pieces run it: the format's grammar and parser (`--tool-parser
NAME` on a ChatML template), the engine, and the turn driver (server/turn.py) that stops
generating once the parser has what the request allows.

- A named tool (Anthropic `{"type": "tool"}`, OpenAI `{"type": "function"}`): the
  grammar allows exactly one call and then only the end: one call, ended by the grammar.
- `any` / `required`: the grammar lets the turn end after each call, and the repeated
  call ends it (parsers/repeats.py): one call, the repeats dropped.

One engine; all formats' requests batched (the scripted model costs nothing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.types import EngineRequest, FinishReason, SamplingParams
from compat_serve.parsers.registry import TOOL_FORMATS
from compat_serve.parsers.request_tools import RequestTools
from compat_serve.parsers.setup import OutputParsing
from compat_serve.server.turn import TurnOutput
from tests.python.test_tool_grammars import (
    LS,
    TOOLS,
    _array_rendered,
    _first_call,
    _native_rendered,
)
from tests.scripted_model import scripted_model

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

RUN_COMMAND = {
    "type": "function",
    "function": {"name": "run_command", "parameters": TOOLS["run_command"]},
}
# Between two blocks of calls, in the formats that write one block per call.
BLOCK_SEPARATORS = {
    "hermes": "\n",
    "generic": "\n",
    "qwen3_coder": "\n",
    "seed_oss": "\n",
    "glm45": "\n",
    "llama3": "; ",
    "mistral": "",
    "mistral_call_id": "",
    "mistral_args": "",
    "functionary_v3_1": "",
    "functionary_v3_2": "",
    "gemma4": "",
}
_DS = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>run_command\n```json\n{}\n```<｜tool▁call▁end｜>"  # noqa: RUF001
_KIMI = "<|tool_call_begin|>functions.run_command:{}<|tool_call_argument_begin|>{}<|tool_call_end|>"


def _keeps_calling(name: str) -> str:
    """The call to run_command `LS` three times in one turn, as format `name` writes
    several calls."""
    three = [LS, LS, LS]
    if name in BLOCK_SEPARATORS:
        first = _first_call(name)
        again = first.removeprefix("\n")  # GLM's newline comes before the first call only
        return BLOCK_SEPARATORS[name].join([first, again, again])
    if name in ("harmony", "minimax_m2", "lfm2"):
        return _native_rendered(name, three)
    if name == "deepseek_v3":
        calls = "\n".join(_DS.format(json.dumps(LS)) for _ in three)
        return f"<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>"  # noqa: RUF001
    if name == "kimi_k2":
        calls = "".join(_KIMI.format(i, json.dumps(LS)) for i in range(3))
        return f"<|tool_calls_section_begin|>{calls}<|tool_calls_section_end|>"
    return _array_rendered(name, three)


FORMATS = sorted(TOOL_FORMATS)
# Formats whose list of calls continues with a token that also ends the argument before it.
ROLLS_ON = {"lfm2"}


@pytest.fixture(scope="module")
def engine(embedded_model: LoadedModel) -> Iterator[tuple[Engine, LoadedModel]]:
    replies = [(f" format {name}.", _keeps_calling(name)) for name in FORMATS]
    loaded = scripted_model(embedded_model, embedded_model.chat_template or "", replies)
    eng = Engine(loaded, EngineConfig(prefill_chunk=512))
    eng.start()
    yield eng, loaded
    eng.shutdown()


@dataclasses.dataclass
class Forced:
    name: str
    named: bool
    calls: list[tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=list)
    finish: FinishReason | None = None
    ended_in_tool_calls: bool = False
    repeated: bool = False
    text: str = ""


async def _forced_call(engine: Engine, loaded: LoadedModel, job: Forced) -> None:
    prompt = f"<|im_start|>user\nCall it in format {job.name}.<|im_end|>\n<|im_start|>assistant\n"
    tools = RequestTools.from_chat_tools(
        [RUN_COMMAND], only="run_command" if job.named else None, parallel=True
    )
    parsing = OutputParsing(TOOL_FORMATS[job.name], None, loaded.tokenizer).for_request(
        tools, prompt, call_id_prefix="call_", tool_choice="required"
    )
    request = EngineRequest(
        f"{job.name}-{job.named}",
        tuple(loaded.tokenizer.encode(prompt)),
        SamplingParams(max_tokens=1024),  # no temperature: as clients send it
        parsing.visible_special_ids,
        grammar=parsing.grammar,
    )
    output = TurnOutput(engine.submit(request), parsing.parser)
    while not output.finished:
        step = await output.next()
        assert step is not None
        if step.finished:
            job.finish = step.engine.finish_reason
            job.ended_in_tool_calls = step.ended_in_tool_calls
    job.calls = [(c.name, json.loads(c.arguments)) for c in output.turn.tool_calls]
    job.repeated = parsing.parser.repeated_call
    job.text = output.turn.text


@pytest.fixture(scope="module")
def forced(engine: tuple[Engine, LoadedModel]) -> dict[tuple[str, bool], Forced]:
    eng, loaded = engine
    jobs = [Forced(name, named) for name in FORMATS for named in (True, False)]

    async def run_all() -> None:
        await asyncio.gather(*(_forced_call(eng, loaded, job) for job in jobs))

    asyncio.run(run_all())
    return {(job.name, job.named): job for job in jobs}


@pytest.mark.parametrize("name", FORMATS)
def test_a_forced_named_tool_makes_one_call_and_ends(
    forced: dict[tuple[str, bool], Forced], name: str
) -> None:
    job = forced[(name, True)]
    if name in ROLLS_ON:
        # `timeout=3), ` is tokenized `3`, `),`: the single-call grammar refuses `),`,
        # and the scripted model, with no other preference, writes more digits first.
        [(tool, arguments)] = job.calls
        assert (tool, arguments["command"]) == ("run_command", LS["command"]), job
    else:
        assert job.calls == [("run_command", LS)], job
    assert job.ended_in_tool_calls and job.text == "", job
    assert job.finish is not FinishReason.LENGTH, job


@pytest.mark.parametrize("name", FORMATS)
def test_a_required_call_ends_where_the_model_repeats_it(
    forced: dict[tuple[str, bool], Forced], name: str
) -> None:
    job = forced[(name, False)]
    assert job.calls == [("run_command", LS)], job
    assert job.ended_in_tool_calls and job.text == "", job
    assert job.repeated, job
