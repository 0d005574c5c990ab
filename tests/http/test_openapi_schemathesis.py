"""Fuzz the server against its own `/openapi.json` with schemathesis, every check on.

A real server, generation capped at 4 tokens, a fixed seed and a bounded example count.
It runs the tiny llama (the embedded model's tokenizer, template and context length;
nothing here depends on what the model says), so the long random prompts the fuzzer
sends cost little prefill. Positive and negative data, the coverage phase (boundaries,
missing fields, wrong types, undeclared methods) and every built-in check: server
errors, status codes, content types, response schemas and headers, negative data
rejected, positive data accepted, `Allow` on 405...

A schema-valid request can still break a rule JSON Schema cannot state (a named tool
must be among `tools`, a regex must compile, a final assistant message cannot end in
whitespace, at most one output constraint): the document states those rules in the
field descriptions. Such a request must get a 400 in the API's own shape whose message
names the field (`_SEMANTIC_FIELDS`); every other check still runs on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.conftest import RunningServer, start_server

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

pytestmark = pytest.mark.model

load_all_checks()
ALL_CHECKS = list(CHECKS.get_all())

# Fields whose rules the document states in words (cross-field or a language):
# per path, the message prefixes of the 400s such a request may get.
_SEMANTIC_FIELDS: dict[str, tuple[str, ...]] = {
    "/v1/chat/completions": (
        "tool_choice",
        "response_format",
        "structured_outputs",
        "guided_",
        "messages[",
        "messages: cannot render",
        "This model's maximum context length",
    ),
    "/v1/completions": ("This model's maximum context length",),
    "/v1/messages": (
        "messages",
        "tool_choice",
        "tools[",
        "max_tokens must be greater than thinking.budget_tokens",
        "Thinking may not be enabled when tool_choice forces tool use",
        "output_config.format",
        "output_format",
        "prompt is too long",
    ),
    "/v1/responses": (
        "input",
        "tools[",
        "tool_choice",
        "text.format",
        "reasoning.",
        "messages",
        "This model's maximum context length",
        # An id the store does not hold is a 404 (OpenAI's answer), not a 400.
        "Previous response with id",
    ),
}
_SEMANTIC_FIELDS["/v1/messages/count_tokens"] = _SEMANTIC_FIELDS["/v1/messages"]


@pytest.fixture(scope="module")
def fuzzed_server(
    embedded_model: LoadedModel, tiny_llama_model: LoadedModel
) -> Iterator[RunningServer]:
    running = start_server(
        tiny_llama_model, max_output_tokens=4, context_length=embedded_model.context_length
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def api_schema(fuzzed_server: RunningServer) -> Any:
    return schemathesis.openapi.from_url(f"{fuzzed_server.base_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(autouse=True)
def _node_id_for_schemathesis(request: pytest.FixtureRequest) -> None:
    # schemathesis 4.32's lazy loader reads `node._nodeid`, which pytest 9.2 renamed.
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


def _error_message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else ""


def _refused_for_a_stated_rule(case: Any, response: Any) -> bool:
    """A positive case refused with a 400 that names a field whose rule is in words."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return False
    if response.status_code not in (400, 404) or (
        response.status_code == 404 and case.operation.path != "/v1/responses"
    ):
        return False
    # `/v1/chat/completions/render` takes the same body as the route it renders for.
    prefixes = _SEMANTIC_FIELDS.get(case.operation.path.removesuffix("/render"), ())
    return _error_message(response.json()).startswith(prefixes)


@schema.parametrize()
@settings(
    max_examples=15,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_openapi_document_tells_the_truth(case: Any) -> None:
    # Generous: a long random prompt on a busy 2-core machine can take more than 10 s.
    response = case.call(timeout=60)
    excluded = [positive_data_acceptance] if _refused_for_a_stated_rule(case, response) else []
    case.validate_response(response, checks=ALL_CHECKS, excluded_checks=excluded)
