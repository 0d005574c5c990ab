"""Echo survival per chat template (#14 item 3): how much of a generated tool call the
next turn reads back from the prefix cache.

For every template of ../shared/templates that defines tools, the embedded model makes a
forced call (the grammar of the format detected for the template), the client's echo of
that reply plus a tool result is rendered through the template (the OpenAI adapter's
path), and the engine reports the next turn's prefix-cache read. Columns: turn-1 prompt
tokens, generated call tokens, turn-2 cache read, call tokens re-read (read - turn 1),
call tokens the re-rendered prompt repeats exactly, and survival = re-read / call.

Two measures of turn 2: the template's own rendering (what it repeats exactly of turn 1
and the call: all a token-exact cache can read) and the server's default, the echoed
reply spliced in as generated (chat/reply_history.py; measured on the engine).
Target (#14): mean survival >= 80%, and every template reads at least its whole turn-1
prompt. One engine per way of forcing the call, all templates batched (about three
minutes each on a loaded 2-core CPU). Turn 1 forces the call by name (`named`, OpenAI
`{"type": "function", ...}`) or with `any` (`"required"`); turn 2 no longer forces it.

    .venv/bin/python benches/echo_survival.py [named] [any]   (default: both)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from compat_serve.models.blas import ensure_fast_blas

# Before anything imports mlx.core: without it MLX's CPU matmuls are ~15x slower (this
# bench used to look stalled in turn 1's prefill).
ensure_fast_blas()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.python.echo_turns import (  # noqa: E402
    CHOICES,
    MODES,
    build_next_turns,
    first_turn,
    mean_survival,
    run_first_turns,
    run_next_turns,
    table,
    tool_templates,
)

from compat_serve.engine.config import EngineConfig  # noqa: E402
from compat_serve.engine.engine import Engine  # noqa: E402
from compat_serve.models.loader import load_model  # noqa: E402
from compat_serve.models.types import LoadedModel  # noqa: E402


def main() -> int:
    choices = [a for a in sys.argv[1:] if a in CHOICES] or list(CHOICES)
    model = load_model(None)
    ok = True
    for choice in choices:
        print(f"== turn 1 forces the call: {choice} ({CHOICES[choice]})", flush=True)
        ok = run(model, choice) and ok
    return 0 if ok else 1


def run(model: LoadedModel, choice: str) -> bool:
    engine = Engine(model, EngineConfig(prefill_chunk=512))
    engine.start()
    try:
        started = time.monotonic()
        jobs = [first_turn(model, file, choice=choice) for file in tool_templates()]
        print(f"turn 1 of {len(jobs)} templates (batched) ...", flush=True)
        run_first_turns(engine, jobs)
        print(f"turn 1 done in {time.monotonic() - started:.0f} s; turn 2 ...", flush=True)
        called = [j for j in jobs if j.turn is not None and len(j.turn.tool_calls) == 1]
        template_mode, spliced_mode = MODES
        build_next_turns(called, template_mode)
        run_next_turns(engine, called, spliced_mode)
        elapsed = time.monotonic() - started
    finally:
        engine.shutdown()
    print(table(called))
    for job in jobs:
        if job not in called:
            print(f"no single call on {job.file} ({job.format}): {job.text!r}")
    refused = [j.file for j in called if j.next[spliced_mode].error]
    lost_prompt = [
        j.file
        for j in called
        if not j.next[spliced_mode].error and j.next[spliced_mode].read < len(j.prompt)
    ]
    short = [
        j.file
        for j in called
        if not j.next[spliced_mode].error
        # A forced call ends when its grammar completes: its last token is never fed.
        and j.next[spliced_mode].read < len(j.prompt) + j.call_tokens - 1
    ]
    print(f"refused by the template: {refused or 'none'}")
    print(f"spliced turn 2 reading less than turn 1's prompt: {lost_prompt or 'none'}")
    print(f"spliced turn 2 reading less than turn 1 + the call but its last: {short or 'none'}")
    print(f"{len(jobs)} templates in {elapsed:.0f} s", flush=True)
    return mean_survival(called, spliced_mode) >= 0.8 and len(called) == len(jobs)


if __name__ == "__main__":
    sys.exit(main())
