"""Marks for tests that need Linux-only facilities; on macOS each skips with its reason.

Every place the product or its tests depends on Linux is listed on the docs' platform page
(docs/platforms.md); these are the test side of that list. CI runs on Linux, where none of
them skips.
"""

from __future__ import annotations

import sys

import pytest

LINUX = sys.platform == "linux"

# The agent-client end-to-end tests run server and client in `unshare -n`.
needs_network_namespace = pytest.mark.skipif(
    not LINUX,
    reason="runs the client in a loopback-only Linux network namespace (unshare -n); "
    "macOS has no network namespaces",
)
# Memory-growth tests read the process's current resident size from /proc.
needs_proc_rss = pytest.mark.skipif(
    not LINUX, reason="reads the current resident memory from /proc (Linux only)"
)
