"""tests/heavy_files.py: the order `make test` hands files to its workers."""

from __future__ import annotations

from pathlib import Path

from tests.heavy_files import HEAVY_FILES, heavy_first

REPO = Path(__file__).resolve().parents[2]


def test_every_listed_file_exists_once() -> None:
    missing = [path for path in HEAVY_FILES if not (REPO / path).is_file()]
    assert not missing, f"tests/heavy_files.py lists files that are gone: {missing}"
    assert len(set(HEAVY_FILES)) == len(HEAVY_FILES)


def test_listed_files_go_first_heaviest_first_each_in_its_own_order() -> None:
    light, heavy, heavier = "tests/a/test_light.py", HEAVY_FILES[1], HEAVY_FILES[0]
    ids = [f"{light}::t1", f"{heavy}::t1", f"{light}::t2", f"{heavier}::t1", f"{heavy}::t2"]
    ordered = [ids[i] for i in heavy_first(ids)]
    assert ordered == [
        f"{heavier}::t1",
        f"{heavy}::t1",
        f"{heavy}::t2",
        f"{light}::t1",
        f"{light}::t2",
    ]
