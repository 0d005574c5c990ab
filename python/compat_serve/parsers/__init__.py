"""Output parsing: reasoning blocks and tool calls out of generated text, as it streams.

`OutputParsing` (per model, built at startup) makes one `OutputParser` per request;
its events (events.py) are what both APIs encode.
"""

from compat_serve.parsers.events import (
    OutputEvent,
    ParsedTurn,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    assemble,
)
from compat_serve.parsers.output import OutputParser
from compat_serve.parsers.request_tools import RequestTools
from compat_serve.parsers.setup import OutputParsing

__all__ = [
    "OutputEvent",
    "OutputParser",
    "OutputParsing",
    "ParsedTurn",
    "ReasoningDelta",
    "RequestTools",
    "TextDelta",
    "ToolCall",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "assemble",
]
