"""A forced tool call and the next turn, per chat template, on one engine (shared by
tests/python/test_forced_calls_per_template.py and benches/echo_survival.py).

Turn 1: the template renders a user request with one tool; the embedded model generates
under the grammar of the format detected for the template; the format's parser reads the
call back. Turn 2: the server's own reply message (`chat_message`, what an OpenAI client
echoes) and a tool result go back through the OpenAI adapter (`chat_messages`: JSON-string
arguments become objects, as the templates expect) and the template; the engine's prefix
cache reports how much of the new prompt it read.

Echo survival of a template = (turn-2 cache read - turn-1 prompt) / generated call
tokens, where the generated call tokens are those the model wrote before its stop token
(the stop token itself is never fed, so it has no K/V to reuse). Like the server, the
prompt builder remembers each reply's ids (chat/reply_tokens.py), so a reply the template
renders as written is tokenized as generated.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from compat_serve.chat.prompt import PromptBuilder, PromptError
from compat_serve.chat.types import ChatRequest
from compat_serve.engine.types import EngineRequest, FinishReason, SamplingParams
from compat_serve.parsers import OutputParsing, RequestTools
from compat_serve.parsers.events import ParsedTurn
from compat_serve.parsers.registry import detect_tool_format, resolve_reasoning
from compat_serve.server.openai.adapter import chat_message, chat_messages
from compat_serve.server.openai.protocol import ChatMessageIn
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


@dataclass
class TemplateTurns:
    file: str
    builder: PromptBuilder
    parsing: OutputParsing
    request: EngineRequest
    parser: Any
    # Filled by run_first_turns:
    text: str = ""
    generated: tuple[int, ...] = ()
    finish: FinishReason | None = None
    turn: ParsedTurn | None = None
    # Filled by run_next_turns:
    next_prompt: tuple[int, ...] = ()
    next_read: int = 0
    next_error: str = ""

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

    @property
    def echo_read(self) -> int:
        """Tokens of the call the next turn read from the prefix cache."""
        return max(0, min(self.next_read - len(self.prompt), self.call_tokens))

    @property
    def kept_prompt(self) -> int:
        """Tokens of turn 1's prompt the next prompt starts with (all of them unless the
        template renders the history differently from its generation prompt)."""
        same = 0
        for a, b in zip(self.prompt, self.next_prompt, strict=False):
            if a != b:
                break
            same += 1
        return same

    @property
    def echo_exact(self) -> int:
        """Tokens of the call the re-rendered next prompt repeats exactly (an upper bound
        for any token-exact cache; the next prompt must also keep one token to compute)."""
        written = (*self.prompt, *self.generated[: self.call_tokens])
        same = 0
        for a, b in zip(written, self.next_prompt, strict=False):
            if a != b:
                break
            same += 1
        return max(0, same - len(self.prompt))


def first_turn(model: LoadedModel, file: str, max_tokens: int = 256) -> TemplateTurns:
    template = (templates_dir() / file).read_text(encoding="utf-8")
    builder = PromptBuilder(template, model.tokenizer)
    chat = ChatRequest(
        messages=[USER],
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0),
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
    return TemplateTurns(file, builder, parsing, request, request_parsing.parser)


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
        job.builder.remember_reply(job.generated)  # as the server does (generation.py)
        turn = ParsedTurn()
        for event in [*job.parser.feed(text), *job.parser.finish()]:
            turn.add(event)
        job.turn = turn


def next_turn_messages(job: TemplateTurns) -> list[dict[str, Any]]:
    """The conversation an OpenAI client sends next: the reply as the server returned it,
    then the tool's result, through the server's adapter."""
    assert job.turn is not None and job.turn.tool_calls
    reply = chat_message(job.turn)
    result = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": TOOL_RESULT}
    wire = json.loads(json.dumps([USER, reply, result]))  # as it travels
    return chat_messages([ChatMessageIn.model_validate(m) for m in wire])


def run_next_turns(engine: Engine, jobs: list[TemplateTurns]) -> None:
    """Turn 2 of every job (one token each, after its turn 1 finished): the prompt and
    how many of its tokens the prefix cache served."""
    requests, rendered = [], []
    for job in jobs:
        chat = ChatRequest(
            messages=next_turn_messages(job),
            sampling=SamplingParams(max_tokens=1, temperature=0),
            tools=[BASH],
            template_kwargs={"enable_thinking": False},
        )
        try:
            prompt = job.builder.build(chat)
        except PromptError as exc:  # the template refuses the echo (a 400 in the server)
            job.next_error = str(exc)
            continue
        job.next_prompt = prompt.token_ids
        rendered.append(job)
        requests.append(EngineRequest(f"next-{job.file}", prompt.token_ids, chat.sampling))

    async def run_all() -> list[tuple[str, list[Any]]]:
        return await asyncio.gather(*(_generate(engine, r) for r in requests))

    for job, (_, events) in zip(rendered, asyncio.run(run_all()), strict=True):
        usage = events[-1].usage
        assert usage is not None, job.file
        job.next_read = usage.cached_tokens


def table(jobs: list[TemplateTurns]) -> str:
    """The per-template echo table, with the mean survival."""
    rows = [
        f"{'template':52} {'format':16} {'turn1':>5} {'call':>4} {'read2':>5} "
        f"{'echo':>4} {'exact':>5} {'survival':>8}"
    ]
    for job in jobs:
        share = job.echo_read / job.call_tokens if job.call_tokens else 0.0
        note = f"  next turn refused: {job.next_error}" if job.next_error else ""
        if not note and job.kept_prompt < len(job.prompt):
            note = f"  history differs from turn 1 after {job.kept_prompt} tokens"
        rows.append(
            f"{job.file:52} {job.format:16} {len(job.prompt):5} {job.call_tokens:4} "
            f"{job.next_read:5} {job.echo_read:4} {job.echo_exact:5} {share:8.0%}{note}"
        )
    rows.append(f"mean echo survival: {mean_survival(jobs):.1%} over {len(jobs)} templates")
    return "\n".join(rows)


def mean_survival(jobs: list[TemplateTurns]) -> float:
    shares = [j.echo_read / j.call_tokens for j in jobs if j.call_tokens]
    return sum(shares) / len(shares) if shares else 0.0
