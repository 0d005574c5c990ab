"""`load_model(spec)`: the one entry point the CLI and tests use to get a `LoadedModel`.

- `None`            -> the embedded default (SmolLM2-135M-Instruct Q4_1 GGUF, see embedded.py)
- `*.gguf` file     -> GGUF loader (models/gguf_families/: llama, qwen, phi3, gemma, deepseek)
- directory         -> MLX/HF model directory via mlx-lm
- `org/name`        -> Hugging Face hub snapshot (needs the network once), then as a directory
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.load_steps import LoadSteps, host, run_inline
from compat_serve.models.types import LoadedModel

__all__ = ["load_model", "load_model_steps", "read_chat_template_file"]

logger = logging.getLogger(__name__)


def read_chat_template_file(path: str) -> str:
    """A `--chat-template` file: a Jinja template, or JSON with a `chat_template` string."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelLoadError(f"cannot read chat template {path}: {exc}") from exc
    if file.suffix == ".json":
        import json

        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}: invalid JSON: {exc}") from exc
        template = data.get("chat_template") if isinstance(data, dict) else None
        if not isinstance(template, str):
            raise ModelLoadError(f"{path}: no 'chat_template' string in the JSON file")
        return template
    if not text.strip():
        raise ModelLoadError(f"chat template {path} is empty")
    return text


def load_model(
    spec: str | None,
    *,
    chat_template_path: str | None = None,
    dtype: str | None = None,
    memory_budget: int | None = None,
) -> LoadedModel:
    """Load the model `spec` names (see the module docstring).

    `dtype`: None/"auto" (dense float32 on CPU unless that would not fit `memory_budget`,
    or half the machine's memory without one; as stored on GPU), "float32", "float16",
    "bfloat16" or "quantized". `chat_template_path` replaces the model's own template.
    """
    return run_inline(
        load_model_steps(
            spec, chat_template_path=chat_template_path, dtype=dtype, memory_budget=memory_budget
        )
    )


def load_model_steps(
    spec: str | None,
    *,
    chat_template_path: str | None = None,
    dtype: str | None = None,
    memory_budget: int | None = None,
) -> LoadSteps[LoadedModel]:
    """`load_model` as load steps (models/load_steps.py): what a server of several models
    runs with every MLX evaluation on its engine thread."""
    from compat_serve.models.auto_dtype import choose_auto_dtype
    from compat_serve.models.cpu_attention import install_split_attention
    from compat_serve.models.cpu_decode_block import install_fused_decode_blocks
    from compat_serve.models.cpu_layout import store_input_major
    from compat_serve.models.cpu_linear import install_skinny_linears, kernel_available
    from compat_serve.models.device_memory import collect_memory
    from compat_serve.models.weights import compute_backend, resolve_dtype

    # Check the cheap things first: a typo should fail before a multi-second load.
    plan = resolve_dtype(dtype, warn=False)
    override = read_chat_template_file(chat_template_path) if chat_template_path else None
    choice = choose_auto_dtype(spec or None, dtype, memory_budget)
    if choice.note is not None:
        logger.warning("%s: %s", spec or "embedded model", choice.note)
        plan = resolve_dtype(choice.dtype, warn=False)
    loaded = yield from _dispatch(spec, choice.dtype)
    loaded.extra["dtype_requested"] = "auto" if choice.note else plan.requested
    if choice.note is not None:
        loaded.extra["dtype_auto"] = choice.note
    # Give back what the load freed (the GGUF metadata's and the dequantization's
    # temporaries: 170 MiB for Gemma 3 270M), so the process holds what the model holds.
    collect_memory()
    # The CPU fast paths rewrite mlx-lm modules; a vision-language model runs as mlx-vlm
    # wrote it, and `--dtype quantized` keeps the users' path (weights as stored, stock
    # modules, MLX's kernels) so it can be tested on any machine. They read the evaluated
    # weights (and may re-lay them): one host slice.
    fast_paths = (
        compute_backend() == "cpu"
        and not plan.keep_quantized
        and loaded.extra.get("vision") is None
    )
    if fast_paths:
        yield host("CPU fast paths")
        kernel = kernel_available()
        if kernel:
            routed = install_skinny_linears(loaded.model)
            loaded.extra["weight_layout"] = f"row-major, decode on the skinny kernel ({routed})"
            fused = install_fused_decode_blocks(loaded.model)
            if fused:
                loaded.extra["decode_blocks"] = f"{fused} blocks fused (norms, RoPE in Rust)"
        else:
            relaid = store_input_major(loaded.model)
            loaded.extra["weight_layout"] = f"input-major ({relaid} dense weights)"
        if (os.cpu_count() or 1) > 1 and install_split_attention(
            loaded.model, decode_kernel=kernel
        ):
            loaded.extra["attention"] = "prefill rows split over 2 CPU streams" + (
                "; decode on the attention kernel" if kernel else ""
            )
    if override is not None and chat_template_path is not None:
        loaded = replace_chat_template(loaded, override, chat_template_path)
    return loaded


def replace_chat_template(loaded: LoadedModel, template: str, origin: str) -> LoadedModel:
    """A copy of `loaded` using `template` (end-of-turn ids follow the new template)."""
    logger.info("chat template replaced by %s", origin)
    return dataclasses.replace(
        loaded,
        chat_template=template,
        tokenizer=loaded.tokenizer.with_chat_template(template),
        extra={**loaded.extra, "chat_template_source": origin},
    )


def _dispatch(spec: str | None, dtype: str | None) -> LoadSteps[LoadedModel]:
    if spec is None or spec == "":
        from compat_serve.models.embedded import (
            EMBEDDED_FILE,
            EMBEDDED_SAMPLING,
            EMBEDDED_SAMPLING_SOURCE,
            embedded_model_path,
        )
        from compat_serve.models.gguf import load_gguf_steps

        path = embedded_model_path()
        embedded = yield from load_gguf_steps(
            str(path), dtype=dtype, source=f"embedded:{EMBEDDED_FILE}"
        )
        return dataclasses.replace(
            embedded,
            fallback_sampling=dict(EMBEDDED_SAMPLING),
            fallback_sampling_source=EMBEDDED_SAMPLING_SOURCE,
        )
    path = Path(spec).expanduser()
    if path.is_file():
        from compat_serve.models.gguf_header import is_gguf_file

        if is_gguf_file(path):
            from compat_serve.models.gguf import load_gguf_steps

            loaded = yield from load_gguf_steps(str(path), dtype=dtype, source=str(path))
            return loaded
        raise ModelLoadError(
            f"{spec}: not a .gguf file; --model takes a .gguf file, a model directory "
            "or a Hugging Face hub id"
        )
    if path.is_dir():
        from compat_serve.models.hf_dir import load_hf_dir_steps

        loaded = yield from load_hf_dir_steps(path, dtype=dtype, source=str(path))
        return loaded
    if spec.lower().endswith(".gguf"):
        raise ModelLoadError(f"GGUF file not found: {spec}")
    from compat_serve.models.hf_dir import load_hub_model_steps, looks_like_hub_id

    if looks_like_hub_id(spec):
        loaded = yield from load_hub_model_steps(spec, dtype=dtype)
        return loaded
    raise ModelLoadError(
        f"{spec}: no such file or directory, and not a Hugging Face hub id (org/name)"
    )
