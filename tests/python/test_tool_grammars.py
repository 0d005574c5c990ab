"""Golden tests: each native tool-call format's grammar against its own parser.

A grammar is compiled against the embedded model's vocabulary and walked with seeded
random logits (no model): every token is drawn among those the grammar allows. The text
is then parsed by the format's real output parser (as the server sets it up), and the
calls must come back exactly: known tools, arguments valid against their schemas, as many
calls as the mode allows, and no markup left in the text.

Two vocabularies: the embedded one as it is (all markup is plain text), and the same with
every format's markup and the reasoning tags added as special tokens (as real DeepSeek,
Kimi, Mistral and Llama vocabularies have theirs), so both ways of writing markup in a
grammar are covered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jsonschema
import numpy as np
import pytest

from compat_serve.engine.constraints import GrammarError, GrammarMatcher, Grammars
from compat_serve.models.tokenizer import Tokenizer
from compat_serve.parsers.events import assemble
from compat_serve.parsers.lark import arguments_schema
from compat_serve.parsers.reasoning import THINK_CLOSE, THINK_OPEN
from compat_serve.parsers.registry import TOOL_FORMATS, resolve_reasoning
from compat_serve.parsers.request_tools import RequestTools
from compat_serve.parsers.scan import WHITESPACE
from compat_serve.parsers.setup import OutputParsing
from compat_serve.parsers.tool_calls import ToolFormat
from compat_serve.parsers.tool_grammar import special_markup, tool_call_grammar
from tests.shared_data import templates_dir

if TYPE_CHECKING:
    from collections.abc import Mapping

TOOLS: dict[str, Mapping[str, Any]] = {
    "run_command": {
        "type": "object",
        "properties": {
            "command": {"type": "string", "maxLength": 40},
            "timeout": {"type": "integer", "minimum": 1, "maximum": 600},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
    "set_mode": {
        "type": "object",
        "properties": {
            "mode": {"type": "string", "enum": ["fast", "slow", "auto"]},
            "options": {
                "type": "object",
                "properties": {
                    "retries": {"type": "integer", "minimum": 0, "maximum": 5},
                    "verbose": {"type": "boolean"},
                },
                "required": ["retries"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        },
        "required": ["mode", "options"],
        "additionalProperties": False,
    },
    "ping": {},  # no schema: any object
}

ALL_MARKUP = sorted(
    {m for f in TOOL_FORMATS.values() for m in f.markup} | {THINK_OPEN, THINK_CLOSE}
)

# Text that closes what is open (string values, JSON, sections), tried late in a walk so
# that random walks end well within the token bound.
CLOSERS = (
    THINK_CLOSE,
    "\n</parameter>",
    "</parameter>",
    "</arg_value>",
    "</arg_key>",
    "</function>",
    "</tool_call>",
    "</seed:tool_call>",
    *(f.markup[1] for f in TOOL_FORMATS.values() if f.name in ("deepseek_v3", "kimi_k2")),
    '"',
    # Inside a free object (`ping` has no schema) a closed key needs its colon before
    # any closer can end the object.
    '": 0',
    "\n]\n```",  # Command R+'s action block ends its array, then the fence
    "}",
    "]",
    ">",
)

# Where each format's calls begin in the raw output: one per call.
CALL_STARTS = {
    "harmony": ("to=functions.",),
    "minimax_m2": ('<invoke name="',),
    "gemma4": ("<|tool_call>",),
    "lfm2": ("run_command(", "set_mode(", "ping("),
    "hermes": ("<tool_call>",),
    "generic": ("<tool_call>",),
    "qwen3_coder": ("<function=",),
    "seed_oss": ("<function=",),
    "glm45": ("<tool_call>",),
    "llama3": ('{"name"',),
    "mistral": ("[ARGS]", '{"name"'),
    "mistral_call_id": ("[CALL_ID]",),
    "mistral_args": ("[ARGS]",),
    "deepseek_v3": ("<｜tool▁call▁begin｜>",),  # noqa: RUF001 (DeepSeek's own markup)
    "kimi_k2": ("<|tool_call_begin|>",),
    "nemotron": ('{"name"',),
    "granite": ('{"name"',),
    "phi4_mini": ('{"name"',),
    "command_r7b": ('"tool_call_id"',),
    "command_r_plus": ('"tool_name"',),
    "functionary_v3_1": ("<function=",),
    # `>>>` alone also turns up inside random strings (`</seed:tool_call>>>`).
    "functionary_v3_2": tuple(f">>>{name}\n" for name in TOOLS),
}

# The markup that starts a block of calls (what a model writes to start calling in auto).
TRIGGERS = {name: starts[0] for name, starts in CALL_STARTS.items()}
TRIGGERS.update(
    {
        "harmony": " to=functions.",
        "minimax_m2": "<minimax:tool_call>",
        "lfm2": "<|tool_call_start|>",
        "qwen3_coder": "<tool_call>",
        "seed_oss": "<seed:tool_call>",
        "mistral": "[TOOL_CALLS]",
        "mistral_call_id": "[TOOL_CALLS]",
        "mistral_args": "[TOOL_CALLS]",
        "deepseek_v3": "<｜tool▁calls▁begin｜>",  # noqa: RUF001
        "kimi_k2": "<|tool_calls_section_begin|>",
        "nemotron": "<TOOLCALL>",
        "granite": "<|tool_call|>",
        "phi4_mini": "<|tool_call|>",
        "command_r7b": "<|START_ACTION|>",
        "command_r_plus": "Action:\n```json",
        "functionary_v3_2": ">>>",
    }
)

MAX_TOKENS = 1000  # Command R+ lays calls out with indent 4: a long random walk


@dataclass
class Vocab:
    tokenizer: Tokenizer
    grammars: Grammars
    size: int
    closers: list[list[int]]
    is_eos: np.ndarray  # [size] bool: the tokenizer's end-of-sequence ids


def _vocab(tokenizer: Tokenizer) -> Vocab:
    size = tokenizer.backend.get_vocab_size()
    closers = [tokenizer.encode(c) for c in CLOSERS]
    is_eos = np.zeros(size, dtype=bool)
    is_eos[sorted(tokenizer.eos_token_ids)] = True
    return Vocab(tokenizer, Grammars(tokenizer, size), size, closers, is_eos)


@pytest.fixture(scope="session")
def plain(gguf_tokenizer: Tokenizer) -> Vocab:
    return _vocab(gguf_tokenizer)


@pytest.fixture(scope="session")
def special(gguf_tokenizer: Tokenizer) -> Vocab:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_str(gguf_tokenizer.backend.to_str())
    backend.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in ALL_MARKUP])
    tokenizer = Tokenizer(
        backend,
        eos_token=gguf_tokenizer.eos_token,
        extra_eos_token_ids=gguf_tokenizer.eos_token_ids,
    )
    return _vocab(tokenizer)


@pytest.fixture(params=["plain", "special"])
def vocab(request: pytest.FixtureRequest) -> Vocab:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


# ---- the walk -----------------------------------------------------------------------------


class Walk:
    """Random-logit generation under a grammar, with scripted text where a test needs the
    model to do something (open a call, close its reasoning)."""

    def __init__(self, vocab: Vocab, matcher: GrammarMatcher, seed: int) -> None:
        self.vocab = vocab
        self.matcher = matcher
        self.rng = np.random.default_rng(seed)
        self.tokens: list[int] = []

    def allowed(self) -> np.ndarray:
        bits = np.unpackbits(np.frombuffer(self.matcher.mask(), dtype=np.uint8), bitorder="little")
        return np.flatnonzero(bits[: self.vocab.size])

    def take(self, token: int) -> None:
        self.matcher.consume(token)
        self.tokens.append(token)

    def random(self, steps: int) -> None:
        """`steps` tokens drawn with normal logits among the allowed ones (never EOS)."""
        for _ in range(steps):
            self._draw(self.allowed())

    def _draw(self, allowed: np.ndarray) -> None:
        """One token drawn among `allowed` (the ids the grammar allows now) but EOS."""
        ids = allowed[~self.vocab.is_eos[allowed]]
        assert ids.size, "the grammar allows nothing but the end here"
        self.take(int(ids[np.argmax(self.rng.standard_normal(ids.size))]))

    def can_write(self, text: str) -> bool:
        ids = self.vocab.tokenizer.encode(text)
        return self.matcher.validate(ids) == len(ids)

    def write(self, text: str) -> None:
        assert self.can_write(text), f"the grammar refuses {text!r} after {self.text()!r}"
        for token in self.vocab.tokenizer.encode(text):
            self.take(token)

    def finish(self, warm: int = 4) -> None:
        """Random tokens, closing what is open once `warm` steps have passed, until EOS."""
        steps = 0
        while len(self.tokens) < MAX_TOKENS:
            if self.matcher.is_stopped():  # complete, nothing can follow: ends like EOS
                return
            ids = self.allowed()
            eos = [int(i) for i in ids[self.vocab.is_eos[ids]]]
            if eos and (len(eos) == ids.size or (steps >= warm and self.rng.random() < 0.8)):
                self.matcher.consume(eos[0])
                return
            steps += 1
            if steps > warm and self.rng.random() < 0.7:
                valid = [c for c in self.vocab.closers if self._valid(c)]
                if valid:
                    for token in valid[self.rng.integers(len(valid))]:
                        self.take(token)
                    continue
            self._draw(ids)  # `validate` leaves the matcher as it was: `ids` still hold
        raise AssertionError(f"no end within {MAX_TOKENS} tokens: {self.text()!r}")

    def _valid(self, tokens: list[int]) -> bool:
        return self.matcher.validate(tokens) == len(tokens)

    def text(self, tokens: list[int] | None = None) -> str:
        ids = self.tokens if tokens is None else tokens
        return self.vocab.tokenizer.decode(ids, skip_special_tokens=False)


def _compile(vocab: Vocab, fmt: ToolFormat, tools: RequestTools, **kw: Any) -> GrammarMatcher:
    source = tool_call_grammar(
        fmt, tools, special_tokens=special_markup(fmt, vocab.tokenizer), **kw
    )
    assert source is not None
    return vocab.grammars.table.compile("lark", source)


def _parse(vocab: Vocab, fmt: ToolFormat, tools: RequestTools, walk: Walk, reasoning: str) -> Any:
    """The walk's tokens through the server's output parser, streamed token by token."""
    return _parse_turn(vocab, fmt, tools, walk, reasoning)[0]


def _parse_turn(
    vocab: Vocab, fmt: ToolFormat, tools: RequestTools, walk: Walk, reasoning: str
) -> tuple[Any, bool]:
    """The parsed turn, and whether it ended at a repeated call (the parser stops there,
    as the server stops generating)."""
    prompt = "<|im_start|>assistant\n" + ("<think>\n" if reasoning == "open" else "")
    parsing = OutputParsing(fmt, reasoning != "none", vocab.tokenizer)
    parser = parsing.for_request(tools, prompt, call_id_prefix="call_").parser
    decoder = vocab.tokenizer.decode_stream(skip_special_tokens=False)
    events = []
    for token in walk.tokens:
        events += parser.feed(decoder.step(token))
    return assemble(events + parser.finish()), parser.repeated_call


_VALIDATORS: dict[str, Any] = {}


def _arguments_validator(schema: Mapping[str, Any]) -> Any:
    """What `jsonschema.validate` builds for `schema` (checked against its metaschema),
    built once per schema rather than once per call checked."""
    key = json.dumps(schema, sort_keys=True)
    if key not in _VALIDATORS:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
        _VALIDATORS[key] = cls(schema)
    return _VALIDATORS[key]


def _check_calls(
    fmt: ToolFormat, tools: RequestTools, turn: Any, raw: str, repeated: bool = False
) -> None:
    for call in turn.tool_calls:
        assert call.name in tools.schemas
        arguments = json.loads(call.arguments)
        _arguments_validator(arguments_schema(tools.schemas[call.name])).validate(arguments)
    made = [(c.name, json.loads(c.arguments)) for c in turn.tool_calls]
    assert all(made[i] not in made[:i] for i in range(len(made))), raw  # no call twice
    # Parsed back exactly: one parsed call for each call written, up to a repeated one.
    written = sum(raw.count(m) for m in CALL_STARTS[fmt.name])
    if tools.max_calls is None:
        assert len(turn.tool_calls) == written or (repeated and len(made) < written), raw
    for leaked in (*fmt.markup, *fmt.regions, THINK_OPEN, THINK_CLOSE):
        assert leaked not in turn.text, (leaked, raw)
    # Reasoning is free text (it may well mention markup), but it ends at its tag.
    assert THINK_OPEN not in turn.reasoning
    assert THINK_CLOSE not in turn.reasoning


def _expected_reasoning(raw: str, reasoning: str) -> str:
    if reasoning == "open":
        return raw[: raw.index(THINK_CLOSE)].strip(WHITESPACE)
    head = raw.lstrip(WHITESPACE)
    if reasoning == "optional" and head.startswith(THINK_OPEN):
        return head[len(THINK_OPEN) : head.index(THINK_CLOSE)].strip(WHITESPACE)
    return ""


def _run(
    vocab: Vocab,
    name: str,
    mode: str,
    max_calls: int | None,
    reasoning: str,
    seed: int,
) -> tuple[Any, str]:
    fmt = TOOL_FORMATS[name]
    tools = RequestTools(TOOLS, max_calls)
    walk = Walk(vocab, _compile(vocab, fmt, tools, mode=mode, reasoning=reasoning), seed)
    if reasoning == "optional" and seed % 2:
        walk.write(THINK_OPEN)
    if reasoning == "open" or (reasoning == "optional" and seed % 2):
        walk.random(3)
        walk.write(THINK_CLOSE)
    if mode == "auto":
        walk.random(3)
        walk.write(TRIGGERS[name])
    if mode == "none":
        walk.random(3)
        for marker in fmt.regions:
            assert not walk.can_write(marker), (marker, walk.text())
    walk.finish()
    raw = walk.text()
    turn, repeated = _parse_turn(vocab, fmt, tools, walk, reasoning)
    _check_calls(fmt, tools, turn, raw, repeated)
    assert turn.reasoning == _expected_reasoning(raw, reasoning), raw
    return turn, raw


# ---- golden walks -------------------------------------------------------------------------

FORMATS = list(TOOL_FORMATS)
# Harmony's free text is its channel messages: only forced calls are constrained, and its
# reasoning is a channel, not `<think>`.
FREE_TEXT_FORMATS = [n for n in FORMATS if TOOL_FORMATS[n].free_text_grammar]
THINK_FORMATS = [n for n in FREE_TEXT_FORMATS if TOOL_FORMATS[n].whole_output is None]


@pytest.mark.parametrize("max_calls", [1, None])
@pytest.mark.parametrize("name", FORMATS)
def test_required_calls_parse_back(vocab: Vocab, name: str, max_calls: int | None) -> None:
    for seed in range(2):
        turn, raw = _run(vocab, name, "required", max_calls, "none", seed)
        assert len(turn.tool_calls) >= 1, raw
        if max_calls == 1:
            assert len(turn.tool_calls) == 1, raw
        assert turn.text == "", raw


@pytest.mark.parametrize("max_calls", [1, None])
@pytest.mark.parametrize("name", FREE_TEXT_FORMATS)
def test_auto_call_is_constrained_once_started(
    vocab: Vocab, name: str, max_calls: int | None
) -> None:
    for seed in range(2):
        turn, raw = _run(vocab, name, "auto", max_calls, "none", seed)
        assert len(turn.tool_calls) >= 1, raw
        if max_calls == 1:
            assert len(turn.tool_calls) == 1, raw


@pytest.mark.parametrize("max_calls", [1, None])
@pytest.mark.parametrize("name", FREE_TEXT_FORMATS)
def test_none_never_starts_a_call(vocab: Vocab, name: str, max_calls: int | None) -> None:
    turn, raw = _run(vocab, name, "none", max_calls, "none", 0)
    assert turn.tool_calls == [], raw
    assert turn.text, raw


@pytest.mark.parametrize("mode", ["required", "auto", "none"])
@pytest.mark.parametrize("reasoning", ["open", "optional"])
@pytest.mark.parametrize("name", THINK_FORMATS)
def test_constraint_starts_after_reasoning(
    plain: Vocab, name: str, reasoning: str, mode: str
) -> None:
    for seed in (0, 1):  # "optional": seed 1 thinks, seed 0 does not
        turn, raw = _run(plain, name, mode, None, reasoning, seed)
        assert (len(turn.tool_calls) >= 1) == (mode != "none"), raw
        if reasoning == "open" or seed:
            assert turn.reasoning, raw


@pytest.mark.parametrize("name", ["hermes", "deepseek_v3"])
def test_special_reasoning_tags(special: Vocab, name: str) -> None:
    turn, raw = _run(special, name, "required", None, "open", 0)
    assert turn.tool_calls and turn.reasoning, raw


# ---- what the templates render is what the grammar accepts ---------------------------------

LS, PWD = {"command": "ls -la", "timeout": 3}, {"command": "pwd", "timeout": 1}
# Two more, for the layout Mistral writes after the first two (calls are never repeated).
DU, DF = {"command": "du -sh", "timeout": 9}, {"command": "df", "timeout": 2}


def _array_rendered(name: str, calls: list[dict[str, Any]]) -> str:
    """Calls to run_command in the formats that write one JSON list of calls, as their
    templates render them (Command R+'s renders arguments with `tojson(indent=4)`; the
    grammar writes them compact)."""
    if name == "command_r7b":
        items = [
            f'{{"tool_call_id": "{i}", "tool_name": "run_command", "parameters": {json.dumps(c)}}}'
            for i, c in enumerate(calls)
        ]
        return "<|START_ACTION|>[\n    " + ",\n    ".join(items) + "\n]<|END_ACTION|>"
    if name == "command_r_plus":
        head = '{\n        "tool_name": "run_command",\n        "parameters": '
        items = [f"{head}{json.dumps(c)}\n    }}" for c in calls]
        return "Action:\n```json\n[\n    " + ",\n    ".join(items) + "\n]```"
    if name == "functionary_v3_1":
        return "".join(f"<function=run_command>{json.dumps(c)}</function>" for c in calls)
    if name == "functionary_v3_2":
        return "".join(f">>>run_command\n{json.dumps(c)}" for c in calls)
    listed = ", ".join(f'{{"name": "run_command", "arguments": {json.dumps(c)}}}' for c in calls)
    return {
        "nemotron": f"<TOOLCALL>[{listed}]</TOOLCALL>",
        "granite": f"<|tool_call|>[{listed}]",
        "phi4_mini": f"<|tool_call|>[{listed}]<|/tool_call|>",
    }[name]


ARRAY_FORMATS = (
    "nemotron",
    "granite",
    "phi4_mini",
    "command_r7b",
    "command_r_plus",
    "functionary_v3_1",
    "functionary_v3_2",
)


def _native_rendered(name: str, calls: list[dict[str, Any]]) -> str:
    """Calls to run_command as openai-gpt-oss-120b (one call per assistant message, after
    the prompt's `<|start|>assistant`), MiniMax-M2, Gemma 4 and LFM2 write them."""
    if name == "harmony":
        head = " to=functions.run_command<|channel|>commentary json<|message|>"
        return "<|start|>assistant".join(f"{head}{json.dumps(c)}<|call|>" for c in calls)
    if name == "minimax_m2":
        invokes = "".join(
            '<invoke name="run_command">\n'
            + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in c.items())
            + "</invoke>\n"
            for c in calls
        )
        return f"<minimax:tool_call>\n{invokes}</minimax:tool_call>"
    if name == "gemma4":
        return "".join(
            f'<|tool_call>call:run_command{{command:<|"|>{c["command"]}<|"|>,'
            f"timeout:{c['timeout']}}}<tool_call|>"
            for c in calls
        )
    listed = ", ".join(
        f'run_command(command="{c["command"]}", timeout={c["timeout"]})' for c in calls
    )
    return f"<|tool_call_start|>[{listed}]<|tool_call_end|>"


NATIVE_FORMATS = ("harmony", "minimax_m2", "gemma4", "lfm2")


def _rendered(name: str) -> str:
    """Two calls (`LS`, `PWD`) to run_command as each format's chat template renders them
    in an assistant turn (Llama 3's template takes one call per turn)."""
    if name in NATIVE_FORMATS:
        return _native_rendered(name, [LS, PWD])
    if name in ARRAY_FORMATS:
        return _array_rendered(name, [LS, PWD])
    ls, pwd, du, df = json.dumps(LS), json.dumps(PWD), json.dumps(DU), json.dumps(DF)
    hermes = '<tool_call>\n{{"name": "run_command", "arguments": {}}}\n</tool_call>'
    qwen = (
        "<tool_call>\n<function=run_command>\n<parameter=command>\n{}\n</parameter>\n"
        "<parameter=timeout>\n{}\n</parameter>\n</function>\n</tool_call>"
    )
    seed = (
        "<seed:tool_call>\n<function=run_command>\n<parameter=command>{}</parameter>\n"
        "<parameter=timeout>{}</parameter>\n</function>\n</seed:tool_call>"
    )
    glm = (
        "<tool_call>run_command\n<arg_key>command</arg_key>\n<arg_value>{}</arg_value>\n"
        "<arg_key>timeout</arg_key>\n<arg_value>{}</arg_value>\n</tool_call>"
    )
    deepseek = (
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>run_command\n```json\n{}\n```"  # noqa: RUF001
        "<｜tool▁call▁end｜>"  # noqa: RUF001
    )
    kimi = (
        "<|tool_call_begin|>functions.run_command:{}<|tool_call_argument_begin|>{}<|tool_call_end|>"
    )
    return {
        "hermes": hermes.format(ls) + "\n" + hermes.format(pwd),
        "generic": hermes.format(ls) + "\n" + hermes.format(pwd),
        "qwen3_coder": qwen.format("ls -la", 3) + "\n" + qwen.format("pwd", 1),
        "seed_oss": seed.format("ls -la", 3) + "\n" + seed.format("pwd", 1),
        # GLM's template puts a newline before the first call, after `<think></think>`.
        "glm45": "\n" + glm.format("ls -la", 3) + "\n" + glm.format("pwd", 1),
        "llama3": f'{{"name": "run_command", "parameters": {ls}}}',
        # Mistral Small 3.2 (call ids), Devstral (none), Nemo (one array, ids inside).
        "mistral": f"[TOOL_CALLS]run_command[CALL_ID]abc123xyz[ARGS]{ls}"
        f"[TOOL_CALLS]run_command[ARGS]{pwd}"
        f'[TOOL_CALLS][{{"name": "run_command", "arguments": {du}, "id": "def456uvw"}}, '
        f'{{"name": "run_command", "arguments": {df}}}]',
        # As Small 3.2's template renders them (ids required) and as Devstral's does.
        "mistral_call_id": f"[TOOL_CALLS]run_command[CALL_ID]abc123xyz[ARGS]{ls}"
        f"[TOOL_CALLS]run_command[CALL_ID]def456uvw[ARGS]{pwd}",
        "mistral_args": f"[TOOL_CALLS]run_command[ARGS]{ls}[TOOL_CALLS]run_command[ARGS]{pwd}",
        "deepseek_v3": "<｜tool▁calls▁begin｜>"  # noqa: RUF001
        + deepseek.format(ls)
        + "\n"
        + deepseek.format(pwd)
        + "<｜tool▁calls▁end｜>",  # noqa: RUF001
        "kimi_k2": "<|tool_calls_section_begin|>"
        + kimi.format(0, ls)
        + kimi.format(1, pwd)
        + "<|tool_calls_section_end|>",
    }[name]


@pytest.mark.parametrize(
    ("name", "reasoning"),
    [(n, r) for n in FORMATS for r in ("none", "open") if r == "none" or n in THINK_FORMATS],
)
def test_template_rendered_calls_are_accepted(vocab: Vocab, name: str, reasoning: str) -> None:
    fmt, tools = TOOL_FORMATS[name], RequestTools(TOOLS)
    walk = Walk(vocab, _compile(vocab, fmt, tools, mode="required", reasoning=reasoning), 0)
    prefix = "Let me list the files.</think>\n\n" if reasoning == "open" else ""
    walk.write(prefix + _rendered(name))
    assert walk.matcher.is_accepting()
    turn = _parse(vocab, fmt, tools, walk, reasoning)
    expected = [LS, PWD, DU, DF] if name == "mistral" else [LS] if name == "llama3" else [LS, PWD]
    assert [json.loads(c.arguments) for c in turn.tool_calls] == expected
    assert {c.name for c in turn.tool_calls} == {"run_command"}
    assert turn.text == ""
    assert turn.reasoning == ("Let me list the files." if prefix else "")


def _first_call(name: str) -> str:
    """The first of the two rendered calls, as a turn of its own."""
    if name in NATIVE_FORMATS:
        return _native_rendered(name, [LS])
    if name in ARRAY_FORMATS:
        return _array_rendered(name, [LS])
    text = _rendered(name)
    if name == "llama3":
        return text
    sectioned = name in ("deepseek_v3", "kimi_k2")
    marker = CALL_STARTS[name][0] if sectioned else TRIGGERS[name]
    head = text[: text.index(marker, text.index(marker) + 1)].rstrip("\n")
    return head + TOOL_FORMATS[name].markup[1] if sectioned else head


@pytest.mark.parametrize("name", FORMATS)
def test_single_call_grammar_refuses_a_second_call(plain: Vocab, name: str) -> None:
    fmt, tools = TOOL_FORMATS[name], RequestTools(TOOLS, max_calls=1)
    walk = Walk(plain, _compile(plain, fmt, tools, mode="required"), 0)
    two = _rendered(name) if name != "llama3" else _rendered(name) + "; " + _rendered(name)
    assert not walk.can_write(two)
    walk.write(_first_call(name))
    assert walk.matcher.is_accepting()
    assert [
        json.loads(c.arguments) for c in _parse(plain, fmt, tools, walk, "none").tool_calls
    ] == [LS]


def test_mistral_layouts_follow_their_templates(plain: Vocab) -> None:
    """Small 3.2's template renders `[CALL_ID]` + a 9-alphanumeric id, Devstral's none:
    each grammar writes only what its template renders (the id becomes the call's id)."""
    tools = RequestTools(TOOLS, max_calls=1)
    ls = '[ARGS]{"command": "ls -la", "timeout": 3}'
    with_id = Walk(
        plain, _compile(plain, TOOL_FORMATS["mistral_call_id"], tools, mode="required"), 0
    )
    assert not with_id.can_write("[TOOL_CALLS]run_command[ARGS]")
    assert not with_id.can_write("[TOOL_CALLS]run_command[CALL_ID]abc12[ARGS]")
    with_id.write(f"[TOOL_CALLS]run_command[CALL_ID]abc123xyz{ls}")
    assert with_id.matcher.is_accepting()
    turn = _parse(plain, TOOL_FORMATS["mistral_call_id"], tools, with_id, "none")
    assert [c.id for c in turn.tool_calls] == ["abc123xyz"]
    no_id = Walk(plain, _compile(plain, TOOL_FORMATS["mistral_args"], tools, mode="required"), 0)
    assert not no_id.can_write("[TOOL_CALLS]run_command[CALL_ID]")
    assert not no_id.can_write('[TOOL_CALLS][{"name"')
    no_id.write(f"[TOOL_CALLS]run_command{ls}")
    assert no_id.matcher.is_accepting()


def test_kimi_call_indexes_are_positions(plain: Vocab) -> None:
    """Kimi-K2's template renders `functions.NAME:` + `loop.index0`: the grammar writes
    each call's position, not any index."""
    walk = Walk(
        plain, _compile(plain, TOOL_FORMATS["kimi_k2"], RequestTools(TOOLS), mode="required"), 0
    )
    head = "<|tool_calls_section_begin|><|tool_call_begin|>functions.run_command:"
    assert not walk.can_write(head + "3")
    call = '{}<|tool_call_argument_begin|>{{"command": "ls"}}<|tool_call_end|>'
    walk.write(head + call.format(0))
    assert not walk.can_write("<|tool_call_begin|>functions.run_command:0")
    walk.write("<|tool_call_begin|>functions.run_command:" + call.format(1))
    walk.write("<|tool_calls_section_end|>")
    assert walk.matcher.is_accepting()


def test_a_forced_call_closes_thinking_as_the_template_renders_it(plain: Vocab) -> None:
    """Thinking off, prompt inside `<think>\\n`: the forced call closes it the way the
    template's history renders an empty block (Step-3.5 `\\n</think>\\n`, else
    `</think>\\n\\n`), so the echo re-renders it as generated."""
    step = (templates_dir() / "stepfun-ai-Step-3.5-Flash.jinja").read_text(encoding="utf-8")
    fmt, tools = TOOL_FORMATS["qwen3_coder"], RequestTools(TOOLS, max_calls=1)
    call = _first_call("qwen3_coder")
    for template, layout in ((step, "\n</think>\n"), ("</think>", "</think>\n\n")):
        tags = resolve_reasoning("auto", template)
        assert tags is not None
        kw: dict[str, Any] = {"mode": "required", "reasoning": "close", "tags": tags}
        walk = Walk(plain, _compile(plain, fmt, tools, **kw), 0)
        other = "</think>\n\n" if layout.startswith("\n") else "\n</think>\n"
        assert not walk.can_write(other + call)
        walk.write(layout + call)
        assert walk.matcher.is_accepting()


# ---- errors and edges ------------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMATS)
def test_bad_tool_schema_is_a_grammar_error(plain: Vocab, name: str) -> None:
    broken = {"type": "object", "properties": {"x": {"type": "nonsense"}}, "required": ["x"]}
    tools = RequestTools({"broken": broken})
    with pytest.raises(GrammarError, match="nonsense"):
        _compile(plain, TOOL_FORMATS[name], tools, mode="required")


def test_no_constraint_without_tools_in_auto_mode() -> None:
    assert tool_call_grammar(TOOL_FORMATS["hermes"], RequestTools(), mode="auto") is None
    with pytest.raises(ValueError, match="need tools"):
        tool_call_grammar(TOOL_FORMATS["hermes"], RequestTools(), mode="required")
    with pytest.raises(ValueError, match="mode"):
        tool_call_grammar(TOOL_FORMATS["hermes"], RequestTools(TOOLS), mode="any")
    with pytest.raises(ValueError, match="reasoning"):
        tool_call_grammar(TOOL_FORMATS["hermes"], RequestTools(TOOLS), mode="auto", reasoning="x")


def test_none_mode_needs_no_tools(plain: Vocab) -> None:
    source = tool_call_grammar(TOOL_FORMATS["hermes"], RequestTools(), mode="none")
    assert source is not None
    walk = Walk(plain, plain.grammars.table.compile("lark", source), 0)
    walk.write("Plain text < tool_call >")
    assert not walk.can_write("<tool_call>")


def test_special_markup_names_the_vocabulary_special_tokens(plain: Vocab, special: Vocab) -> None:
    fmt = TOOL_FORMATS["deepseek_v3"]
    assert special_markup(fmt, plain.tokenizer) == {}
    found = special_markup(fmt, special.tokenizer)
    assert set(found) == {*fmt.markup, THINK_OPEN, THINK_CLOSE}
    assert all(special.tokenizer.token_to_id(m) == i for m, i in found.items())


@pytest.mark.parametrize("name", FORMATS)
def test_unimplemented_schema_keywords_in_tools_are_not_enforced(plain: Vocab, name: str) -> None:
    """Agents send tools with keywords the grammar engine lacks; those requests must still
    run (the arguments are constrained by everything else)."""
    schema = {
        "type": "object",
        "properties": {"url": {"type": "string", "format": "no-such-format"}},
        "propertyNames": {"pattern": "^[a-z]+$"},
        "required": ["url"],
    }
    _compile(plain, TOOL_FORMATS[name], RequestTools({"fetch": schema}), mode="required")


def test_a_tool_name_with_the_del_character_compiles(plain: Vocab) -> None:
    """json.dumps leaves DEL raw; the grammar engine's lexer refuses it (found by the
    schemathesis fuzzer on seed 5: every forced call to such a tool was a 400)."""
    from compat_serve.parsers.lark import quote

    name = "a\x7fb"
    assert quote(name) == '"a\\u007fb"'
    assert quote("日本") == '"\\u65e5\\u672c"'
    matcher = plain.grammars.table.compile("lark", "start: " + quote(name))
    for token in plain.tokenizer.encode(name):
        matcher.consume(token)
    assert matcher.is_accepting()
