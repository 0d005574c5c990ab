"""Servers running the scripted model (tests/scripted_model.py) with a chosen template."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from tests.conftest import start_server
from tests.scripted_model import scripted_model
from tests.shared_data import templates_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer


def template(name: str) -> str:
    return (templates_dir() / name).read_text(encoding="utf-8")


@contextmanager
def scripted_server(
    embedded: LoadedModel,
    template_file: str,
    replies: Sequence[tuple[str, str | Sequence[int]]],
    *,
    step_delay_s: float = 0.0,
    **options: Any,
) -> Iterator[RunningServer]:
    loaded = scripted_model(embedded, template(template_file), replies, step_delay_s=step_delay_s)
    running = start_server(loaded, **options)
    try:
        yield running
    finally:
        running.stop()


WEATHER_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "opts": {"type": "object"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
    },
]


def anthropic_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in tools
    ]
