"""The test files that cost the most, heaviest first: `make test` hands them to its two
pytest workers first (tests/conftest.py puts them at the front; the Makefile turns off
xdist's own order, which sends the files with the most tests first and so left the
heaviest one-test files, the fuzzer and the real clients, to the end, where one worker ran
them while the other sat idle). Longest first is the classic rule for a short finish.

Seconds are one file's junit time in a two-worker run (session 16, `--junitxml`);
regenerate with `python -m tests.heavy_files JUNIT.xml`. A file missing from the list
only runs later; a listed file that no longer exists is ignored.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter

HEAVY_FILES: tuple[str, ...] = (
    "tests/http/test_openapi_schemathesis.py",  # 93 s
    "tests/python/test_tool_grammars.py",  # 80 s
    "tests/python/test_prefix_cache.py",  # 67 s
    "tests/llamacpp/test_gemma_vs_llamacpp.py",  # 62 s
    "tests/python/test_distributed.py",  # 58 s
    "tests/python/test_batching.py",  # 58 s
    "tests/python/test_families.py",  # 56 s
    "tests/python/test_kv_quant_engine.py",  # 56 s
    "tests/http/test_multi_model.py",  # 54 s
    "tests/python/test_speculative.py",  # 49 s
    "tests/python/test_forced_calls_per_template.py",  # 48 s
    "tests/http/test_constrained_http.py",  # 46 s
    "tests/e2e/test_claude_code.py",  # 43 s
    "tests/http/test_two_pass_replay.py",  # 42 s
    "tests/python/test_vlm.py",  # 40 s
    "tests/http/test_openai_api.py",  # 37 s
    "tests/e2e/test_opencode.py",  # 35 s
    "tests/python/test_mtp_families.py",  # 32 s
    "tests/e2e/test_codex.py",  # 31 s
    "tests/python/test_mtp.py",  # 26 s
    "tests/python/test_resident_size.py",  # 26 s
    "tests/python/test_draft_model.py",  # 26 s
    "tests/http/test_tool_calls.py",  # 24 s
    "tests/e2e/test_graceful_shutdown.py",  # 23 s
    "tests/python/test_prefix_exact.py",  # 22 s
    "tests/http/test_responses_api.py",  # 22 s
    "tests/http/test_forced_calls_default_body.py",  # 21 s
    "tests/python/test_template_parity.py",  # 20 s
)


def heavy_first(nodeids: list[str]) -> list[int]:
    """The order (indices into `nodeids`) that puts the listed files first, heaviest
    first, each file's tests in their own order, then every other file as collected."""
    rank = {path: i for i, path in enumerate(HEAVY_FILES)}
    unlisted = len(HEAVY_FILES)
    return sorted(range(len(nodeids)), key=lambda i: rank.get(nodeids[i].split("::")[0], unlisted))


def seconds_per_file(junit: str) -> Counter[str]:
    """Each test file's summed junit time."""
    totals: Counter[str] = Counter()
    for case in ET.parse(junit).iter("testcase"):
        parts = (case.get("classname") or "").split(".")
        for end in range(len(parts), 0, -1):
            if parts[end - 1].startswith("test_"):
                totals["/".join(parts[:end]) + ".py"] += float(case.get("time") or 0)
                break
    return totals


if __name__ == "__main__":
    for path, seconds in seconds_per_file(sys.argv[1]).most_common(28):
        print(f'    "{path}",  # {seconds:.0f} s')
