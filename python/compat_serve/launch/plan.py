"""What every client module builds: the served model it points at, and the launch plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Served:
    """The server a client is pointed at: its URL (no trailing /v1) and its model."""

    base_url: str
    model: str
    context_length: int
    api_key: str | None = None
    max_output_tokens: int | None = None


@dataclass
class LaunchPlan:
    """How to run one client: extra arguments, environment changes and generated files."""

    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Variables removed from the inherited environment (they would override ours).
    unset: list[str] = field(default_factory=list)
    # Files written into the launcher's temp directory before the client starts.
    files: dict[Path, str] = field(default_factory=dict)
    # Subcommands whose own options replace the top-level ones: `args` go after them.
    subcommands: frozenset[str] = frozenset()

    def command(self, binary: str, client_args: list[str]) -> list[str]:
        if client_args and client_args[0] in self.subcommands:
            return [binary, client_args[0], *self.args, *client_args[1:]]
        return [binary, *self.args, *client_args]

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in base.items() if k not in self.unset}
        env.update(self.env)
        return env

    def write_files(self) -> None:
        for path, text in self.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")


@dataclass(frozen=True)
class ClientInfo:
    """A client program: the name launch takes, the command on PATH, how to install it."""

    name: str
    command: str
    install: str
