"""The model registry's configuration and routing (python/compat_serve/registry/): no
model is loaded here; model paths are empty `.gguf` files and config.json directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compat_serve.registry.config_file import ModelsFileError, load_models_file
from compat_serve.registry.entries import ModelEntry, entries_from_dir, is_model_path
from compat_serve.registry.routing import ModelRegistry


@pytest.fixture
def models(tmp_path: Path) -> Path:
    (tmp_path / "fast.gguf").write_bytes(b"GGUF")
    (tmp_path / "main").mkdir()
    (tmp_path / "main" / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()  # no config.json: not a model
    (tmp_path / "readme.txt").write_text("x")
    return tmp_path


def _write(tmp: Path, text: str) -> str:
    path = tmp / "models.yaml"
    path.write_text(text)
    return str(path)


def test_a_models_dir_lists_model_dirs_and_gguf_files(models: Path) -> None:
    entries = entries_from_dir(str(models))
    assert [(e.id, Path(e.path or "").name) for e in entries] == [
        ("fast", "fast.gguf"),
        ("main", "main"),
    ]
    assert not is_model_path(models / "notes")
    assert not is_model_path(models / "readme.txt")


def test_an_empty_or_missing_models_dir_fails(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no models in it"):
        entries_from_dir(str(tmp_path))
    with pytest.raises(ValueError, match="not a directory"):
        entries_from_dir(str(tmp_path / "missing"))


CLAUDE_CODE = """\
models:
  - id: main
    path: main
    aliases: ["claude-*sonnet*", "claude-*opus*"]
    default: true
    pin: true
    context_length: 4096
  - id: fast
    path: fast.gguf
    aliases:
      - "claude-*haiku*"
    ttl: 600
    default_temperature: 0.2
    kv_bits: 8
"""


def test_a_models_file_reads_ids_aliases_and_per_model_options(models: Path) -> None:
    main, fast = load_models_file(_write(models, CLAUDE_CODE))
    assert (main.id, main.path, main.default, main.pin) == (
        "main",
        str(models / "main"),
        True,
        True,
    )
    assert main.aliases == ("claude-*sonnet*", "claude-*opus*")
    assert main.options == {"context_length": 4096}
    assert (fast.id, fast.ttl_s, fast.pin, fast.default) == ("fast", 600.0, False, False)
    assert fast.options == {"default_temperature": 0.2, "kv_bits": 8}


def test_claude_code_names_route_to_their_models(models: Path) -> None:
    registry = ModelRegistry(load_models_file(_write(models, CLAUDE_CODE)))
    route = registry.route
    assert route("claude-haiku-4-5-20251001") is registry.get("fast")
    assert route("claude-3-5-haiku-latest") is registry.get("fast")
    assert route("claude-sonnet-4-5-20250929") is registry.get("main")
    assert route("claude-opus-4-1") is registry.get("main")
    assert route("fast") is registry.get("fast")
    assert route("fast:latest") is registry.get("fast")  # Ollama's tag
    # Anything else is the default model's, as one model serves every name today.
    assert route("gpt-5-codex") is registry.get("main")
    assert route("") is registry.get("main")


def test_strict_names_route_nothing_unknown(models: Path) -> None:
    registry = ModelRegistry(load_models_file(_write(models, CLAUDE_CODE)), strict=True)
    assert registry.route("gpt-5-codex") is None
    assert registry.route("") is None
    assert registry.route("claude-haiku-4-5") is registry.get("fast")  # aliases still work


def test_aliases_are_tried_in_file_order() -> None:
    first = ModelEntry("a", None, aliases=("claude-*",))
    second = ModelEntry("b", None, aliases=("claude-*haiku*",))
    registry = ModelRegistry([first, second])
    assert registry.route("claude-haiku-4-5") is first


def test_without_a_default_the_first_model_is_default() -> None:
    registry = ModelRegistry([ModelEntry("a", None), ModelEntry("b", None)])
    assert registry.default.id == "a"
    assert registry.route("whatever").id == "a"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("text", "line", "key", "message"),
    [
        ("models:\n  - id: a\n    path: fast.gguf\n    colour: red\n", 4, "colour", "unknown key"),
        ("models:\n  - id: a\n    path: fast.gguf\n    ttl: soon\n", 4, "ttl", "must be"),
        ("models:\n  - id: a\n    path: fast.gguf\n    pin: 1\n", 4, "pin", "true/false"),
        (
            "models:\n  - id: a\n    path: fast.gguf\n    context_length: true\n",
            4,
            "context_length",
            "must be",
        ),
        ("models:\n  - id: a\n    path: fast.gguf\n    aliases: x\n", 4, "aliases", "a list"),
        ("models:\n  - id: a\n    path: fast.gguf\n    aliases: [3]\n", 4, "aliases", "strings"),
        ("models:\n  - id: a\n    path: notes\n", 3, "path", "is not a model"),
        ("models:\n  - id: a\n    path: nowhere.gguf\n", 3, "path", "is not a model"),
        ("models:\n  - path: fast.gguf\n", 2, "id", "missing"),
        ("models:\n  - id: a\n", 2, "path", "missing"),
        (
            "models:\n  - id: a\n    path: fast.gguf\n  - id: a\n    path: main\n",
            4,
            "id",
            "also the id",
        ),
        (
            "models:\n  - id: a\n    path: fast.gguf\n    default: true\n"
            "  - id: b\n    path: main\n    default: true\n",
            5,
            "default",
            "already the default",
        ),
        (
            "models:\n  - id: a\n    path: fast.gguf\n    aliases: [claude-haiku]\n"
            "  - id: b\n    path: main\n    aliases: [claude-haiku]\n",
            5,
            "aliases",
            "also an alias of 'a'",
        ),
        (
            "models:\n  - id: claude-main\n    path: main\n"
            "  - id: b\n    path: fast.gguf\n    aliases: ['claude-*']\n",
            4,
            "aliases",
            "matches the id of another model",
        ),
        ("models:\n  - id: a\n    path: fast.gguf\n    id: b\n", 4, "id", "given twice"),
        ("servers: []\n", 1, "servers", "unknown key"),
        ("models: []\n", 1, "models", "non-empty list"),
        ("models:\n  - just-a-string\n", 2, None, "must be a mapping"),
        ("models: [\n", 2, None, "not valid YAML"),
    ],
)
def test_bad_models_files_name_file_line_and_key(
    models: Path, text: str, line: int, key: str | None, message: str
) -> None:
    path = _write(models, text)
    with pytest.raises(ModelsFileError) as caught:
        load_models_file(path)
    error = caught.value
    assert (error.file, error.line, error.key) == (path, line, key), str(error)
    assert message in str(error)
    assert str(error).startswith(f"{path}:{line}: ")


def test_a_missing_or_empty_models_file_fails(tmp_path: Path) -> None:
    with pytest.raises(ModelsFileError, match="cannot read"):
        load_models_file(str(tmp_path / "none.yaml"))
    with pytest.raises(ModelsFileError, match="empty file"):
        load_models_file(_write(tmp_path, ""))


def test_relative_option_paths_resolve_beside_the_file(models: Path) -> None:
    text = "models:\n  - id: a\n    path: fast.gguf\n    cache_dir: cache/a\n"
    (entry,) = load_models_file(_write(models, text))
    assert entry.options["cache_dir"] == str(models / "cache" / "a")


_MODEL_LAYER = "application/vnd.ollama.image.model"


def _ollama_manifest(
    store: Path, name: str, tag: str, digest: str, media: str = _MODEL_LAYER
) -> None:
    manifest = store / "manifests" / "registry.ollama.ai" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    layer = {"mediaType": media, "digest": f"sha256:{digest}"}
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [layer]}))


def test_an_ollama_store_lists_its_gguf_blobs_under_ollamas_names(tmp_path: Path) -> None:
    store = tmp_path / ".ollama" / "models"
    (store / "blobs").mkdir(parents=True)
    for digest in ("aa11", "bb22"):
        (store / "blobs" / f"sha256-{digest}").write_bytes(b"GGUF" + bytes(60))
    (store / "blobs" / "sha256-cc33").write_text("{}")  # a template layer: not a GGUF
    _ollama_manifest(store, "library/qwen3", "latest", "aa11")
    _ollama_manifest(store, "library/qwen3", "8b", "aa11")
    _ollama_manifest(store, "me/coder", "q4", "bb22")
    # A manifest whose model blob is missing, one with no model layer, one not JSON.
    _ollama_manifest(store, "library/gone", "latest", "dd44")
    _ollama_manifest(store, "library/tmpl", "latest", "cc33", media="x")
    (store / "manifests" / "registry.ollama.ai" / "library" / "tmpl" / "broken").write_text("{")

    for root in (store, store.parent):  # ~/.ollama/models or ~/.ollama
        entries = entries_from_dir(str(root))
        assert [(e.id, Path(e.path or "").name) for e in entries] == [
            ("qwen3:8b", "sha256-aa11"),
            ("qwen3", "sha256-aa11"),
            ("me/coder:q4", "sha256-bb22"),
        ]
    assert is_model_path(store / "blobs" / "sha256-aa11")
    assert not is_model_path(store / "blobs" / "sha256-cc33")

    for manifest in (store / "manifests").rglob("*"):
        if manifest.is_file() and "gone" not in str(manifest):
            manifest.unlink()
    with pytest.raises(ValueError, match="an Ollama store with no GGUF models in it"):
        entries_from_dir(str(store))
