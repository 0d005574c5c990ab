"""Stop strings: never partially emitted, matched across chunk boundaries."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from compat_serve.engine.stop_strings import StopStringMatcher


def run(chunks: list[str], stops: list[str]) -> tuple[str, str | None]:
    matcher = StopStringMatcher(stops)
    out = []
    for chunk in chunks:
        result = matcher.feed(chunk)
        out.append(result.emit)
        if result.matched is not None:
            return "".join(out), result.matched
    out.append(matcher.flush())
    return "".join(out), None


def reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s and s in text]
    if not hits:
        return text, None
    _end, at, stop = min(hits)
    return text[:at], stop


def test_stop_spanning_chunks_is_caught_and_not_emitted() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("The answer is 4</").emit == "The answer is 4"
    result = matcher.feed("answer> trailing")
    assert result.matched == "</answer>"
    assert result.emit == ""


def test_false_start_is_released() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("ST").emit == ""
    assert matcher.feed("ART").emit == "START"


def test_no_stops_passes_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("abc").emit == "abc"
    assert not matcher.active


def test_first_completed_stop_wins() -> None:
    assert run(["xx b yy a"], ["a", "b"]) == ("xx ", "b")
    # "c" completes before "abcd" does, in one chunk or many.
    assert run(["abcd"], ["abcd", "c"]) == ("ab", "c")
    assert run(["a", "b", "c", "d"], ["abcd", "c"]) == ("ab", "c")


@given(
    text=st.text(alphabet="ab<>/ \n", max_size=40),
    stops=st.lists(st.text(alphabet="ab<>/", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
)
def test_any_chunking_equals_whole_text(text: str, stops: list[str], cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in itertools.pairwise(points)]
    assert run(chunks, stops) == reference(text, stops)
