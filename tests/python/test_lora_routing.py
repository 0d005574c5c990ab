"""LoRA adapters in the registry (#38): `--lora NAME=PATH`, `adapters:` in a --models
file, and routing a request's model name to a base model and adapter. No model is
loaded: model paths are config.json directories, adapters directories holding only their
adapter_config.json (the engine reads the weights; tests/http/test_lora_http.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from compat_serve.registry.adapters import AdapterEntry, parse_lora_flag
from compat_serve.registry.config_file import ModelsFileError, load_models_file
from compat_serve.registry.entries import ModelEntry
from compat_serve.registry.routing import ModelRegistry, UnknownAdapter
from compat_serve.serve_flags import build_serve_parser
from compat_serve.serve_models import SINGLE_ORIGIN, check_adapter_bases, with_lora_flags
from tests.python.test_cli import run_cli


@pytest.fixture
def files(tmp_path: Path) -> Path:
    for model in ("main", "fast"):
        (tmp_path / model).mkdir()
        (tmp_path / model / "config.json").write_text("{}")
    for adapter in ("commits", "style", "terse"):
        (tmp_path / "adapters" / adapter).mkdir(parents=True)
        (tmp_path / "adapters" / adapter / "adapter_config.json").write_text("{}")
    (tmp_path / "adapters" / "empty").mkdir()  # no adapter_config.json: not an adapter
    return tmp_path


def _write(tmp: Path, text: str) -> str:
    path = tmp / "models.yaml"
    path.write_text(text)
    return str(path)


MODELS = """\
models:
  - id: main
    path: main
    aliases: ["claude-*sonnet*", "qwen*"]
    default: true
    adapters:
      - name: commits
        path: adapters/commits
        aliases: ["commit-writer", "claude-*commit*"]
      - style=adapters/style
  - id: fast
    path: fast
    adapters: ["terse=./adapters/terse"]
"""


def _registry(files: Path, *, strict: bool = False) -> ModelRegistry:
    return ModelRegistry(load_models_file(_write(files, MODELS)), strict=strict)


def _routed(registry: ModelRegistry, name: str) -> tuple[str, str | None]:
    routed = registry.resolve(name)
    assert routed is not None
    return routed.entry.id, None if routed.adapter is None else routed.adapter.name


def test_a_models_file_reads_adapters_in_both_spellings(files: Path) -> None:
    main, fast = load_models_file(_write(files, MODELS))
    assert [(a.name, Path(a.path), a.aliases) for a in main.adapters] == [
        ("commits", files / "adapters" / "commits", ("commit-writer", "claude-*commit*")),
        ("style", files / "adapters" / "style", ()),
    ]
    assert [(a.name, Path(a.path)) for a in fast.adapters] == [
        ("terse", files / "adapters" / "terse")
    ]


def test_the_three_naming_forms_route_to_base_and_adapter(files: Path) -> None:
    registry = _registry(files)
    # BASE:ADAPTER, the base by id or by one of its aliases.
    assert _routed(registry, "main:commits") == ("main", "commits")
    assert _routed(registry, "claude-3-5-sonnet:style") == ("main", "style")
    assert _routed(registry, "fast:terse") == ("fast", "terse")
    # The adapter's own name (Ollama's :latest ignored).
    assert _routed(registry, "terse") == ("fast", "terse")
    assert _routed(registry, "style:latest") == ("main", "style")
    # Its aliases: exact, and a pattern.
    assert _routed(registry, "commit-writer") == ("main", "commits")
    assert _routed(registry, "claude-commit-v2") == ("main", "commits")
    # Plain model names still route as before; unknown ones to the default, no adapter.
    assert _routed(registry, "fast") == ("fast", None)
    assert _routed(registry, "main:latest") == ("main", None)
    assert _routed(registry, "claude-sonnet-4-5") == ("main", None)
    assert _routed(registry, "gpt-4o") == ("main", None)


def test_an_unknown_adapter_of_a_known_base_never_serves_the_base(files: Path) -> None:
    registry = _registry(files)
    with pytest.raises(UnknownAdapter, match="'main' has no adapter 'nope'"):
        registry.resolve("main:nope")
    # An adapter of another base is not this base's.
    with pytest.raises(UnknownAdapter, match="'fast' has no adapter 'commits'"):
        registry.resolve("fast:commits")
    # A name a model alias pattern matches whole is that model (Ollama's size tags).
    assert _routed(registry, "qwen3:8b") == ("main", None)
    # Under --strict-model-names an unknown adapter's own name routes nowhere.
    assert _registry(files, strict=True).resolve("nope") is None


def test_adapters_added_at_run_time_route_and_leave(files: Path) -> None:
    registry = _registry(files)
    path = str(files / "adapters" / "terse")
    registry.adapters.add("main", AdapterEntry("extra", path))
    assert _routed(registry, "extra") == ("main", "extra")
    assert _routed(registry, "main:extra") == ("main", "extra")
    assert registry.taken("extra") == "an adapter of 'main'"
    assert registry.taken("main") == "the id of model 'main'"
    assert registry.taken("commit-writer") == "an alias of adapter 'commits'"
    registry.adapters.remove("main", "extra")
    assert registry.taken("extra") is None
    with pytest.raises(UnknownAdapter):
        registry.resolve("main:extra")


@pytest.mark.parametrize(
    ("adapters", "message"),
    [
        ('["main=adapters/style"]', "'main' is also the model at"),
        ('["style=adapters/style"]', "'style' is also an adapter of 'main'"),
        ('["x=adapters/empty"]', "is not an adapter (a directory with an adapter_config.json"),
        ('["x=adapters/missing"]', "is not an adapter"),
        ('["a:b=adapters/style"]', "must not contain ':'"),
        ('["no-path"]', "expected NAME=PATH"),
        ("[{name: x}]", "adapters.path: missing"),
        ("[{name: x, path: adapters/style, rank: 8}]", "adapters.rank: unknown key"),
        ("[{name: x, path: adapters/style, aliases: [commit-writer]}]", "also an alias"),
        ("[3]", "each adapter is NAME=PATH or {name, path, aliases}"),
        ('"x=adapters/style"', "adapters: must be a list"),
    ],
)
def test_bad_adapters_in_a_models_file_name_file_line_and_key(
    files: Path, adapters: str, message: str
) -> None:
    text = MODELS.replace('adapters: ["terse=./adapters/terse"]', f"adapters: {adapters}")
    with pytest.raises(ModelsFileError, match=r"models\.yaml:1[0-9]: ") as info:
        load_models_file(_write(files, text))
    assert message in str(info.value)


def test_the_lora_flag_is_repeatable_and_lands_on_the_single_model(files: Path) -> None:
    ns = build_serve_parser().parse_args(
        ["--lora", f"commits={files}/adapters/commits", "--lora", f"style={files}/adapters/style"]
    )
    assert ns.lora == [f"commits={files}/adapters/commits", f"style={files}/adapters/style"]
    single = ModelEntry("smol", None, origin=SINGLE_ORIGIN)
    other = ModelEntry("fast", str(files / "fast"), default=True, origin="models.yaml:3")
    entries = with_lora_flags([single, other], tuple(ns.lora))
    assert [a.name for a in entries[0].adapters] == ["commits", "style"]
    assert entries[1].adapters == ()
    # Without --model the flags go to the registry's default model.
    (first,) = [e for e in with_lora_flags([other], ("x=" + ns.lora[0][8:],)) if e.adapters]
    assert first.id == "fast"


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("commits", "expected NAME=PATH"),
        ("=x", "expected NAME=PATH"),
        ("base:x={adapters}/style", "must not contain ':'"),
        ("x={adapters}/empty", "is not an adapter"),
    ],
)
def test_bad_lora_flags_are_refused(files: Path, flag: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_lora_flag(flag.format(adapters=files / "adapters"))


def test_two_lora_flags_with_one_name_are_refused(files: Path) -> None:
    single = ModelEntry("smol", None, origin=SINGLE_ORIGIN)
    flags = (f"x={files}/adapters/style", f"x={files}/adapters/terse")
    with pytest.raises(ValueError, match="'x' is also an adapter of 'smol'"):
        ModelRegistry(with_lora_flags([single], flags))


def test_a_bad_lora_flag_stops_the_start_before_the_model_loads(files: Path) -> None:
    result = run_cli("--lora", f"x={files}/adapters/empty", "--port", "1")
    assert result.returncode == 2
    assert f"adapter 'x': {files}/adapters/empty is not an adapter" in result.stderr
    assert "Traceback" not in result.stderr
    assert "loading" not in result.stderr.lower()


def test_adapters_on_an_embedding_model_are_refused(files: Path, tmp_path: Path) -> None:
    from tests.tiny_embedding_models import write_bert_embedding

    embedder = write_bert_embedding(tmp_path / "bert")
    adapter = AdapterEntry("style", str(files / "adapters" / "style"))
    check_adapter_bases([ModelEntry("chat", None, adapters=(adapter,))])
    with pytest.raises(ValueError) as err:
        check_adapter_bases(
            [ModelEntry("bert", str(embedder), adapters=(adapter,), origin="m.yaml:3")]
        )
    assert str(err.value) == (
        "m.yaml:3: model 'bert' is an embedding model; LoRA adapters (style) apply to chat "
        "models only"
    )
