"""Which configured model (and which of its LoRA adapters) a request's `model` names.

In order: a model's exact id; an adapter's own name or exact alias; `BASE:ADAPTER` with a
known adapter; the first model alias pattern (fnmatch globs, case-sensitive, in
declaration order); `BASE:ADAPTER` whose BASE names a model but ADAPTER none of its
adapters (an `UnknownAdapter`: the caller answers 404, never the base without it); an
adapter alias pattern; else the default model, unless `--strict-model-names` (then None:
the caller answers 404). Ollama's `:latest` tag is ignored throughout.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from compat_serve.registry.adapters import NAME_SEPARATOR, AdapterEntry, AdapterTable
from compat_serve.registry.config_file import check_entries
from compat_serve.registry.entries import ModelEntry

# Ollama clients append a tag; `name:latest` is `name`.
_OLLAMA_DEFAULT_TAG = ":latest"


@dataclass(frozen=True)
class Route:
    """What a request's model name routes to: a base model, and maybe one of its adapters."""

    entry: ModelEntry
    adapter: AdapterEntry | None = None


class UnknownAdapter(LookupError):
    """`BASE:ADAPTER` where BASE names a model and ADAPTER none of its adapters."""

    def __init__(self, base: ModelEntry, adapter: str) -> None:
        super().__init__(f"model {base.id!r} has no adapter {adapter!r}")
        self.base, self.adapter = base, adapter


class ModelRegistry:
    """The configured models, in declaration order, and their adapters (`adapters`, the
    only state: adapters loaded at run time); routing by name."""

    def __init__(self, entries: list[ModelEntry], *, strict: bool = False) -> None:
        if not entries:
            raise ValueError("no models configured")
        check_entries(entries)
        self.entries = list(entries)
        self.strict = strict
        self._by_id = {entry.id: entry for entry in entries}
        self.default = next((e for e in entries if e.default), entries[0])
        self.adapters = AdapterTable()
        for entry in entries:
            for adapter in entry.adapters:
                self.adapters.add(entry.id, adapter)

    @property
    def ids(self) -> list[str]:
        return [entry.id for entry in self.entries]

    def get(self, model_id: str) -> ModelEntry | None:
        return self._by_id.get(model_id)

    def match(self, name: str) -> ModelEntry | None:
        """The model `name` names by id or alias (Ollama's `:latest` ignored), or None."""
        for candidate in _spellings(name):
            entry = self._by_id.get(candidate)
            if entry is not None:
                return entry
        for entry in self.entries:
            for pattern in entry.aliases:
                if any(fnmatchcase(candidate, pattern) for candidate in _spellings(name)):
                    return entry
        return None

    def route(self, name: str | None) -> ModelEntry | None:
        """The model serving a request for `name`: a match, else the default model; None
        only under `strict` for a name that matches nothing."""
        routed = self.resolve(name)
        return None if routed is None else routed.entry

    def resolve(self, name: str | None) -> Route | None:
        """The model and adapter serving a request for `name` (the module's order); None
        only under `strict` for a name that matches nothing. Raises `UnknownAdapter`."""
        routed = self.find(name) if name else None
        if routed is not None:
            return routed
        return None if self.strict else Route(self.default)

    def find(self, name: str) -> Route | None:
        """What `name` names by id, adapter name, `BASE:ADAPTER` or alias, or None."""
        spellings = _spellings(name)
        for candidate in spellings:
            entry = self._by_id.get(candidate)
            if entry is not None:
                return Route(entry)
        for candidate in spellings:
            routed = self._adapter_named(candidate)
            if routed is not None:
                return routed
        unknown: UnknownAdapter | None = None
        for candidate in spellings:
            base_name, sep, adapter_name = candidate.rpartition(NAME_SEPARATOR)
            base = self.match(base_name) if sep and base_name and adapter_name else None
            if base is None:
                continue
            adapter = self.adapters.get(base.id, adapter_name)
            if adapter is not None:
                return Route(base, adapter)
            unknown = unknown or UnknownAdapter(base, adapter_name)
        entry = self.match(name)
        if entry is not None:
            return Route(entry)
        if unknown is not None:
            raise unknown
        for candidate in spellings:
            hit = self.adapters.by_alias(candidate, patterns=True)
            if hit is not None:
                return Route(self._by_id[hit[0]], hit[1])
        return None

    def _adapter_named(self, name: str) -> Route | None:
        base_id = self.adapters.base_of(name)
        if base_id is not None:
            adapter = self.adapters.get(base_id, name)
            assert adapter is not None
            return Route(self._by_id[base_id], adapter)
        hit = self.adapters.by_alias(name, patterns=False)
        return None if hit is None else Route(self._by_id[hit[0]], hit[1])

    def taken(self, name: str) -> str | None:
        """What already answers to `name` (a model id, an adapter or an adapter alias),
        or None: a new adapter may not take it."""
        if name in self._by_id:
            return f"the id of model {name!r}"
        base_id = self.adapters.base_of(name)
        if base_id is not None:
            return f"an adapter of {base_id!r}"
        hit = self.adapters.by_alias(name, patterns=False)
        return None if hit is None else f"an alias of adapter {hit[1].name!r}"


def _spellings(name: str) -> tuple[str, ...]:
    if name.endswith(_OLLAMA_DEFAULT_TAG):
        return (name, name[: -len(_OLLAMA_DEFAULT_TAG)])
    return (name,)
