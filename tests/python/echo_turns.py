"""A forced tool call and the next turn, per chat template, on one engine (shared by
tests/python/test_forced_calls_per_template.py and benches/echo_survival.py).

Turn 1: an OpenAI request forces the call (by default by name, `{"type": "function",
...}`; `any` sends `"required"`) and goes through the server's adapter (`chat_request`:
the template variables, tools and grammar a forced call gets), the template renders it,
the embedded model generates under the grammar of the format detected for the template,
and the format's parser reads the call back. Turn 2, as a client sends it next: the
server's own reply message (`chat_message`, what an OpenAI client echoes) and a tool
result, no `tool_choice` (the call is no longer forced), through the same adapter and
template; the engine's prefix cache reports how much of the new prompt it read.

Echo survival of a template = (turn-2 cache read - turn-1 prompt) / generated call
tokens, where the generated call tokens are those the model wrote before its stop token
(the stop token itself is never fed, so it has no K/V to reuse). Like the server, the
prompt builder remembers each reply with the prompt it answered (chat/reply_history.py),
so an echoed reply is spliced in as generated.

Turn 2 runs in two modes of the builder: "template" (the template's rendering alone:
what the template itself keeps of the call) and "loop" (the server's default: the echoed
reply spliced in as generated).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from compat_serve.chat.prompt import Prompt, PromptBuilder, PromptError
from compat_serve.chat.types import ChatRequest
from compat_serve.engine.types import EngineRequest, FinishReason
from compat_serve.parsers import OutputParsing, RequestTools
from compat_serve.parsers.events import ParsedTurn
from compat_serve.parsers.registry import detect_tool_format, resolve_reasoning
from compat_serve.server.openai.adapter import chat_message, chat_request
from compat_serve.server.openai.protocol import ChatCompletionRequest
from tests.shared_data import manifest_rows, templates_dir

if TYPE_CHECKING:
    from compat_serve.engine.engine import Engine
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
USER = {"role": "user", "content": "List the files in /tmp."}
TOOL_RESULT = "a.txt\nb.txt"
# How turn 1 forces the call: OpenAI `tool_choice` by choice name.
CHOICES: dict[str, Any] = {
    "named": {"type": "function", "function": {"name": "Bash"}},
    "any": "required",
}
# Templates that cannot render OpenAI-shaped `tools` (they need variables or shapes of
# their own).
NEEDS_OWN_VARIABLES = {
    "fireworks-ai-llama-3-firefunction-v2.jinja": "needs a `functions` string",
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": "needs Cohere `parameter_definitions`",
}


def tool_templates() -> list[str]:
    """Every template of ../shared/templates whose manifest says it defines tools."""
    return [
        row["file"]
        for row in manifest_rows()
        if row["tools"].startswith(("yes", "partial")) and row["file"] not in NEEDS_OWN_VARIABLES
    ]


# Turn 2 rendered by the template alone (measured as what it repeats of turn 1 and the
# call: a token-exact cache reads no more) / with the echoed reply spliced in (the
# server's default; run on the engine, which reports what its cache read).
MODES = ("template", "loop")


@dataclass
class NextTurn:
    """Turn 2 in one mode of the prompt builder."""

    prompt: tuple[int, ...] = ()
    text: str = ""
    read: int = 0  # prompt tokens the prefix cache served (run modes only)
    error: str = ""  # the template refused the conversation


@dataclass
class TemplateTurns:
    file: str
    builder: PromptBuilder
    parsing: OutputParsing
    request: EngineRequest
    parser: Any
    built: Prompt
    # Filled by run_first_turns:
    text: str = ""
    generated: tuple[int, ...] = ()
    finish: FinishReason | None = None
    turn: ParsedTurn | None = None
    # Filled by run_next_turns, by mode:
    next: dict[str, NextTurn] = field(default_factory=dict)

    @property
    def format(self) -> str:
        fmt = self.parsing.tool_format
        return fmt.name if fmt is not None else "none"

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_ids

    @property
    def call_tokens(self) -> int:
        """Tokens the model wrote for its call (the stop token is not among them)."""
        return len(self.generated)

    def echo_read(self, mode: str) -> int:
        """Tokens of the call the next turn read from the prefix cache."""
        return max(0, min(self.next[mode].read - len(self.prompt), self.call_tokens))

    def survival(self, mode: str) -> float:
        """Share of the call the next turn reads back: measured on the engine for "loop",
        the exact repeat (all a token-exact cache can read) for "template"."""
        reread = self.echo_exact(mode) if mode == "template" else self.echo_read(mode)
        return reread / self.call_tokens if self.call_tokens else 0.0

    def kept_prompt(self, mode: str) -> int:
        """Tokens of turn 1's prompt the next prompt starts with (all of them unless the
        template renders the history differently from its generation prompt)."""
        return _same_start(self.prompt, self.next[mode].prompt)

    def echo_exact(self, mode: str) -> int:
        """Tokens of the call the next prompt repeats exactly (an upper bound for any
        token-exact cache; the next prompt must also keep one token to compute)."""
        written = (*self.prompt, *self.generated)
        return max(0, _same_start(written, self.next[mode].prompt) - len(self.prompt))


def _same_start(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    same = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        same += 1
    return same


def openai_chat(body: dict[str, Any], max_tokens: int) -> ChatRequest:
    """A chat request as the server's OpenAI route makes it from `body` (greedy)."""
    wire = json.loads(json.dumps({"model": "m", "max_tokens": max_tokens, **body}))
    chat = chat_request(ChatCompletionRequest.model_validate(wire), default_max_tokens=max_tokens)
    return replace(chat, sampling=replace(chat.sampling, temperature=0))


def first_turn(
    model: LoadedModel, file: str, max_tokens: int = 256, choice: str = "named"
) -> TemplateTurns:
    template = (templates_dir() / file).read_text(encoding="utf-8")
    builder = PromptBuilder(template, model.tokenizer)
    body = {"messages": [USER], "tools": [BASH], "tool_choice": CHOICES[choice]}
    chat = openai_chat(body, max_tokens)
    prompt = builder.build(chat)
    parsing = OutputParsing(
        detect_tool_format(template), resolve_reasoning("auto", template), model.tokenizer
    )
    # As the server does (server/generation.py `admit_chat`).
    tools = RequestTools.from_chat_tools(
        chat.tools, only=chat.forced_tool, parallel=chat.parallel_tool_calls
    )
    request_parsing = parsing.for_request(
        tools, prompt.text, call_id_prefix="call_", tool_choice=chat.tool_choice
    )
    assert request_parsing.grammar is not None
    request = EngineRequest(
        f"forced-{file}",
        prompt.token_ids,
        chat.sampling,
        request_parsing.visible_special_ids,
        grammar=request_parsing.grammar,
    )
    return TemplateTurns(file, builder, parsing, request, request_parsing.parser, prompt)


async def _generate(engine: Engine, request: EngineRequest) -> tuple[str, list[Any]]:
    events = [event async for event in engine.submit(request)]
    return "".join(e.text for e in events), events


def run_first_turns(engine: Engine, jobs: list[TemplateTurns]) -> None:
    """Turn 1 of every template, batched; each job gets its text, tokens and parsed turn."""

    async def run_all() -> list[tuple[str, list[Any]]]:
        return await asyncio.gather(*(_generate(engine, job.request) for job in jobs))

    for job, (text, events) in zip(jobs, asyncio.run(run_all()), strict=True):
        job.text = text
        job.generated = tuple(t for e in events for t in e.token_ids)
        job.finish = events[-1].finish_reason
        if job.generated and job.generated[-1] == events[-1].stop_token_id:
            job.generated = job.generated[:-1]
        turn = ParsedTurn()
        for event in [*job.parser.feed(text), *job.parser.finish()]:
            turn.add(event)
        job.turn = turn
        # As the server does (server/generation.py): the reply's ids, and the reply with
        # its prompt.
        calls = [(call.id, call.name, call.arguments) for call in turn.tool_calls]
        job.builder.remember_generated(
            job.built, turn.text, calls, job.generated, events[-1].stop_token_id, turn.reasoning
        )


def next_turn_body(job: TemplateTurns) -> dict[str, Any]:
    """The request an OpenAI client sends next: the reply as the server returned it, then
    the tool's result; the call is no longer forced."""
    assert job.turn is not None and job.turn.tool_calls
    reply = chat_message(job.turn)
    result = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": TOOL_RESULT}
    return {"messages": [USER, reply, result], "tools": [BASH]}


def build_next_turns(jobs: list[TemplateTurns], mode: str) -> list[EngineRequest]:
    """Turn 2 of every job, rendered with the prompt builder in `mode` (each job's
    `next[mode]` gets its prompt or the template's refusal); the requests to run."""
    requests = []
    for job in jobs:
        chat = openai_chat(next_turn_body(job), max_tokens=1)
        job.builder.reply_history_mode = mode
        try:
            prompt = job.builder.build(chat)
        except PromptError as exc:  # the template refuses the echo (a 400 in the server)
            job.next[mode] = NextTurn(error=str(exc))
            continue
        job.next[mode] = NextTurn(prompt=prompt.token_ids, text=prompt.text)
        requests.append(EngineRequest(f"{mode} {job.file}", prompt.token_ids, chat.sampling))
    return requests


def run_next_turns(engine: Engine, jobs: list[TemplateTurns], mode: str) -> None:
    """Turn 2 of every job (one token each, after its turn 1 finished) with the prompt
    builder in `mode`: the prompt and how many of its tokens the prefix cache served.
    Run one mode only: a second would read what the first left in the cache."""
    requests = build_next_turns(jobs, mode)

    async def run_all() -> list[tuple[str, list[Any]]]:
        return await asyncio.gather(*(_generate(engine, r) for r in requests))

    by_id = {job.file: job for job in jobs}
    for request, (_, events) in zip(requests, asyncio.run(run_all()), strict=True):
        usage = events[-1].usage
        assert usage is not None, request.request_id
        by_id[request.request_id.split(" ", 1)[1]].next[mode].read = usage.cached_tokens


def table(jobs: list[TemplateTurns]) -> str:
    """The per-template echo table, in both modes, with the mean survivals: turn 1's
    prompt tokens and how many of them turn 2 read from the cache (`t1 read`), the call's
    tokens and the share of them turn 2 re-read."""
    rows = [
        f"{'template':52} {'format':16} {'turn1':>5} {'t1 read':>7} {'call':>4} "
        f"{'template: exact echo':>20} {'spliced: read2 echo':>19}"
    ]
    for job in jobs:
        spliced = job.next["loop"]
        notes = []
        for mode, name in (("template", "template"), ("loop", "spliced")):
            if job.next[mode].error:
                notes.append(f"{name}: refused: {job.next[mode].error}")
            elif job.kept_prompt(mode) < len(job.prompt):
                notes.append(f"{name}: history differs from turn 1 after {job.kept_prompt(mode)}")
        rows.append(
            f"{job.file:52} {job.format:16} {len(job.prompt):5} "
            f"{min(spliced.read, len(job.prompt)):7} {job.call_tokens:4} "
            f"{job.echo_exact('template'):15} {job.survival('template'):4.0%} "
            f"{spliced.read:14} {job.survival('loop'):4.0%}  {'; '.join(notes)}".rstrip()
        )
    rows.append(
        f"mean echo survival over {len(jobs)} templates: {mean_survival(jobs, 'template'):.1%} "
        f"from the templates' own rendering, {mean_survival(jobs, 'loop'):.1%} with the "
        "echoed reply spliced in (the server's default)"
    )
    return "\n".join(rows)


def mean_survival(jobs: list[TemplateTurns], mode: str) -> float:
    shares = [j.survival(mode) for j in jobs if j.call_tokens]
    return sum(shares) / len(shares) if shares else 0.0
