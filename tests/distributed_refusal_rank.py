"""One rank of the start-up refusal check (tests/python/test_distributed.py): runs the
`compat-serve` command's own `main` for each case in turn, in one process.

MLX joins a group once per process (`mx.distributed.init` hands the joined group back on
every later call), so each case's start-up check, one all-gather on every rank, runs on
the one group these processes joined; a process per case and rank paid the command's
imports twenty times.

    python -P tests/distributed_refusal_rank.py CASES.json OUT.json

CASES.json: a list of cases, each a list of argument lists, one per rank (MLX_RANK picks
this rank's). OUT.json: per case, this rank's return code of `main` and what it logged
and printed.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
from pathlib import Path

from compat_serve.cli import main as cli_main


def main() -> None:
    cases_path, out_path = sys.argv[1:]
    rank = int(os.environ["MLX_RANK"])
    results = []
    for args_per_rank in json.loads(Path(cases_path).read_text()):
        output = io.StringIO()
        # The command's `logging.basicConfig` attaches a handler to the root logger only
        # when it has none: take the last case's off, so this case logs to `output`.
        logging.getLogger().handlers.clear()
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            code = cli_main(args_per_rank[rank])
        results.append([code, output.getvalue()])
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
