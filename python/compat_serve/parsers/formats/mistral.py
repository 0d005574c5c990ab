"""Mistral calls after the `[TOOL_CALLS]` control token, in either generation:

[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]        (v3 tokenizers, Nemo)
[TOOL_CALLS]f[ARGS]{...}    or  f[CALL_ID]abc123xyz[ARGS]{...}  (v11+, Small 3.2, Devstral)
"""

from __future__ import annotations

from collections.abc import Generator

from compat_serve.parsers.region import Outcome, Region

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"


class MistralRegion(Region):
    def body(self) -> Generator[None, None, Outcome]:
        yield from self.skip_ws()
        if (yield from self.accept("[")):
            return (yield from self._array())
        name = yield from self.read_name((ARGS, CALL_ID))
        if name is None:
            return Outcome.REJECT
        if (yield from self.accept(CALL_ID)):
            yield from self.read_until((ARGS,))
        yield from self.accept(ARGS)
        self.sink.open_call(name)
        yield from self.stream_json_value()
        self.sink.close_call()
        return Outcome.DONE

    def _array(self) -> Generator[None, None, Outcome]:
        first = True
        while True:
            yield from self.skip_ws()
            start = self.pos
            outcome = yield from self.json_call()
            if outcome is Outcome.REJECT:
                if first:
                    return Outcome.REJECT
                self.pos = start  # an unknown tool among known ones: keep it as text
                raw = yield from self.read_json_value()
                self.sink.text(raw if raw is not None else self.rest)
            first = False
            yield from self.skip_ws()
            if not (yield from self.accept(",")):
                yield from self.accept("]")
                return Outcome.DONE
