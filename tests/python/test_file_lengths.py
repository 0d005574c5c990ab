"""tools/file_lengths.py, the `make lint` check that no package or crate source file is over
600 lines (#46): it counts the package and the crates, and leaves test modules aside."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "file_lengths.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("file_lengths", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path: Path, lines: int, head: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = head + "".join(f"// {i}\n" for i in range(lines - head.count("\n")))
    path.write_text(body)


def _tree(tmp_path: Path) -> Path:
    """A repository shaped like ours: the package, a crate with a test module and a
    submodule, and a tests/ tree that is never counted."""
    _write(tmp_path / "python/compat_serve/__init__.py", 10)
    _write(tmp_path / "python/compat_serve/engine/step.py", 600)
    _write(tmp_path / "tests/python/test_long.py", 900)
    _write(
        tmp_path / "rust/core/src/scheduler.rs",
        40,
        "mod plan;\n#[cfg(test)]\nmod tests;\n",
    )
    _write(tmp_path / "rust/core/src/scheduler/tests.rs", 900)
    _write(tmp_path / "rust/core/src/scheduler/plan.rs", 100)
    _write(tmp_path / "rust/core/src/lib.rs", 5, "mod scheduler;\n")
    (tmp_path / "benches").mkdir()
    return tmp_path


def test_a_tree_at_the_limit_passes(tmp_path: Path) -> None:
    lengths = _load()
    assert lengths.too_long(_tree(tmp_path), 600) == []


def test_a_package_file_one_line_over_fails(tmp_path: Path) -> None:
    lengths = _load()
    root = _tree(tmp_path)
    _write(root / "python/compat_serve/engine/step.py", 601)
    assert lengths.too_long(root, 600) == [(Path("python/compat_serve/engine/step.py"), 601)]


def test_the_dashboards_script_counts_as_package_source(tmp_path: Path) -> None:
    lengths = _load()
    root = _tree(tmp_path)
    _write(root / "python/compat_serve/server/dashboard/static/dashboard.js", 631)
    _write(root / "python/compat_serve/server/dashboard/static/notes.txt", 900)
    assert lengths.too_long(root, 600) == [
        (Path("python/compat_serve/server/dashboard/static/dashboard.js"), 631)
    ]


def test_a_crate_file_over_fails_but_its_test_module_does_not(tmp_path: Path) -> None:
    lengths = _load()
    root = _tree(tmp_path)
    _write(root / "rust/core/src/scheduler/plan.rs", 700)
    assert lengths.too_long(root, 600) == [(Path("rust/core/src/scheduler/plan.rs"), 700)]
    assert lengths.is_rust_test_module(root / "rust/core/src/scheduler/tests.rs")
    assert not lengths.is_rust_test_module(root / "rust/core/src/scheduler/plan.rs")


def test_the_command_names_each_offender_and_exits_nonzero(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    _write(root / "python/compat_serve/engine/step.py", 650)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 1
    assert "python/compat_serve/engine/step.py: 650 lines" in done.stdout
    _write(root / "python/compat_serve/engine/step.py", 20)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout
