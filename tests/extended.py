"""The extended run: slower second views of what `make test` already checks, kept out of
CI's time budget and run by `make test-extended` (COMPAT_SERVE_TEST_EXTENDED=1).

A test marked `extended` is deselected unless the variable is set (tests/conftest.py); a
test that samples a set in CI (one chat template per tool format, say) takes the whole
set when `EXTENDED` is true. Each use says beside it what CI keeps of it.
"""

from __future__ import annotations

import os

__all__ = ["EXTENDED", "EXTENDED_ENV"]

EXTENDED_ENV = "COMPAT_SERVE_TEST_EXTENDED"
EXTENDED = os.environ.get(EXTENDED_ENV) == "1"
