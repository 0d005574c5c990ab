"""Which configured model a request's `model` names: its exact id, else the first alias
pattern (fnmatch globs, case-sensitive, in declaration order) it matches, else the
default model, unless `--strict-model-names` (then None: the caller answers 404)."""

from __future__ import annotations

from fnmatch import fnmatchcase

from compat_serve.registry.config_file import check_entries
from compat_serve.registry.entries import ModelEntry

# Ollama clients append a tag; `name:latest` is `name`.
_OLLAMA_DEFAULT_TAG = ":latest"


class ModelRegistry:
    """The configured models, in declaration order; routing by name. No state."""

    def __init__(self, entries: list[ModelEntry], *, strict: bool = False) -> None:
        if not entries:
            raise ValueError("no models configured")
        check_entries(entries)
        self.entries = list(entries)
        self.strict = strict
        self._by_id = {entry.id: entry for entry in entries}
        self.default = next((e for e in entries if e.default), entries[0])

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
        entry = self.match(name) if name else None
        if entry is not None:
            return entry
        return None if self.strict else self.default


def _spellings(name: str) -> tuple[str, ...]:
    if name.endswith(_OLLAMA_DEFAULT_TAG):
        return (name, name[: -len(_OLLAMA_DEFAULT_TAG)])
    return (name,)
