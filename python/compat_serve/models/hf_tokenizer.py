"""Tokenizer and chat template of an MLX/HF model directory (`tokenizer.json` & friends)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.tokenizer import Tokenizer

__all__ = ["HFTokenizerInfo", "load_hf_tokenizer", "read_chat_template", "read_json"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HFTokenizerInfo:
    tokenizer: Tokenizer
    chat_template: str | None
    tokenizer_config: dict[str, Any]


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _template_text(value: Any) -> str | None:
    """`chat_template` is a string, or a list of {"name", "template"} (pick "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {
            str(t.get("name")): str(t.get("template"))
            for t in value
            if isinstance(t, dict) and isinstance(t.get("template"), str)
        }
        return named.get("default") or next(iter(named.values()), None)
    return None


def read_chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The directory's chat template: chat_template.jinja, then .json, then tokenizer_config."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    as_json = read_json(model_dir / "chat_template.json")
    if (template := _template_text(as_json.get("chat_template"))) is not None:
        return template
    return _template_text(tokenizer_config.get("chat_template"))


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _flag(value: Any, default: bool) -> bool:
    return value if isinstance(value, bool) else default


def _post_processor_adds(
    backend: BackendTokenizer, bos: str | None, eos: str | None
) -> tuple[bool, bool]:
    """Whether tokenizer.json's post-processor puts BOS in front / EOS behind a text."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    bos_id = backend.token_to_id(bos) if bos else None
    eos_id = backend.token_to_id(eos) if eos else None
    adds_bos = bos_id is not None and len(full) > len(plain) and full[0] == bos_id
    adds_eos = eos_id is not None and len(full) > len(plain) and full[-1] == eos_id
    return adds_bos, adds_eos


def load_hf_tokenizer(model_dir: Path, config: dict[str, Any] | None = None) -> HFTokenizerInfo:
    """Build the adapter from tokenizer.json + tokenizer_config.json (+ generation_config)."""
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(
            f"{model_dir}: no tokenizer.json (compat-serve needs a 'fast' tokenizer file; "
            "re-save the tokenizer with transformers to create it)"
        )
    try:
        backend = BackendTokenizer.from_file(str(tokenizer_file))
    except Exception as exc:
        raise ModelLoadError(f"cannot load {tokenizer_file}: {exc}") from exc
    tok_config = read_json(model_dir / "tokenizer_config.json")
    special_map = read_json(model_dir / "special_tokens_map.json")
    gen_config = read_json(model_dir / "generation_config.json")
    config = config if config is not None else read_json(model_dir / "config.json")
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def special(name: str) -> str | None:
        return _token_text(tok_config.get(name)) or _token_text(special_map.get(name))

    extra_eos: list[int] = []
    for source in (gen_config, config, text_config or {}):
        for tid in _ids(source.get("eos_token_id")):
            if tid not in extra_eos:
                extra_eos.append(tid)
    chat_template = read_chat_template(model_dir, tok_config)
    bos, eos = special("bos_token"), special("eos_token")
    added_bos, added_eos = _post_processor_adds(backend, bos, eos)
    tokenizer = Tokenizer(
        backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=special("pad_token"),
        unk_token=special("unk_token"),
        extra_eos_token_ids=extra_eos,
        # tokenizer_config.json's flags win (as transformers' Llama/Gemma tokenizers rebuild
        # the post-processor from them); without them, what tokenizer.json's adds.
        add_bos_token=_flag(tok_config.get("add_bos_token"), added_bos),
        add_eos_token=_flag(tok_config.get("add_eos_token"), added_eos),
        chat_template=chat_template,
    )
    if not tokenizer.eos_token_ids:
        logger.warning("%s: no EOS token found; generation stops only at max_tokens", model_dir)
    return HFTokenizerInfo(
        tokenizer=tokenizer, chat_template=chat_template, tokenizer_config=tok_config
    )
