"""compat-serve: a local MLX LLM server speaking the Anthropic Messages API and the OpenAI API."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("compat-serve")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0"

__all__ = ["__version__"]
