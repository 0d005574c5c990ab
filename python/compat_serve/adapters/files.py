"""LoRA adapter files, read into one neutral form: mlx-lm's and PEFT's.

mlx-lm (`mlx_lm.lora`) writes `adapter_config.json` (`fine_tune_type`, `num_layers`,
`lora_parameters` {rank, scale, dropout, keys?}) and `adapters.safetensors` with
`model.layers.N.<path>.lora_a` `[in, r]` and `.lora_b` `[r, out]`; the delta it adds is
`scale * (x @ lora_a) @ lora_b`. PEFT writes `adapter_config.json` (`r`, `lora_alpha`,
`target_modules`, `use_dora`, `use_rslora`) and `adapter_model.safetensors` with
`base_model.model.model.layers.N.<path>.lora_A.weight` `[r, in]` and `.lora_B.weight`
`[out, r]`; its scale is `lora_alpha / r` (`/ sqrt(r)` with rsLoRA).

Both become `AdapterWeights`: per target linear (named as in the base model's own
parameter tree, `model.layers.N.self_attn.q_proj`) the matrices in mlx-lm's orientation
`a` `[in, r]`, `b` `[r, out]`, as numpy arrays (reading a file runs no MLX: the engine
thread turns them into MLX arrays when the adapter is added, engine/host.py). Whether
the shapes fit a model is checked there (`AdapterBank.add`).

Every refusal is an `AdapterError`: one line naming the file and the reason.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MLX_CONFIG = "adapter_config.json"
MLX_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_PEFT_A, _PEFT_B = ".lora_A.weight", ".lora_B.weight"
_MLX_A, _MLX_B = ".lora_a", ".lora_b"


class AdapterError(ValueError):
    """An adapter that cannot be served: unreadable, unsupported or not for this model."""


@dataclass(frozen=True)
class AdapterFiles:
    """What an adapter is, for listings and the cache salt."""

    name: str
    path: str
    format: str  # "mlx-lm" | "peft"
    rank: int
    scale: float
    # Module names relative to a decoder layer ("self_attn.q_proj", "mlp.down_proj").
    target_modules: tuple[str, ...]
    # sha256 of the config and weight files: two adapters share cached KV only when
    # their files are identical.
    fingerprint: str
    # The base model the config names (mlx-lm's "model", PEFT's
    # "base_model_name_or_path"), if any.
    base_model: str | None = None


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter's matrices: `modules[path] = (a [in, r], b [r, out])`, unscaled."""

    files: AdapterFiles
    modules: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def read_adapter(path: str | Path, name: str | None = None) -> AdapterWeights:
    """Read an mlx-lm or PEFT adapter directory (or its `adapter_config.json`)."""
    folder = Path(path).expanduser()
    if folder.name == MLX_CONFIG:
        folder = folder.parent
    config_path = folder / MLX_CONFIG
    if not folder.is_dir():
        raise AdapterError(f"{folder}: no such adapter directory")
    if not config_path.is_file():
        raise AdapterError(f"{config_path}: missing (an adapter directory needs its config)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{config_path}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path}: not a JSON object")
    label = name or folder.name
    if "lora_parameters" in config or "fine_tune_type" in config:
        return _read_mlx(folder, config_path, config, label)
    if "peft_type" in config or "lora_alpha" in config or "r" in config:
        return _read_peft(folder, config_path, config, label)
    raise AdapterError(
        f"{config_path}: neither an mlx-lm adapter (lora_parameters) nor a PEFT one (r, lora_alpha)"
    )


def _read_mlx(folder: Path, config_path: Path, config: dict[str, Any], name: str) -> AdapterWeights:
    kind = config.get("fine_tune_type", "lora")
    if kind == "dora":
        raise AdapterError(
            f"{config_path}: DoRA adapters are not supported (their weight-norm scaling "
            "cannot be applied per request without merging); train with fine_tune_type lora"
        )
    if kind != "lora":
        raise AdapterError(f"{config_path}: fine_tune_type {kind!r} is not a LoRA adapter")
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise AdapterError(f"{config_path}: lora_parameters missing or not an object")
    try:
        rank = int(params["rank"])
        scale = float(params["scale"])
    except (KeyError, TypeError, ValueError):
        raise AdapterError(
            f"{config_path}: lora_parameters needs a numeric rank and scale"
        ) from None
    weights_path = folder / MLX_WEIGHTS
    tensors = _load_safetensors(weights_path)
    pairs = _pairs(weights_path, tensors, "", _MLX_A, _MLX_B)
    modules = {}
    for module, (a, b) in pairs.items():
        _check_pair(weights_path, module, a, b, rank, a_rows_are_rank=False)
        modules[module] = (a, b)
    files = AdapterFiles(
        name=name,
        path=str(folder),
        format="mlx-lm",
        rank=rank,
        scale=scale,
        target_modules=_relative_targets(modules),
        fingerprint=_fingerprint([config_path, weights_path]),
        base_model=_str_or_none(config.get("model")),
    )
    return AdapterWeights(files, modules)


def _read_peft(
    folder: Path, config_path: Path, config: dict[str, Any], name: str
) -> AdapterWeights:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"{config_path}: peft_type {peft_type!r} is not LoRA")
    if config.get("use_dora"):
        raise AdapterError(
            f"{config_path}: DoRA adapters (use_dora) are not supported (their weight-norm "
            "scaling cannot be applied per request without merging)"
        )
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise AdapterError(f"{config_path}: per-module {key} is not supported")
    if config.get("modules_to_save"):
        raise AdapterError(
            f"{config_path}: modules_to_save (fully trained layers) is not supported: "
            "only the LoRA matrices are applied"
        )
    if config.get("bias", "none") != "none":
        raise AdapterError(
            f"{config_path}: trained biases (bias={config['bias']!r}) are not supported"
        )
    try:
        rank = int(config["r"])
        alpha = float(config.get("lora_alpha", rank))
    except (KeyError, TypeError, ValueError):
        raise AdapterError(f"{config_path}: needs a numeric r (and lora_alpha)") from None
    if rank <= 0:
        raise AdapterError(f"{config_path}: r must be positive, not {rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_path = folder / PEFT_WEIGHTS
    tensors = _load_safetensors(weights_path)
    pairs = _pairs(weights_path, tensors, _PEFT_PREFIX, _PEFT_A, _PEFT_B)
    modules = {}
    for module, (a_t, b_t) in pairs.items():
        _check_pair(weights_path, module, a_t, b_t, rank, a_rows_are_rank=True)
        modules[module] = (np.ascontiguousarray(a_t.T), np.ascontiguousarray(b_t.T))
    targets = _relative_targets(modules)
    _check_peft_targets(config_path, config.get("target_modules"), targets)
    files = AdapterFiles(
        name=name,
        path=str(folder),
        format="peft",
        rank=rank,
        scale=scale,
        target_modules=targets,
        fingerprint=_fingerprint([config_path, weights_path]),
        base_model=_str_or_none(config.get("base_model_name_or_path")),
    )
    return AdapterWeights(files, modules)


_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


def _load_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The file's tensors as float numpy arrays (bfloat16 widened to float32, exactly).
    Parsed here rather than with `mx.load` so that reading runs no MLX off the engine
    thread, and rather than `safetensors.numpy`, which cannot read bfloat16."""
    if not path.is_file():
        raise AdapterError(f"{path}: missing (the adapter's weights)")
    try:
        data = path.read_bytes()
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + size])
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        body = memoryview(data)[8 + size :]
        tensors = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            kind = _SAFETENSORS_DTYPES.get(info["dtype"])
            if kind is None:
                raise ValueError(f"tensor {key!r} has dtype {info['dtype']}, not a float type")
            begin, end = info["data_offsets"]
            flat = np.frombuffer(body[begin:end], dtype=kind)
            if info["dtype"] == "BF16":
                flat = (flat.astype(np.uint32) << 16).view(np.float32)
            tensors[key] = flat.reshape(info["shape"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AdapterError(f"{path}: not a readable safetensors file ({exc})") from None
    return tensors


def _pairs(
    path: Path, tensors: dict[str, np.ndarray], prefix: str, a_suffix: str, b_suffix: str
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Group `<prefix><module><suffix>` tensors into (a, b) per module; anything else
    (embeddings' lora_embedding_A, DoRA magnitudes, trained norms) is refused."""
    a: dict[str, np.ndarray] = {}
    b: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        if key.startswith(prefix) and key.endswith(a_suffix):
            a[key[len(prefix) : -len(a_suffix)]] = value
        elif key.startswith(prefix) and key.endswith(b_suffix):
            b[key[len(prefix) : -len(b_suffix)]] = value
        else:
            raise AdapterError(f"{path}: tensor {key!r} is not a LoRA matrix this server applies")
    if not a:
        raise AdapterError(f"{path}: holds no LoRA matrices")
    unpaired = sorted(set(a) ^ set(b))
    if unpaired:
        raise AdapterError(f"{path}: {unpaired[0]} has only one of its two LoRA matrices")
    return {module: (a[module], b[module]) for module in sorted(a)}


def _check_pair(
    path: Path, module: str, a: np.ndarray, b: np.ndarray, rank: int, *, a_rows_are_rank: bool
) -> None:
    if a.ndim != 2 or b.ndim != 2:
        raise AdapterError(
            f"{path}: {module}: LoRA matrices must be 2-D, not {a.shape} and {b.shape}"
        )
    a_rank = a.shape[0] if a_rows_are_rank else a.shape[1]
    b_rank = b.shape[1] if a_rows_are_rank else b.shape[0]
    if a_rank != rank or b_rank != rank:
        raise AdapterError(
            f"{path}: {module}: LoRA matrices {a.shape} and {b.shape} do not have the "
            f"config's rank {rank}"
        )
    if not np.issubdtype(a.dtype, np.floating) or not np.issubdtype(b.dtype, np.floating):
        raise AdapterError(f"{path}: {module}: LoRA matrices must be floating point")


def _relative_targets(modules: dict[str, Any]) -> tuple[str, ...]:
    """`model.layers.3.self_attn.q_proj` → `self_attn.q_proj`, deduplicated."""
    out = set()
    for module in modules:
        parts = module.split(".")
        if "layers" in parts:
            at = parts.index("layers")
            out.add(".".join(parts[at + 2 :]) if len(parts) > at + 2 else module)
        else:
            out.add(module)
    return tuple(sorted(out))


def _check_peft_targets(config_path: Path, declared: object, found: tuple[str, ...]) -> None:
    """The matrices present must be of modules the config's target_modules names (a
    list of names or suffixes; a regex string or "all-linear" is taken as given)."""
    if not isinstance(declared, list):
        return
    names = [str(item) for item in declared]
    for target in found:
        if not any(target == n or target.endswith("." + n) for n in names):
            raise AdapterError(
                f"{config_path}: weights for {target}, which target_modules {names} does not name"
            )


def _fingerprint(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in paths:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
