"""GGUF architectures and how each maps onto an mlx-lm model class: one module per family
(config from metadata, llama.cpp tensor names -> mlx-lm names, fix-ups), picked by
`general.architecture`."""

from __future__ import annotations

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.gguf_families.common import Family, Hparams, permute_rows, unpermute_rows
from compat_serve.models.gguf_families.deepseek2 import DEEPSEEK2
from compat_serve.models.gguf_families.gemma import GEMMA2, GEMMA3
from compat_serve.models.gguf_families.glm4moe import GLM4MOE
from compat_serve.models.gguf_families.llama import LLAMA, MIXTRAL
from compat_serve.models.gguf_families.phi3 import PHI3
from compat_serve.models.gguf_families.qwen import QWEN2, QWEN3, QWEN3MOE
from compat_serve.models.gguf_metadata import GGUFMetadata

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Family",
    "Hparams",
    "family_for",
    "permute_rows",
    "unpermute_rows",
]

_BY_ARCHITECTURE: dict[str, Family] = {
    f.architecture: f
    for f in (LLAMA, QWEN2, QWEN3, QWEN3MOE, PHI3, GEMMA2, GEMMA3, DEEPSEEK2, GLM4MOE)
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_BY_ARCHITECTURE))


def family_for(meta: GGUFMetadata) -> Family:
    """The family of a GGUF; Mixtral is `llama` with experts."""
    arch = meta.architecture
    family = _BY_ARCHITECTURE.get(arch)
    if family is None:
        raise ModelLoadError(
            f"{meta.path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); "
            "serve the original weights as an MLX/HF model directory instead"
        )
    if family is LLAMA and (meta.get_int("llama.expert_count") or 0) > 0:
        return MIXTRAL
    return family
