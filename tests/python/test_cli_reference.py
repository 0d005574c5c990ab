"""The docs' CLI reference page is generated from the parsers and kept in step with them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from compat_serve.cli_reference import command_parsers, render_cli_reference
from compat_serve.serve_flags import build_serve_parser

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "cli.md"


def test_committed_page_is_up_to_date() -> None:
    assert PAGE.read_text(encoding="utf-8") == render_cli_reference(), (
        "docs/reference/cli.md is stale: run `make cli-docs` and commit it"
    )


def test_every_flag_of_help_is_on_the_page() -> None:
    """The flags as the real `compat-serve --help` prints them, each on the page."""
    help_text = subprocess.run(
        [sys.executable, "-m", "compat_serve.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    # The option lines: "  --model MODEL", "  -h, --help" (help text is indented deeper).
    flags = set(re.findall(r"(?:^ {2}|, )(--?[a-z][\w-]*)", help_text, re.MULTILINE))
    assert len(flags) >= 50, sorted(flags)
    assert {f for a in build_serve_parser()._actions for f in a.option_strings} >= flags
    page = PAGE.read_text(encoding="utf-8")
    missing = sorted(flag for flag in flags if f"`{flag}" not in page)
    assert missing == []


def test_every_subcommand_and_option_has_a_row() -> None:
    page = render_cli_reference()
    for title, parser in command_parsers():
        assert f"## `{title}`" in page
        for action in parser._actions:
            for flag in action.option_strings:
                assert f"`{flag}" in page, (title, flag)
    # Markup in help texts stays literal in the table.
    assert "&lt;think&gt;" not in page and "&lt;think>" in page
    assert "claude-\\*haiku\\*" in page
