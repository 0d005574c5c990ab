"""What a loaded model holds in memory, from its files alone: its weights under the weight
plan (weight_estimate.py) plus its tokenizer. This is the one figure the memory budget,
`/v1/status` `resident_bytes` and the estimate before a load share; a load measures the
same thing (`held_bytes`). The KV and prefix-cache budgets are limits the engine fills as
requests come, not memory a model holds when it loads: they are reported as limits.

The tokenizer: a `tokenizers` pipeline takes about 320 bytes per vocabulary entry for
byte-level BPE (SmolLM2: 49,152 entries, 15 MiB measured) and 385 for SentencePiece
(Gemma 3: 262,144 entries, 96 MiB measured), VmRSS after `malloc_trim`. A 262k vocabulary
is a third of a quantized 270M model, so it is counted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Final

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.weight_estimate import estimate_weight_bytes
from compat_serve.models.weights import Backend

__all__ = [
    "TOKENIZER_BYTES_PER_ENTRY",
    "estimate_resident_bytes",
    "held_bytes",
    "tokenizer_bytes",
    "vocab_entries",
]

TOKENIZER_BYTES_PER_ENTRY: Final = 350


def tokenizer_bytes(vocab_size: int) -> int:
    return int(vocab_size) * TOKENIZER_BYTES_PER_ENTRY


def vocab_entries(path: str) -> int:
    """The vocabulary size a model's files state: a GGUF's embedding rows, a directory's
    config.json `vocab_size` (or its text config's); 0 when they do not say."""
    if os.path.isdir(path):
        try:
            config: Any = json.loads((Path(path) / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {path}/config.json: {exc}") from exc
        for source in (config, config.get("text_config") or {}):
            if isinstance(source, dict) and isinstance(source.get("vocab_size"), int):
                return int(source["vocab_size"])
        return 0
    from compat_serve.models.gguf_header import read_tensor_table

    for tensor in read_tensor_table(path):
        if tensor.name == "token_embd.weight":
            return max(tensor.shape)
    return 0


def estimate_resident_bytes(
    path: str | None, dtype: str | None = "auto", backend: Backend | None = None
) -> int:
    """What the model at `path` (None: the embedded model) will hold once loaded with
    `dtype`: its weights under the plan and its tokenizer."""
    if path is None:
        from compat_serve.models.embedded import embedded_model_path

        path = str(embedded_model_path())
    weights = estimate_weight_bytes(path, dtype, backend)
    return weights + tokenizer_bytes(vocab_entries(path))


def held_bytes(weights: int, vocab_size: int) -> int:
    """What a loaded model holds: its weights as measured and its tokenizer."""
    return int(weights) + tokenizer_bytes(vocab_size)
