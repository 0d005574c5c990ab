"""docs/development.md shows the package's layer order; the order that `make lint` checks is
written once, in pyproject.toml's import-linter contract (#46). The page must show that one."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _checked_layers() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    return [str(layer) for layer in layers]


def _documented_layers() -> list[str]:
    page = (REPO / "docs" / "development.md").read_text()
    section = page.split("### The package reads top-down", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.DOTALL)
    assert block is not None, "the layer order's text block is missing"
    return block.group(1).strip().splitlines()


def test_the_documented_layer_order_is_the_checked_one() -> None:
    assert _documented_layers() == _checked_layers()
