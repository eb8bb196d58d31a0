"""Render the CLI reference (docs/cli.md) from the argparse parser itself.

``python -m cli.docs > docs/cli.md`` regenerates it; a test checks the file is current.
"""

from __future__ import annotations

import argparse
import os
import sys


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices.items())
    return []


def _walk(parser: argparse.ArgumentParser, prefix: str, out: list[str]) -> None:
    children = _subparsers(parser)
    if prefix:
        out.append(f"## `{prefix}`\n")
        if parser.description:
            out.append(parser.description.strip() + "\n")
        out.append("```text")
        out.append(parser.format_help().rstrip())
        out.append("```\n")
    for name, child in children:
        _walk(child, f"{prefix} {name}".strip() if prefix else f"local-damage {name}", out)


def render() -> str:
    from cli.main import build_parser

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps help to the terminal width: fix it
    try:
        return _render(build_parser())
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved


def _render(parser: argparse.ArgumentParser) -> str:
    out = [
        "# Command-line reference",
        "",
        "Generated from the parser by `python -m cli.docs > docs/cli.md`;",
        "`tests/cli/test_cli_docs.py` fails when this page and the parser disagree.",
        "",
        "```text",
        parser.format_help().rstrip(),
        "```",
        "",
    ]
    _walk(parser, "", out)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
