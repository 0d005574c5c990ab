"""The envelope instructions give the model nothing to copy as its answer (#25 item 5).

Two OpenCode-shaped requests (tests/http/opencode_shapes.py: OpenCode's tools as the AI
SDK sends them, `$schema` keys included, and a system prompt that differs only in its
working directory and date) ask the embedded SmolLM2-135M a plain question. To keep the
prompts near 700 tokens they carry OpenCode's first four tools; with the example
`{"response": "your answer"}` the instructions used to show, these two prompts answered
"Your answer is: France". Sampled (no temperature, as OpenCode sends), the model
sometimes calls a tool instead of answering (`read`, about one request in ten): that is
no copy, so each request must not copy, and at least one must answer. The whole
ten-prompt measurement, with all ten tools, is benches/example_copy.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx

from tests.http.opencode_shapes import answers_without_copying, ask, copies_example, opencode_body

if TYPE_CHECKING:
    from tests.conftest import RunningServer

# Prompts that copied the old example with four tools.
COPIED_BEFORE = (4, 5)


def test_opencode_prompts_answer_without_copying_the_example(server: RunningServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=600) as client:
        answers = [ask(client, opencode_body(i, 1024, tools=4)) for i in COPIED_BEFORE]
    for answer in answers:
        assert answer.finish_reason in ("stop", "tool_calls"), answer
        assert not copies_example(answer.text), answer
    assert any(answers_without_copying(answer.text) for answer in answers), answers
