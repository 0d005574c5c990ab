"""LoRA adapters as configuration: which adapters each model serves, and by what names.

An adapter comes from `--lora NAME=PATH` (onto the `--model`, or the default model of a
registry) or from an `adapters:` list in a `--models` entry, as `{name, path, aliases?}`
mappings or `NAME=PATH` strings; `POST /models/load` adds more at run time. Nothing here
reads the weights: a path only has to look like an adapter (its `adapter_config.json`),
the engine reads and checks the files when the base model loads (adapters/files.py).

A request names an adapter by `BASE:ADAPTER`, by the adapter's own name, or by one of its
aliases (registry/routing.py). Names are unique across every model and every adapter, so
the adapter's own name alone always says which base serves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

# What marks a directory as an adapter (both mlx-lm's and PEFT's layouts have it).
ADAPTER_CONFIG = "adapter_config.json"
# A name in `BASE:ADAPTER` splits at its last colon; a name holding one could not route.
NAME_SEPARATOR = ":"


@dataclass(frozen=True)
class AdapterEntry:
    """A configured adapter of one base model."""

    name: str
    path: str
    aliases: tuple[str, ...] = ()
    # Where it was declared ("models.yaml:14", "--lora", "POST /models/load").
    origin: str = ""


def is_adapter_path(path: Path) -> bool:
    return path.is_dir() and (path / ADAPTER_CONFIG).is_file()


def check_adapter_name(name: str) -> str | None:
    """Why `name` cannot name an adapter, or None."""
    if not name or name != name.strip():
        return "must be a non-empty name without surrounding spaces"
    if NAME_SEPARATOR in name:
        return f"must not contain {NAME_SEPARATOR!r} (requests name adapters as BASE:ADAPTER)"
    return None


def adapter_entry(
    name: str,
    path: str,
    *,
    base: Path | None = None,
    origin: str = "",
    aliases: tuple[str, ...] = (),
) -> AdapterEntry:
    """An adapter entry with its path resolved (relative paths against `base`); ValueError
    naming what is wrong with the name or the path."""
    problem = check_adapter_name(name)
    if problem is not None:
        raise ValueError(f"adapter name {name!r} {problem}")
    resolved = Path(path).expanduser()
    if not resolved.is_absolute() and base is not None:
        resolved = base / resolved
    if not is_adapter_path(resolved):
        raise ValueError(
            f"adapter {name!r}: {resolved} is not an adapter (a directory with an "
            f"{ADAPTER_CONFIG}, as mlx_lm.lora and PEFT write)"
        )
    return AdapterEntry(name, str(resolved.resolve()), aliases, origin)


def parse_lora_flag(text: str, *, origin: str = "--lora") -> AdapterEntry:
    """`NAME=PATH` (the `--lora` flag, or a string item of `adapters:`)."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"{origin} {text!r}: expected NAME=PATH")
    return adapter_entry(name.strip(), path.strip(), origin=origin)


@dataclass
class AdapterTable:
    """Every base model's adapters: the configured ones and those loaded at run time.

    The one mutable part of routing: `POST /models/load` adds, `/models/unload` removes.
    """

    by_base: dict[str, dict[str, AdapterEntry]] = field(default_factory=dict)

    def of(self, base_id: str) -> list[AdapterEntry]:
        return list(self.by_base.get(base_id, {}).values())

    def base_of(self, name: str) -> str | None:
        """The base serving the adapter named `name` (its own name), or None."""
        for base_id, adapters in self.by_base.items():
            if name in adapters:
                return base_id
        return None

    def get(self, base_id: str, name: str) -> AdapterEntry | None:
        return self.by_base.get(base_id, {}).get(name)

    def by_alias(self, name: str, *, patterns: bool) -> tuple[str, AdapterEntry] | None:
        """The adapter with `name` as an exact alias (or, with `patterns`, as a glob)."""
        for base_id, adapters in self.by_base.items():
            for adapter in adapters.values():
                for alias in adapter.aliases:
                    hit = fnmatchcase(name, alias) if patterns else name == alias
                    if hit:
                        return base_id, adapter
        return None

    def add(self, base_id: str, adapter: AdapterEntry) -> None:
        self.by_base.setdefault(base_id, {})[adapter.name] = adapter

    def remove(self, base_id: str, name: str) -> AdapterEntry | None:
        return self.by_base.get(base_id, {}).pop(name, None)

    def names(self) -> set[str]:
        return {name for adapters in self.by_base.values() for name in adapters}
