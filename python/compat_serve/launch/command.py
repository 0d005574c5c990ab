"""`compat-serve launch CLIENT [launch options] [serve options] [-- client arguments]`."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from types import FrameType

from compat_serve.codex_config import CodexConfigError, query_server
from compat_serve.launch import claude, codex, opencode
from compat_serve.launch.client_process import run_client
from compat_serve.launch.plan import ClientInfo, LaunchPlan, Served
from compat_serve.launch.server import ServerFailed, ServerProcess, connect_host, free_port

CLIENTS: dict[str, ClientInfo] = {m.INFO.name: m.INFO for m in (claude, codex, opencode)}
NOT_FOUND = 127
PROG = "compat-serve launch"


class Terminated(Exception):
    """SIGTERM or SIGHUP before the client started."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} {{{','.join(CLIENTS)}}} [launch options] [serve options] "
        "[-- client arguments]",
        description="Start a compat-serve server (any `compat-serve` serve option; a free "
        "loopback port unless --port), run the agent client in this terminal pointed at it, "
        "stop the server when the client exits and exit with the client's code. Nothing is "
        "written to the client's own config: generated files live in a temp directory "
        "removed on exit. Arguments after `--` go to the client. Serve options: see "
        "`compat-serve --help`.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--url",
        help="use the server already running at URL instead of starting one (serve options "
        "other than --api-key are then refused)",
    )
    p.add_argument(
        "--api",
        choices=tuple(opencode.PACKAGES),
        default="openai",
        help="opencode only: the API OpenCode speaks, openai (chat completions through "
        "@ai-sdk/openai-compatible, default) or anthropic (Messages through @ai-sdk/anthropic)",
    )
    p.add_argument(
        "--print",
        dest="print_only",
        action="store_true",
        help="show the environment, arguments and config the client would get, and exit "
        "(the server is started to read its model and window, then stopped)",
    )
    p.add_argument(
        "--server-log",
        metavar="FILE",
        help="append the server's log to FILE (default: a file in the temp directory)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds the server may take to load its model and answer (default 600)",
    )
    return p


def _option_given(args: list[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def client_plan(client: str, served: Served, tmp: Path, api: str) -> LaunchPlan:
    if client == "claude":
        return claude.plan(served)
    if client == "codex":
        return codex.plan(served, tmp)
    return opencode.plan(served, tmp, api)


def render_plan(command: list[str], plan: LaunchPlan, served: Served) -> str:
    lines = [
        f"# server {served.base_url}: model {served.model!r}, context window "
        f"{served.context_length} tokens",
        *(f"unset {name}" for name in plan.unset),
        *(f"export {name}={shlex.quote(value)}" for name, value in plan.env.items()),
        shlex.join(command),
    ]
    for path, text in plan.files.items():
        lines += [f"# {path} (generated at launch, removed on exit):", text.rstrip("\n")]
    return "\n".join(lines) + "\n"


def _split_client_args(args: list[str]) -> tuple[list[str], list[str]]:
    if "--" in args:
        cut = args.index("--")
        return args[:cut], args[cut + 1 :]
    return args, []


def main(argv: list[str]) -> int:
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    client, (own, client_args) = argv[0], _split_client_args(argv[1:])
    if client not in CLIENTS:
        parser.error(f"unknown client {client!r}; choose one of {', '.join(CLIENTS)}")
    ns, serve_args = parser.parse_known_args(own)
    if client != "opencode" and _option_given(own, "--api"):
        parser.error("--api applies to opencode only")

    from compat_serve.serve_flags import build_serve_parser

    serve_ns = build_serve_parser().parse_args(serve_args)
    if ns.url and [a for a in serve_args if a.startswith("-") and not a.startswith("--api-key")]:
        parser.error("--url uses a running server: serve options other than --api-key do nothing")

    info = CLIENTS[client]
    binary = shutil.which(info.command)
    if binary is None and not ns.print_only:
        print(
            f"{PROG}: {info.command!r} is not on PATH; install it with:\n  {info.install}",
            file=sys.stderr,
        )
        return NOT_FOUND
    return _launch(ns, serve_ns, serve_args, client, binary or info.command, client_args)


def _raise_terminated(_signum: int, _frame: FrameType | None) -> None:
    raise Terminated


def _launch(
    ns: argparse.Namespace,
    serve_ns: argparse.Namespace,
    serve_args: list[str],
    client: str,
    binary: str,
    client_args: list[str],
) -> int:
    previous = {s: signal.signal(s, _raise_terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
    tmp = Path(tempfile.mkdtemp(prefix="compat-serve-launch-"))
    server: ServerProcess | None = None
    try:
        if ns.url:
            base_url = ns.url.rstrip("/").removesuffix("/v1")
        else:
            if not _option_given(serve_args, "--port"):
                serve_args = [*serve_args, "--port", str(free_port())]
                serve_ns.port = int(serve_args[-1])
            base_url = f"http://{connect_host(serve_ns.host)}:{serve_ns.port}"
            log_path = Path(ns.server_log) if ns.server_log else tmp / "server.log"
            print(f"{PROG}: starting the server at {base_url} (log: {log_path})", file=sys.stderr)
            server = ServerProcess.start(serve_args, base_url, log_path)
            server.wait_ready(serve_ns.api_key, ns.startup_timeout)
        found = query_server(base_url, serve_ns.api_key)
        served = Served(
            base_url=base_url,
            model=found.model,
            context_length=found.context_length,
            api_key=serve_ns.api_key,
            max_output_tokens=serve_ns.max_output_tokens,
        )
        plan = client_plan(client, served, tmp, ns.api)
        command = plan.command(binary, client_args)
        if ns.print_only:
            sys.stdout.write(render_plan(command, plan, served))
            return 0
        plan.write_files()
        for s, handler in previous.items():
            signal.signal(s, handler)
        return run_client(command, plan.environment(dict(os.environ)))
    except ServerFailed as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.returncode or 1
    except CodexConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return 143
    finally:
        if server is not None:
            server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(tmp, ignore_errors=True)
