"""The launched server's entry point: `compat-serve` serving until the launcher is gone.

The launcher holds the write end of this process's stdin. When the launcher exits in any
way (even killed with SIGKILL, when its own cleanup cannot run) the pipe reaches EOF and
the server stops itself with SIGTERM (the usual drain: in-flight requests finish, new ones
get 503), so a server never outlives its launcher.

    python -m compat_serve.launch.child [compat-serve serve options]
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def _stop_when_stdin_closes() -> None:
    # os.read on the raw descriptor: a read through sys.stdin would hold its buffer's
    # lock and stall the interpreter's exit.
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    threading.Thread(target=_stop_when_stdin_closes, name="launcher-watch", daemon=True).start()
    from compat_serve.serve_command import serve
    from compat_serve.serve_flags import build_serve_parser

    return serve(build_serve_parser().parse_args(sys.argv[1:]))


if __name__ == "__main__":
    raise SystemExit(main())
