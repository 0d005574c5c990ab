"""The grammar of a whole generated turn under a tool choice, in the model's own format.

Each format writes its calls as a `CallSyntax` (next to its parser in `formats/`); this
module puts them in a turn: only calls (`required`), free text in which a started call is
constrained (`auto`, llguidance's lazy-trigger pattern), or text that never starts a call
(`none`), optionally after reasoning.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from compat_serve.engine.types import Grammar
from compat_serve.parsers.formats.envelope import envelope_rules
from compat_serve.parsers.lark import STRICT_JSON_LAYOUT, CallSyntax, GrammarBuilder
from compat_serve.parsers.reasoning import THINK, ReasoningTags
from compat_serve.parsers.request_tools import RequestTools, Vocabulary
from compat_serve.parsers.tool_calls import ToolFormat

MODES = ("required", "auto", "none")
REASONING = ("none", "open", "optional", "close")


def special_markup(
    fmt: ToolFormat, vocabulary: Vocabulary, tags: ReasoningTags = THINK
) -> dict[str, int]:
    """The format's markup (and the reasoning tags) that `vocabulary` has as single
    special tokens: the grammar must name those by id (`special_tokens` below)."""
    markup = (*fmt.markup, *fmt.regions, tags.open, tags.close, *tags.markup)
    found = {m: vocabulary.token_to_id(m) for m in markup}
    return {m: i for m, i in found.items() if i is not None and i in vocabulary.special_token_ids}


def tool_call_grammar(
    fmt: ToolFormat,
    tools: RequestTools,
    *,
    mode: str,
    reasoning: str = "none",
    special_tokens: Mapping[str, int] | None = None,
    tags: ReasoningTags = THINK,
) -> str | None:
    """llguidance Lark grammar for the whole generated output.

    mode "required": only tool calls (1..max_calls; exactly one when max_calls == 1), each
    naming one of `tools.schemas` with arguments valid against its schema (a missing or
    empty schema: any object). "auto": free text; once the model writes the format's
    start marker the call is constrained the same way; text may follow calls. "none":
    free text in which no call start marker can appear.
    reasoning "none": no thinking; "open": the prompt opened `<think>`, so the output
    starts inside reasoning, up to and including `</think>`; "optional": the output may
    start with `<think>...</think>`; "close": the prompt opened `<think>` but thinking is
    off (a forced call), so the output closes it at once. The constrained part follows.
    `special_tokens`: markup → token id for markup that is one special token in the
    model's vocabulary (see `special_markup`). `tags`: how the model writes reasoning.
    Returns None when no constraint is needed (auto with no tools and no format grammar);
    raises ValueError for a mode that cannot be met (required without tools).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    if reasoning not in REASONING:
        raise ValueError(f"reasoning must be one of {', '.join(REASONING)}, not {reasoning!r}")
    g = GrammarBuilder(special_tokens)
    # Free text never holds the format's markup (the parser would take a start marker
    # for a call, and show other markup as text) nor reasoning tags.
    markup = (*fmt.regions, *fmt.markup, tags.open, tags.close)
    if fmt.turn_grammar is not None and mode != "required":
        # The format's free text holds its own markup (harmony channels).
        return g.source(fmt.turn_grammar(g, tools.schemas, mode, tools.max_calls == 1))
    if not fmt.free_text_grammar and mode != "required":
        return None
    if mode == "none":
        return g.source(_reasoning(g, reasoning, tags) + g.text("text", markup))
    if fmt.grammar is None or not tools.schemas:
        if mode == "required":
            raise ValueError(f"required tool calls need tools and a grammar for {fmt.name}")
        return None
    syntax = fmt.grammar(g, tools.schemas)
    single = tools.max_calls == 1
    if mode == "required":
        body = _calls(g, syntax, single=single)
    else:
        body = _text_and_calls(g, syntax, markup, single=single)
    return g.source(_reasoning(g, reasoning, tags) + body)


def envelope_turn_grammar(
    tools: RequestTools,
    *,
    mode: str,
    reasoning: str = "none",
    special_tokens: Mapping[str, int] | None = None,
    tags: ReasoningTags = THINK,
) -> str:
    """The JSON envelope (templates that ignore tools) after the reasoning the prompt
    allows: a template whose prompt opens `<think>` (DeepSeek-R1's) gets the envelope
    after `</think>`, not inside the reasoning."""
    if reasoning not in REASONING:
        raise ValueError(f"reasoning must be one of {', '.join(REASONING)}, not {reasoning!r}")
    g = GrammarBuilder(special_tokens)
    return g.source(f"{_reasoning(g, reasoning, tags)}({envelope_rules(g, tools, mode)})")


def _calls(g: GrammarBuilder, syntax: CallSyntax, *, single: bool) -> str:
    block = g.rule("calls", f"{g.lit(syntax.trigger)} {syntax.one if single else syntax.many}")
    lead = f"{g.lit(syntax.lead)} " if syntax.lead else ""
    if single or syntax.separator is None:
        return lead + block
    return f"{lead}{block} ({syntax.separator} {block})*"


def _text_and_calls(
    g: GrammarBuilder, syntax: CallSyntax, markup: Iterable[str], *, single: bool
) -> str:
    """Free text in which the trigger starts a constrained block of calls."""
    markup = tuple(markup)
    others = [m for m in markup if m != syntax.trigger]
    if g.is_special(syntax.trigger):  # free text cannot hold the token: it ends the text
        lead = f"{g.text('lead', others)} {g.lit(syntax.trigger)}"
    else:
        lead = g.text_until("lead", syntax.trigger, others)
    tail = g.text("tail", markup)
    if single:
        return g.rule("turn", f"{tail} | {lead} {syntax.one} {tail}")
    segment = g.rule("segment", f"{lead} {syntax.many}")
    return f"{segment}* {tail}"


def _reasoning(g: GrammarBuilder, reasoning: str, tags: ReasoningTags = THINK) -> str:
    """The reasoning before the constrained part (with the layout after `</think>`)."""
    if reasoning == "none":
        return ""
    if reasoning == "close":
        before, after = tags.closed_layout
        return f"{g.lit(*(p for p in (before, tags.close, after) if p))} "
    thought = g.rule("thought", f'{g.text_until("thinking", tags.close)} "\\n"{{0,2}}')
    if reasoning == "open":
        return f"{thought} "
    return f"({g.lit(*_pieces(g, tags.open, tags.markup))} {thought})? "


def _pieces(g: GrammarBuilder, text: str, markup: tuple[str, ...]) -> tuple[str, ...]:
    """`<|channel>thought` → (`<|channel>`, `thought`) when `<|channel>` is a special
    token; one literal otherwise (two text lexemes there would be ambiguous with free
    text that starts the same way)."""
    for m in markup:
        if text.startswith(m) and text != m and g.is_special(m):
            return (m, text[len(m) :])
    return (text,)


def after_reasoning(
    grammar: Grammar,
    reasoning: str,
    special_tokens: Mapping[str, int] | None = None,
    tags: ReasoningTags = THINK,
) -> Grammar:
    """A client's output format (JSON schema or regex) that starts once the reasoning the
    template allows has ended. Lark grammars are the client's own: left as they are."""
    if reasoning not in REASONING:
        raise ValueError(f"reasoning must be one of {', '.join(REASONING)}, not {reasoning!r}")
    if reasoning == "none" or grammar.kind not in ("json_schema", "regex"):
        return grammar
    g = GrammarBuilder(special_tokens)
    if grammar.kind == "json_schema":
        schema = json.loads(grammar.source)
        if isinstance(schema, dict):  # strict: the client asked for exactly this
            schema = {
                **schema,
                "x-guidance": {**STRICT_JSON_LAYOUT, **schema.get("x-guidance", {})},
            }
        answer = f"%json {json.dumps(schema)}"
    else:
        answer = "/" + grammar.source.replace("/", "\\/") + "/"
    body = g.rule("answer", answer)
    return Grammar("lark", g.source(_reasoning(g, reasoning, tags) + body), grammar.field)
