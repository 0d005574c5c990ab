"""Hugging Face hub ids: recognise `org/name` and fetch its snapshot, with one-line errors.

This module never imports mlx, so the CLI resolves a hub id before the multi-second imports
and model load: a machine without network learns it at once, in one line that names the
host it could not reach and how to pass a local directory instead.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from urllib.parse import urlsplit

from compat_serve.models.errors import ModelLoadError

__all__ = ["HUB_ALLOW_PATTERNS", "download_hub_model", "hub_endpoint", "looks_like_hub_id"]

logger = logging.getLogger(__name__)

HUB_ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_DEFAULT_ENDPOINT = "https://huggingface.co"


def looks_like_hub_id(spec: str) -> bool:
    """`org/name` that is not an existing path."""
    return bool(_HUB_ID.match(spec)) and not Path(spec).exists()


def hub_endpoint() -> str:
    """The hub huggingface_hub talks to (`HF_ENDPOINT`, else huggingface.co)."""
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - mlx-lm depends on huggingface_hub
        return os.environ.get("HF_ENDPOINT", _DEFAULT_ENDPOINT)
    return str(getattr(constants, "ENDPOINT", _DEFAULT_ENDPOINT))


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _network_cause(exc: BaseException) -> BaseException | None:
    """The connection-level error behind `exc` (DNS, refused, timeout), if that is the cause.

    huggingface_hub wraps it: with no network and no cached snapshot it raises
    LocalEntryNotFoundError whose `__cause__` is httpx's ConnectError (or requests')."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        name = type(current).__name__
        if isinstance(current, (ConnectionError, TimeoutError)) or name in {
            "ConnectError",
            "ConnectTimeout",
            "ReadTimeout",
            "ProxyError",
            "NameResolutionError",
        }:
            return current
        current = current.__cause__ or current.__context__
    return None


def _offline_mode() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def download_hub_model(repo_id: str, *, revision: str | None = None) -> Path:
    """Resolve a hub id to a local snapshot (cached by huggingface_hub; needs the network once).

    Raises ModelLoadError with a one-line message: for an unreachable hub it names the host
    and says how to pass a local directory."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - mlx-lm depends on it
        raise ModelLoadError("huggingface_hub is required to load hub ids") from exc
    logger.info("resolving hub model %s", repo_id)
    try:
        return Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS)
        )
    except Exception as exc:
        name = repo_id.rsplit("/", maxsplit=1)[-1]
        local = (
            f"pass a local model directory instead (--model /path/to/{name}, "
            f"fetched on a machine with network by `hf download {repo_id} --local-dir DIR`) "
            "or a .gguf file"
        )
        endpoint = hub_endpoint()
        host = urlsplit(endpoint).netloc or endpoint
        if _offline_mode():
            raise ModelLoadError(
                _one_line(
                    f"cannot load {repo_id!r}: HF_HUB_OFFLINE is set and it is not in the local "
                    f"Hugging Face cache; {local}"
                )
            ) from exc
        cause = _network_cause(exc)
        if cause is not None:
            raise ModelLoadError(
                _one_line(
                    f"cannot load {repo_id!r}: could not reach the Hugging Face hub at {host} "
                    f"({type(cause).__name__}: {cause}) and it is not in the local cache; "
                    f"{local}"
                )
            ) from exc
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ModelLoadError(
            _one_line(
                f"cannot fetch {repo_id!r} from the Hugging Face hub at {host} "
                f"({type(exc).__name__}: {first}); check the id, or HF_TOKEN for a gated "
                f"model, or {local}"
            )
        ) from exc
