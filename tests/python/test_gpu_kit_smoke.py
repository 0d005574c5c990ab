"""`benches/gpu/run.py --smoke`: the GPU kit's benchmark on tiny shapes on the CPU, so the
code a lent device runs cannot rot between lent sessions (#35). One subprocess run (~15 s),
then checks of what it measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu-smoke")
    # A budget well above the ~10 s the sections take, so a loaded CI machine still runs
    # them all; the kit's own default (25 s) is what the device-time guard is about.
    command = [sys.executable, "benches/gpu/run.py", "--smoke", "--out", str(out)]
    done = subprocess.run(
        [*command, "--budget-s", "120"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document: dict[str, Any] = json.loads((out / "gpu-bench.json").read_text())
    document["markdown"] = (out / "gpu-bench.md").read_text()
    return document


def records(document: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    return [r for r in document["records"] if r["table"].startswith(prefix)]


def test_every_section_ran_on_the_cpu_backend(smoke: dict[str, Any]) -> None:
    assert smoke["header"]["compute_backend()"] == "cpu"
    assert smoke["skipped"] == []
    tables = set(smoke["tables"])
    for model in ("tiny Llama-3.1-8B-shaped 4-bit", "tiny Llama-3.1-8B-shaped bf16",
                  "tiny Qwen3-30B-A3B-shaped 4-bit"):  # fmt: skip
        assert f"decode:{model}" in tables
    for section in ("greedy", "ttft:", "kv:", "spec:", "mtp:"):
        assert any(t.startswith(section) for t in tables), (section, tables)
    assert "| streams | compat-serve | mlx_lm BatchGenerator |" in smoke["markdown"]


def test_greedy_tokens_match_mlx_lm_up_to_a_near_tie(smoke: dict[str, Any]) -> None:
    rows = records(smoke, "greedy")
    assert rows
    for row in rows:
        assert row["ok"], row
        assert row["length"] == 8


def test_both_sides_decode_at_every_width_for_each_model(smoke: dict[str, Any]) -> None:
    rows = records(smoke, "decode:")
    assert {(r["model"], r["streams"]) for r in rows} == {
        (m, w)
        for m in ("tiny Llama-3.1-8B-shaped 4-bit", "tiny Llama-3.1-8B-shaped bf16",
                  "tiny Qwen3-30B-A3B-shaped 4-bit")
        for w in (1, 2)
    }  # fmt: skip
    for row in rows:
        assert min(row["ours"]) > 0 and min(row["mlx_lm"]) > 0, row


def test_the_warm_request_reads_the_shared_prefix_from_our_cache(smoke: dict[str, Any]) -> None:
    (row,) = records(smoke, "ttft:")
    assert row["prefix"] == 64
    assert row["cached"] == 64  # the whole prefix (4 blocks of 16), none of the new tail
    assert row["ours_cold"] > 0 and row["ours_warm"] > 0 and row["mlx_lm_warm"] > 0


def test_each_kv_format_and_speculation_mode_decodes(smoke: dict[str, Any]) -> None:
    kv = records(smoke, "kv:")
    assert [r["kv"] for r in kv] == ["model dtype", "--kv-bits 8", "--kv-bits 4"]
    assert all(min(r["rates"]) > 0 for r in kv)
    spec = records(smoke, "spec:")
    assert {(r["workload"], r["streams"]) for r in spec} == {
        (w, s) for w in ("copy-heavy", "free") for s in (1, 2)
    }
    assert all(min(r["off"]) > 0 and min(r["ngram"]) > 0 for r in spec)


def test_mtp_drafts_every_step_and_both_sides_decode(smoke: dict[str, Any]) -> None:
    rows = records(smoke, "mtp:")
    assert [r["streams"] for r in rows] == [1, 2]
    for row in rows:
        assert min(row["off"]) > 0 and min(row["mtp"]) > 0, row
        assert row["drafted"] > 0, row  # cost-aware choice off: every step drafts
