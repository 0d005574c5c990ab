"""What a sentence-transformers model directory says about itself: its modules
(`modules.json`), pooling (`1_Pooling/config.json`), prompts
(`config_sentence_transformers.json`) and length limit (`sentence_bert_config.json`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from compat_serve.models.errors import ModelLoadError

PoolingMode = Literal["cls", "mean", "lasttoken", "max"]

# sentence-transformers' Pooling config flag -> our mode. The others (weighted mean,
# mean-sqrt-len) are rare in released models and refused with a clear error.
_POOLING_FLAGS: dict[str, PoolingMode] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
}
_UNSUPPORTED_FLAGS = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
# The modules.json pipeline steps this package runs. Any other (Dense projections, Asym,
# CNN...) would change the vectors, so such a model is refused rather than served wrong.
_KNOWN_MODULES = (".Transformer", ".Pooling", ".Normalize")


@dataclass(frozen=True)
class SentenceTransformersConfig:
    """The parts of a sentence-transformers directory the embedding path uses. `pooling` is
    None when the directory has no pooling config (the caller picks the family default)."""

    pooling: PoolingMode | None = None
    normalize: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None
    has_modules: bool = False

    def prompt(self, *, query: bool) -> str:
        """The prompt a text gets: the "query" prompt for queries; for documents the
        "document"/"passage" prompt, else the default prompt, else none."""
        if query and "query" in self.prompts:
            return self.prompts["query"]
        if not query:
            for name in ("document", "passage"):
                if name in self.prompts:
                    return self.prompts[name]
        if self.default_prompt_name is not None:
            return self.prompts.get(self.default_prompt_name, "")
        return ""


def read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON: {exc}") from exc
    return data if isinstance(data, dict) else None


def read_modules(model_dir: Path) -> list[dict[str, Any]]:
    path = model_dir / "modules.json"
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON: {exc}") from exc
    return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []


def _module_dir(model_dir: Path, modules: list[dict[str, Any]], suffix: str) -> Path | None:
    for module in modules:
        if str(module.get("type", "")).endswith(suffix):
            return model_dir / str(module.get("path", ""))
    return None


def pooling_config_path(model_dir: Path) -> Path | None:
    """The Pooling module's config.json, from modules.json or the usual `1_Pooling`."""
    pooling_dir = _module_dir(model_dir, read_modules(model_dir), ".Pooling")
    for candidate in (pooling_dir, model_dir / "1_Pooling"):
        if candidate is not None and (candidate / "config.json").is_file():
            return candidate / "config.json"
    return None


def pooling_mode(config: dict[str, Any], origin: Path) -> PoolingMode:
    if isinstance(config.get("pooling_mode"), str):  # the newer single-key form
        name = config["pooling_mode"]
        flag = f"pooling_mode_{name}_token" if name == "cls" else f"pooling_mode_{name}"
        config = {flag: True, **({"pooling_mode_mean_tokens": True} if name == "mean" else {})}
    chosen = [mode for flag, mode in _POOLING_FLAGS.items() if config.get(flag)]
    unsupported = [flag for flag in _UNSUPPORTED_FLAGS if config.get(flag)]
    if unsupported or len(chosen) != 1:
        raise ModelLoadError(
            f"{origin}: unsupported pooling {unsupported or chosen or 'none'}; "
            "compat-serve pools by one of cls, mean, lasttoken, max"
        )
    return chosen[0]


def read_sentence_transformers(model_dir: Path) -> SentenceTransformersConfig:
    modules = read_modules(model_dir)
    for module in modules:
        kind = str(module.get("type", ""))
        if not kind.endswith(_KNOWN_MODULES):
            raise ModelLoadError(
                f"{model_dir}: the sentence-transformers module {kind or '?'} "
                f"({module.get('path', '')}) is not supported; compat-serve runs "
                "Transformer, Pooling and Normalize"
            )
    pooling: PoolingMode | None = None
    path = pooling_config_path(model_dir)
    if path is not None:
        pooling = pooling_mode(read_json(path) or {}, path)
    normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
    st = read_json(model_dir / "config_sentence_transformers.json") or {}
    prompts = st.get("prompts")
    default = st.get("default_prompt_name")
    bert = read_json(model_dir / "sentence_bert_config.json") or {}
    max_seq = bert.get("max_seq_length")
    return SentenceTransformersConfig(
        pooling=pooling,
        normalize=normalize,
        prompts={str(k): str(v) for k, v in prompts.items()} if isinstance(prompts, dict) else {},
        default_prompt_name=default if isinstance(default, str) else None,
        max_seq_length=int(max_seq) if isinstance(max_seq, int) and max_seq > 0 else None,
        has_modules=bool(modules),
    )
