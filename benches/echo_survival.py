"""Echo survival per chat template (#14 item 3): how much of a generated tool call the
next turn reads back from the prefix cache.

For every template of ../shared/templates that defines tools, the embedded model makes a
forced call (the grammar of the format detected for the template), the client's echo of
that reply plus a tool result is rendered through the template (the OpenAI adapter's
path), and the engine reports the next turn's prefix-cache read. Columns: turn-1 prompt
tokens, generated call tokens, turn-2 cache read, call tokens re-read (read - turn 1),
call tokens the re-rendered prompt repeats exactly, and survival = re-read / call.

Target (#14): mean survival >= 80%, and every template reads at least its whole turn-1
prompt. One engine, all templates batched (about two minutes on a 2-core CPU).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.python.echo_turns import (
    first_turn,
    mean_survival,
    run_first_turns,
    run_next_turns,
    table,
    tool_templates,
)

from compat_serve.engine.engine import Engine, EngineConfig
from compat_serve.models.loader import load_model


def main() -> int:
    model = load_model(None)
    engine = Engine(model, EngineConfig(prefill_chunk=512))
    engine.start()
    try:
        started = time.monotonic()
        jobs = [first_turn(model, file) for file in tool_templates()]
        run_first_turns(engine, jobs)
        called = [j for j in jobs if j.turn is not None and len(j.turn.tool_calls) == 1]
        run_next_turns(engine, called)
        elapsed = time.monotonic() - started
    finally:
        engine.shutdown()
    print(table(called))
    for job in jobs:
        if job not in called:
            print(f"no single call on {job.file} ({job.format}): {job.text!r}")
    short = [j.file for j in called if j.next_read < len(j.prompt)]
    print(f"templates whose next turn reads less than turn 1's prompt: {short or 'none'}")
    print(f"{len(jobs)} templates in {elapsed:.0f} s")
    return 0 if mean_survival(called) >= 0.8 and not short and len(called) == len(jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
