"""Fail when a source file of the package (its Python and the dashboard's files) or of the
Rust crates is over the line limit (#46).

A file that long usually holds more than one job; split it by job, not by squeezing lines.
Test modules are exempt: the tests/ tree, and Rust files their parent declares under
`#[cfg(test)]`. `make lint` runs this next to import-linter, which keeps the imports one-way.

    python tools/file_lengths.py [--max-lines N] [ROOT]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

MAX_LINES = 600
PYTHON_PACKAGE = "python/compat_serve"
# The package's code and the dashboard's page, script and style it serves.
PACKAGE_SUFFIXES = frozenset({".py", ".pyi", ".js", ".css", ".html"})
RUST_CRATE_ROOTS = ("rust", "benches")


def line_count(path: Path) -> int:
    with path.open("rb") as handle:
        return sum(1 for _ in handle)


def _parent_module_files(path: Path) -> list[Path]:
    """The files that may declare `mod <path.stem>;`: `a/b.rs` is declared in `a.rs`,
    `a/mod.rs`, or, at a crate's top, `lib.rs`/`main.rs` beside it."""
    folder = path.parent
    candidates = [folder / "mod.rs", folder / "lib.rs", folder / "main.rs"]
    candidates.append(folder.with_suffix(".rs"))
    return [c for c in candidates if c.is_file() and c != path]


def is_rust_test_module(path: Path) -> bool:
    """True when a parent declares this file's module right after `#[cfg(test)]`."""
    name = path.parent.name if path.name == "mod.rs" else path.stem
    if path.name == "mod.rs":
        path = path.parent
    declaration = re.compile(
        r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+"
        + re.escape(name)
        + r"\s*;"
    )
    return any(declaration.search(p.read_text()) for p in _parent_module_files(path))


def source_files(root: Path) -> list[Path]:
    package = root / PYTHON_PACKAGE
    files = sorted(p for p in package.rglob("*") if p.suffix in PACKAGE_SUFFIXES)
    for crates in RUST_CRATE_ROOTS:
        for path in sorted((root / crates).rglob("*.rs")):
            if "target" in path.relative_to(root).parts or is_rust_test_module(path):
                continue
            files.append(path)
    return files


def too_long(root: Path, max_lines: int) -> list[tuple[Path, int]]:
    counted = ((path, line_count(path)) for path in source_files(root))
    return [(path.relative_to(root), n) for path, n in counted if n > max_lines]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Fail on a package or crate source file over the line limit (#46)."
    )
    parser.add_argument("root", nargs="?", default=Path(__file__).resolve().parents[1], type=Path)
    parser.add_argument("--max-lines", type=int, default=MAX_LINES)
    ns = parser.parse_args(argv)
    offenders = too_long(ns.root, ns.max_lines)
    for path, n in offenders:
        print(f"{path}: {n} lines (the limit is {ns.max_lines}): split it by job")
    if offenders:
        return 1
    print(f"file lengths: {len(source_files(ns.root))} source files, none over {ns.max_lines}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
