"""Locate the project's shared test data (../shared beside the repo, or $COMPAT_SHARED_DIR).

Tests that need it fail when it is missing: it is part of every checkout and CI run.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path


def shared_dir() -> Path:
    override = os.environ.get("COMPAT_SHARED_DIR")
    path = Path(override) if override else Path(__file__).resolve().parents[1].parent / "shared"
    if not path.is_dir():
        raise FileNotFoundError(f"shared test data not found at {path} (set COMPAT_SHARED_DIR)")
    return path


def templates_dir() -> Path:
    return shared_dir() / "templates"


def manifest_rows() -> list[dict[str, str]]:
    with (templates_dir() / "MANIFEST.tsv").open(encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t"))
