"""docs/cli.md is the parser's own help, so it cannot drift from the commands."""

from __future__ import annotations

from cli.docs import render
from cli.main import build_parser, main
from tests.conftest import REPO

DOC = REPO / "docs" / "cli.md"


def test_cli_reference_is_current():
    assert DOC.read_text() == render(), "regenerate with: python -m cli.docs > docs/cli.md"


def test_every_subcommand_has_help_and_runs_help(capsys):
    parser = build_parser()
    text = render()
    for action in parser._actions:
        if getattr(action, "choices", None) and isinstance(action.choices, dict):
            for name in action.choices:
                assert f"## `local-damage {name}" in text
    assert main([]) == 2  # no command: prints help, exit 2
    assert "usage: local-damage" in capsys.readouterr().out
