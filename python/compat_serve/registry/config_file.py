"""`--models FILE`: the YAML list of models, checked before anything loads.

    models:
      - id: main
        path: /models/Qwen3-8B-4bit
        default: true
        pin: true
        context_length: 32768
      - id: fast
        path: /models/SmolLM2-135M.gguf
        aliases: ["claude-*haiku*"]
        ttl: 600
        default_temperature: 0.2
        adapters:
          - {name: commits, path: ./adapters/commits, aliases: ["commit-*"]}
          - style=./adapters/repo-style

Every mistake (an unknown key, a wrong type, two models with one id, an alias given to
two models, a path that is not a model) is a `ModelsFileError` naming the file, the
line and the key, raised at start.
"""

from __future__ import annotations

import math
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import yaml

from compat_serve.registry.adapters import AdapterEntry, adapter_entry
from compat_serve.registry.entries import PER_MODEL_OPTIONS, ModelEntry, is_model_path

ENTRY_KEYS: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "path": (str,),
    "aliases": (list,),
    "ttl": (int, float),
    "pin": (bool,),
    "preload": (bool,),
    "default": (bool,),
    "adapters": (list,),
}


class ModelsFileError(ValueError):
    """A bad --models file: `file:line: key: message`."""

    def __init__(self, file: str, line: int, key: str | None, message: str) -> None:
        where = f"{file}:{line}"
        super().__init__(f"{where}: {key}: {message}" if key else f"{where}: {message}")
        self.file, self.line, self.key = file, line, key


class _Node:
    """A parsed YAML value with the (1-based) line it starts on."""

    def __init__(self, value: Any, line: int) -> None:
        self.value, self.line = value, line


def _convert(node: yaml.Node) -> _Node:
    """YAML nodes to Python values, keeping each mapping's and sequence's lines."""
    line = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        mapping: dict[str, tuple[int, _Node]] = {}
        for key_node, value_node in node.value:
            key = str(_scalar(key_node))
            if key in mapping:
                raise _Duplicate(key, key_node.start_mark.line + 1)
            mapping[key] = (key_node.start_mark.line + 1, _convert(value_node))
        return _Node(mapping, line)
    if isinstance(node, yaml.SequenceNode):
        return _Node([_convert(item) for item in node.value], line)
    return _Node(_scalar(node), line)


def _scalar(node: yaml.Node) -> Any:
    return yaml.SafeLoader("").construct_object(node)


class _Duplicate(Exception):
    def __init__(self, key: str, line: int) -> None:
        self.key, self.line = key, line


def _type_name(types: tuple[type, ...]) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}
    return " or ".join(names.get(t, "a list") for t in types)


def _check_type(file: str, line: int, key: str, value: Any, types: tuple[type, ...]) -> None:
    # YAML booleans are Python ints: a `true` is no number, and a number no boolean.
    ok = isinstance(value, types) and (bool in types or not isinstance(value, bool))
    if not ok:
        raise ModelsFileError(file, line, key, f"must be {_type_name(types)}, not {value!r}")


def load_models_file(path: str) -> list[ModelEntry]:
    """The entries of a --models file, in file order; ModelsFileError on any mistake."""
    file = path
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelsFileError(file, 1, None, f"cannot read: {exc.strerror}") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        raise ModelsFileError(file, line, None, f"not valid YAML: {exc}") from None
    if root is None:
        raise ModelsFileError(file, 1, None, "empty file: expected `models: [...]`")
    try:
        top = _convert(root)
    except _Duplicate as dup:
        raise ModelsFileError(file, dup.line, dup.key, "given twice") from None
    if not isinstance(top.value, dict):
        raise ModelsFileError(file, top.line, None, "expected a mapping with a `models` list")
    for key, (line, _) in top.value.items():
        if key != "models":
            raise ModelsFileError(file, line, key, "unknown key (the file has one: models)")
    if "models" not in top.value:
        raise ModelsFileError(file, top.line, "models", "missing")
    models_line, models = top.value["models"]
    if not isinstance(models.value, list) or not models.value:
        raise ModelsFileError(file, models_line, "models", "must be a non-empty list")
    base = Path(path).resolve().parent
    entries = [_entry(file, base, item) for item in models.value]
    check_entries(entries)
    return entries


def _entry(file: str, base: Path, node: _Node) -> ModelEntry:
    if not isinstance(node.value, dict):
        raise ModelsFileError(file, node.line, None, "each model must be a mapping")
    fields: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for key, (line, value_node) in node.value.items():
        value = value_node.value
        if key in ENTRY_KEYS:
            _check_type(file, line, key, value, ENTRY_KEYS[key])
            fields[key] = value
        elif key in PER_MODEL_OPTIONS:
            _check_type(file, line, key, value, PER_MODEL_OPTIONS[key])
            options[key] = value
        else:
            raise ModelsFileError(
                file,
                line,
                key,
                "unknown key (model keys: "
                + ", ".join([*ENTRY_KEYS, "and the per-model serve options"])
                + ")",
            )
    for required in ("id", "path"):
        if required not in fields:
            raise ModelsFileError(file, node.line, required, "missing")
    lines = {key: line for key, (line, _) in node.value.items()}
    model_id = fields["id"].strip()
    if not model_id:
        raise ModelsFileError(file, lines["id"], "id", "must not be empty")
    model_path = Path(fields["path"]).expanduser()
    if not model_path.is_absolute():
        model_path = base / model_path
    if not is_model_path(model_path):
        raise ModelsFileError(
            file,
            lines["path"],
            "path",
            f"{model_path} is not a model (a .gguf file or a directory with a config.json)",
        )
    aliases = []
    for item in fields.get("aliases", []):
        if not isinstance(item.value, str) or not item.value:
            raise ModelsFileError(
                file, item.line, "aliases", f"must be strings, not {item.value!r}"
            )
        aliases.append(item.value)
    ttl = fields.get("ttl")
    if ttl is not None and not (ttl > 0 and math.isfinite(ttl)):
        raise ModelsFileError(file, lines["ttl"], "ttl", f"must be seconds > 0, not {ttl!r}")
    for key in ("cache_dir", "chat_template", "draft_model"):
        if key in options:
            resolved = Path(options[key]).expanduser()
            options[key] = str(resolved if resolved.is_absolute() else base / resolved)
    return ModelEntry(
        model_id,
        str(model_path),
        aliases=tuple(aliases),
        ttl_s=None if ttl is None else float(ttl),
        pin=fields.get("pin", False),
        preload=fields.get("preload", False),
        default=fields.get("default", False),
        options=options,
        origin=f"{file}:{node.line}",
        adapters=tuple(_adapter(file, base, item) for item in fields.get("adapters", [])),
    )


_ADAPTER_KEYS = ("name", "path", "aliases")


def _adapter(file: str, base: Path, node: _Node) -> AdapterEntry:
    """One item of an entry's `adapters:`: `NAME=PATH` or `{name, path, aliases?}`."""
    origin = f"{file}:{node.line}"
    if isinstance(node.value, str):
        name, sep, path = node.value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ModelsFileError(
                file, node.line, "adapters", f"expected NAME=PATH, not {node.value!r}"
            )
        try:
            return adapter_entry(name.strip(), path.strip(), base=base, origin=origin)
        except ValueError as exc:
            raise ModelsFileError(file, node.line, "adapters", str(exc)) from None
    if not isinstance(node.value, dict):
        raise ModelsFileError(
            file, node.line, "adapters", "each adapter is NAME=PATH or {name, path, aliases}"
        )
    values: dict[str, Any] = {}
    for key, (line, value_node) in node.value.items():
        if key not in _ADAPTER_KEYS:
            raise ModelsFileError(
                file, line, f"adapters.{key}", "unknown key (adapter keys: name, path, aliases)"
            )
        values[key] = value_node.value
        expected: tuple[type, ...] = (list,) if key == "aliases" else (str,)
        _check_type(file, line, f"adapters.{key}", values[key], expected)
    for required in ("name", "path"):
        if required not in values:
            raise ModelsFileError(file, node.line, f"adapters.{required}", "missing")
    aliases = []
    for item in values.get("aliases", []):
        if not isinstance(item.value, str) or not item.value:
            raise ModelsFileError(
                file, item.line, "adapters.aliases", f"must be strings, not {item.value!r}"
            )
        aliases.append(item.value)
    try:
        return adapter_entry(
            values["name"], values["path"], base=base, origin=origin, aliases=tuple(aliases)
        )
    except ValueError as exc:
        raise ModelsFileError(file, node.line, "adapters", str(exc)) from None


def check_entries(entries: list[ModelEntry]) -> None:
    """Ids unique, at most one default, no alias given to two models or shadowing an id.
    Raises ValueError (ModelsFileError when the entry came from a file)."""
    seen: dict[str, ModelEntry] = {}
    for entry in entries:
        if entry.id in seen:
            _fail(
                entry, "id", f"{entry.id!r} is also the id of the model at {seen[entry.id].origin}"
            )
        seen[entry.id] = entry
    defaults = [e for e in entries if e.default]
    if len(defaults) > 1:
        _fail(defaults[1], "default", f"{defaults[0].id!r} is already the default model")
    owner: dict[str, ModelEntry] = {}
    for entry in entries:
        for alias in entry.aliases:
            if alias in owner and owner[alias] is not entry:
                _fail(entry, "aliases", f"{alias!r} is also an alias of {owner[alias].id!r}")
            shadowed = [e.id for e in entries if e is not entry and fnmatchcase(e.id, alias)]
            if shadowed:
                _fail(
                    entry,
                    "aliases",
                    f"{alias!r} matches the id of another model ({', '.join(shadowed)}): "
                    "a pattern must name one model",
                )
            owner[alias] = entry
    _check_adapters(entries)


def _check_adapters(entries: list[ModelEntry]) -> None:
    """Adapter names unique across every model and adapter (a name alone picks its base);
    an adapter alias neither another name nor another's alias."""
    names: dict[str, str] = {entry.id: f"the model at {entry.origin}" for entry in entries}
    for entry in entries:
        for adapter in entry.adapters:
            if adapter.name in names:
                _fail(entry, "adapters", f"{adapter.name!r} is also {names[adapter.name]}")
            names[adapter.name] = f"an adapter of {entry.id!r}"
    aliases: dict[str, str] = {}
    for entry in entries:
        for adapter in entry.adapters:
            for alias in adapter.aliases:
                if alias in names:
                    _fail(entry, "adapters", f"alias {alias!r} is also {names[alias]}")
                if alias in aliases and aliases[alias] != adapter.name:
                    _fail(
                        entry,
                        "adapters",
                        f"alias {alias!r} is also an alias of adapter {aliases[alias]!r}",
                    )
                aliases[alias] = adapter.name


def _fail(entry: ModelEntry, key: str, message: str) -> None:
    file, _, line = entry.origin.rpartition(":")
    if file and line.isdigit():
        raise ModelsFileError(file, int(line), key, message)
    raise ValueError(f"{entry.origin}: {key}: {message}")
