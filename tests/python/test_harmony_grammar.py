"""gpt-oss harmony's whole-turn grammar in `auto` and `none`: random-logit walks on the
embedded vocabulary (markup as plain text, and as special tokens as gpt-oss has it),
read back by the harmony parser."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from compat_serve.models.tokenizer import Tokenizer
from compat_serve.parsers.formats import harmony
from compat_serve.parsers.registry import TOOL_FORMATS
from compat_serve.parsers.request_tools import RequestTools
from tests.python.test_tool_grammars import TOOLS as GRAMMAR_TOOLS
from tests.python.test_tool_grammars import Vocab as GrammarVocab
from tests.python.test_tool_grammars import Walk, _compile, _parse, _vocab


@pytest.fixture(scope="module", params=["plain", "special"])
def vocab(request: pytest.FixtureRequest, gguf_tokenizer: Tokenizer) -> GrammarVocab:
    if request.param == "plain":
        return _vocab(gguf_tokenizer)
    backend = Backend.from_str(gguf_tokenizer.backend.to_str())
    backend.add_special_tokens(
        [AddedToken(m, special=True, normalized=False) for m in harmony.MARKUP]
    )
    tokenizer = Tokenizer(
        backend,
        eos_token=gguf_tokenizer.eos_token,
        extra_eos_token_ids=gguf_tokenizer.eos_token_ids,
    )
    return _vocab(tokenizer)


def _harmony_walk(vocab: GrammarVocab, mode: str, max_calls: int | None, seed: int) -> Walk:
    fmt = TOOL_FORMATS["harmony"]
    tools = RequestTools(GRAMMAR_TOOLS, max_calls)
    return Walk(vocab, _compile(vocab, fmt, tools, mode=mode), seed)


@pytest.mark.parametrize("max_calls", [1, None])
@pytest.mark.parametrize("seed", [0, 1])
def test_harmony_auto_constrains_a_started_call(
    vocab: GrammarVocab, max_calls: int | None, seed: int
) -> None:
    """Reasoning, then a call in either recipient position; the call follows its schema
    and parses back, the analysis is reasoning."""
    walk = _harmony_walk(vocab, "auto", max_calls, seed)
    walk.write("<|channel|>analysis<|message|>")
    walk.random(3)
    walk.write("<|end|><|start|>assistant")
    walk.write(" to=functions." if seed else "<|channel|>commentary to=functions.")
    walk.finish()
    tools = RequestTools(GRAMMAR_TOOLS, max_calls)
    turn = _parse(vocab, TOOL_FORMATS["harmony"], tools, walk, "none")
    assert len(turn.tool_calls) >= 1 and turn.reasoning, walk.text()
    if max_calls == 1:
        assert len(turn.tool_calls) == 1
    assert turn.text == "", walk.text()


def test_harmony_auto_final_answer_and_none(vocab: GrammarVocab) -> None:
    for mode in ("auto", "none"):
        walk = _harmony_walk(vocab, mode, None, 0)
        walk.write("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant")
        if mode == "none":
            assert not walk.can_write(" to=functions.run_command")
            assert not walk.can_write("<|channel|>commentary to=functions.")
        assert not walk.can_write("<|channel|>final to=functions.")
        walk.write("<|channel|>final<|message|>")
        walk.random(3)
        walk.write("<|return|>")
        assert walk.matcher.is_stopped() or walk.matcher.is_accepting()
        turn = _parse(vocab, TOOL_FORMATS["harmony"], RequestTools(GRAMMAR_TOOLS), walk, "none")
        assert turn.reasoning == "Think." and turn.text and not turn.tool_calls, walk.text()


def test_harmony_model_written_call_forms_are_accepted(vocab: GrammarVocab) -> None:
    """The harmony docs' form (recipient in the channel header, <|constrain|>) and the
    template's form both pass the auto grammar."""
    for form in (
        "<|channel|>commentary to=functions.run_command <|constrain|>json<|message|>"
        '{"command": "ls"}<|call|>',
        ' to=functions.run_command<|channel|>commentary json<|message|>{"command": "ls"}<|call|>',
    ):
        walk = _harmony_walk(vocab, "auto", 1, 0)
        walk.write(form)
        assert walk.matcher.is_accepting() or walk.matcher.is_stopped()
        assert not _harmony_walk(vocab, "auto", 1, 0).can_write(
            form.replace('"ls"', "5")  # arguments off the schema
        )
