"""One configured model: where it is, the names it answers to, and its serve options.

An entry is configuration only; whether it is loaded lives in the hub (registry/hub.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compat_serve.models.gguf_header import is_gguf_file
from compat_serve.registry.adapters import AdapterEntry

# The options a model may set for itself in a --models file, with the CLI's names (as
# ServeOptions spells them) and the YAML types each accepts. Server-wide options
# (host, port, api key, request size, strictness) are the command line's alone.
PER_MODEL_OPTIONS: dict[str, tuple[type, ...]] = {
    "served_model_name": (str,),
    "chat_template": (str,),
    "inline_system": (str,),
    "reply_history": (str,),
    "context_length": (int, str),
    "prefill_chunk": (int,),
    "decode_prefill_chunk": (int,),
    "max_num_seqs": (int,),
    "speculative": (str,),
    "speculative_tokens": (int, str),
    "ngram_min": (int,),
    "ngram_max": (int,),
    "draft_model": (str,),
    "max_num_batched_tokens": (int,),
    "kv_memory": (str,),
    "kv_bits": (int, str),
    "kv_group_size": (int, str),
    "prefix_cache": (bool,),
    "block_size": (int,),
    "cache_memory": (str,),
    "cache_hash": (str,),
    "cache_dir": (str,),
    "cache_disk_size": (str,),
    "max_queue": (int,),
    "max_output_tokens": (int,),
    "max_tool_rounds": (int,),
    "reasoning_budget": (int,),
    "reasoning_budgets": (str,),
    "default_temperature": (float, int),
    "default_top_p": (float, int),
    "default_top_k": (int,),
    "generation_config": (str,),
    "tool_parser": (str,),
    "reasoning_parser": (str,),
    "dtype": (str,),
}


@dataclass(frozen=True)
class ModelEntry:
    """A configured model. `path` None is the embedded default model."""

    id: str
    path: str | None
    aliases: tuple[str, ...] = ()
    # Seconds idle before the model may be unloaded first (None: only under pressure).
    ttl_s: float | None = None
    # Never evicted (still unloadable by an explicit unload request).
    pin: bool = False
    # Loaded at start rather than on its first request.
    preload: bool = False
    default: bool = False
    # Per-model serve options (PER_MODEL_OPTIONS' names) over the command line's.
    options: dict[str, Any] = field(default_factory=dict)
    # Where the entry was declared ("models.yaml:12"), for messages.
    origin: str = ""
    # LoRA adapters served on this model (registry/adapters.py).
    adapters: tuple[AdapterEntry, ...] = ()


def is_model_path(path: Path) -> bool:
    """A GGUF file, or a directory holding an MLX/HF model (its config.json)."""
    if path.is_file():
        return is_gguf_file(path)
    return path.is_dir() and (path / "config.json").is_file()


def entries_from_dir(directory: str) -> list[ModelEntry]:
    """`--models-dir DIR`: one entry per model subdirectory or `.gguf` file, its id the
    directory name or the file name without `.gguf`, in name order."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"--models-dir {directory}: not a directory")
    store = ollama_store(root)
    if store is not None:
        return _ollama_entries(store, directory)
    entries = []
    for child in sorted(root.iterdir(), key=lambda p: p.name):
        if child.name.startswith(".") or not is_model_path(child):
            continue
        model_id = child.stem if child.is_file() else child.name
        entries.append(ModelEntry(model_id, str(child), origin=f"--models-dir {directory}"))
    if not entries:
        raise ValueError(
            f"--models-dir {directory}: no models in it (a model is a .gguf file or a "
            "directory with a config.json)"
        )
    return entries


# Ollama's model store (`~/.ollama/models`): `manifests/<registry>/<namespace>/<model>/<tag>`
# are JSON manifests whose layer of this media type names the GGUF blob by its digest,
# stored as `blobs/sha256-<hex>`.
_OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"


def ollama_store(root: Path) -> Path | None:
    """`root` itself, or `root/models` (`~/.ollama`), when it holds Ollama's manifests and
    blobs; else None."""
    for candidate in (root, root / "models"):
        if (candidate / "manifests").is_dir() and (candidate / "blobs").is_dir():
            return candidate
    return None


def _ollama_entries(store: Path, directory: str) -> list[ModelEntry]:
    """One entry per manifest whose model layer is a GGUF blob present in the store, its id
    Ollama's own name (`qwen3:8b`; `name` for the `latest` tag; `namespace/name:tag` outside
    the `library` namespace), so Ollama clients ask for it as they did."""
    entries = []
    for manifest in sorted(p for p in (store / "manifests").glob("*/*/*/*") if p.is_file()):
        namespace, model, tag = manifest.parts[-3:]
        try:
            layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
            digest = next(x["digest"] for x in layers if x.get("mediaType") == _OLLAMA_MODEL_LAYER)
        except (OSError, ValueError, AttributeError, KeyError, StopIteration, TypeError):
            continue  # not a model manifest (a projector, a corrupt file)
        blob = store / "blobs" / str(digest).replace(":", "-")
        if not is_gguf_file(blob):
            continue
        name = model if namespace == "library" else f"{namespace}/{model}"
        model_id = name if tag == "latest" else f"{name}:{tag}"
        entries.append(ModelEntry(model_id, str(blob), origin=f"--models-dir {directory} (Ollama)"))
    if not entries:
        raise ValueError(f"--models-dir {directory}: an Ollama store with no GGUF models in it")
    return entries
