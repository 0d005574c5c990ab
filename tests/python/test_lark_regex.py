"""server/responses/lark_regex.py: a regular Lark grammar as one regex, on Codex's real
apply_patch grammar (from a captured Codex request), checked against the hand-written
reference regex of tests/http/responses_helpers.py and hand-labelled patches."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from compat_serve.server.responses.lark_regex import lark_to_regex
from tests.http.responses_helpers import is_apply_patch

CODEX_REQUEST = Path(__file__).parents[1] / "fixtures" / "codex" / "gpt-5.5-turn1-request.json"


def codex_apply_patch_grammar() -> str:
    body = json.loads(CODEX_REQUEST.read_text())["body"]
    (tool,) = [t for t in body["tools"] if t.get("name") == "apply_patch"]
    grammar: str = tool["format"]["definition"]
    return grammar


PATCHES = [
    "*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch\n",
    "*** Begin Patch\n*** Add File: a b/c.txt\n+x\n+\n+y\n*** End Patch",
    "*** Begin Patch\n*** Delete File: old.py\n*** End Patch\n",
    "*** Begin Patch\n*** Update File: a.py\n*** Move to: b.py\n@@ def f\n-a\n+b\n c\n"
    "*** End of File\n*** End Patch\n",
    "*** Begin Patch\n*** Update File: a.py\n*** End Patch\n",
    "*** Begin Patch\n*** Delete File: x\n*** Add File: y\n+1\n*** End Patch\n",
]
NOT_PATCHES = [
    "hello.txt",
    "*** Begin Patch\n*** End Patch\n",  # no hunk
    "*** Begin Patch\n*** Add File: hello.txt\n*** End Patch\n",  # no added line
    "*** Begin Patch\n*** Add File: hello.txt\nhi\n*** End Patch\n",  # line without +
    "*** Begin Patch\n*** Add File: \n+hi\n*** End Patch\n",  # empty name
    "*** Begin Patch\n*** Add File: a\n+hi\n*** End Patch\n\n",
]


@pytest.mark.parametrize("text", PATCHES + NOT_PATCHES)
def test_codex_apply_patch_regex_accepts_exactly_the_patches(text: str) -> None:
    regex = lark_to_regex(codex_apply_patch_grammar())
    assert regex is not None
    expected = text in PATCHES
    assert is_apply_patch(text) == expected  # the labels agree with the reference
    assert (re.fullmatch(regex, text) is not None) == expected


@pytest.mark.parametrize(
    "grammar",
    [
        'start: a\na: "x" a | "y"',  # recursive
        'start: "a"\n%ignore " "',  # %ignore changes the language
        'start: "a"i',  # case-insensitive literal
        "start: /a/i",  # regex flags
        "start: /(?=a)a/",  # lookahead
        'start: "a" B\n%import common.ESCAPED_STRING',  # unknown common terminal
        'start: "a" b',  # undefined rule
        'rule: "a"',  # no start
        'start: ("a"',  # unclosed group
    ],
)
def test_what_it_cannot_inline_gives_none(grammar: str) -> None:
    assert lark_to_regex(grammar) is None


def test_literals_are_escaped_and_optionals_work() -> None:
    regex = lark_to_regex('start: "a.b" ["(x)"] c*\nc: /[0-9]/ | "+"')
    assert regex is not None
    for text, ok in [("a.b", True), ("a.b(x)", True), ("a.b1+2", True), ("axb", False)]:
        assert (re.fullmatch(regex, text) is not None) == ok, text
