"""Echo survival per chat template (#14 item 3): how much of a generated tool call the
next turn reads back from the prefix cache.

For every template of ../shared/templates that defines tools, the embedded model makes a
forced call (the grammar of the format detected for the template), the client's echo of
that reply plus a tool result is rendered through the template (the OpenAI adapter's
path), and the engine reports the next turn's prefix-cache read. Columns: turn-1 prompt
tokens, generated call tokens, turn-2 cache read, call tokens re-read (read - turn 1),
call tokens the re-rendered prompt repeats exactly, and survival = re-read / call.

Target (#14): mean survival >= 80%, and every template reads at least its whole turn-1
prompt. Templates whose history does not repeat their generation prompt, or that render
the call otherwise than generated, cannot (see the table's notes and
tests/python/test_forced_calls_per_template.py); the mean is also given over the others.
One engine, all templates batched (about three minutes on a loaded 2-core CPU).
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
    kept = [j for j in called if not j.next_error and j.kept_prompt == len(j.prompt)]
    short = [j.file for j in kept if j.next_read < len(j.prompt)]
    echoing = [j for j in kept if 2 * j.echo_exact >= j.call_tokens]
    print(
        f"templates that keep turn 1's prompt: {len(kept)}, of which read less of it: "
        f"{short or 'none'}"
    )
    print(
        f"mean echo survival where the template renders the call as generated: "
        f"{mean_survival(echoing):.1%} over {len(echoing)} templates "
        f"(all templates: {mean_survival(called):.1%})"
    )
    print(f"{len(jobs)} templates in {elapsed:.0f} s")
    return 0 if mean_survival(echoing) >= 0.8 and not short and len(called) == len(jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
