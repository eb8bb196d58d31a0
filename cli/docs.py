"""Render the CLI reference from the argparse parser itself: an index (docs/cli.md) and one page
per top-level command (docs/cli/<command>.md, a group's subcommands as sections of its page, or
on pages of their own, docs/cli/<group>-<sub>.md, when the group's page would pass LIMIT).

``python -m cli.docs docs`` rewrites them all and removes a page no command renders any more;
``tests/cli/test_cli_docs.py`` checks the files are current.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

INDEX = "cli.md"
PAGES = "cli"
REGENERATE = "python -m cli.docs docs"
LIMIT = 15 * 1024  # bytes: a page a user reads in minutes


def _subparsers_action(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    action = _subparsers_action(parser)
    return list(action.choices.items()) if action else []


def _one_line_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each subcommand's help as listed in its parent's help, on one line."""
    action = _subparsers_action(parser)
    if action is None:
        return {}
    return {a.dest: " ".join((a.help or "").split()) for a in action._choices_actions}


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in heading.lower() if c.isalnum() or c in "-_ ")
    return kept.replace(" ", "-")


def _section(parser: argparse.ArgumentParser, prog: str, level: int) -> list[str]:
    out = [f"{'#' * level} `{prog}`\n"]
    if level == 1:
        out.append(
            f"Part of the [command-line reference](../{INDEX}); generated from the parser by "
            f"`{REGENERATE}`.\n"
        )
    if parser.description:
        out.append(parser.description.strip() + "\n")
    out += ["```text", parser.format_help().rstrip(), "```\n"]
    return out


def _page(lines: list[str]) -> str:
    return "\n".join(lines).rstrip() + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _tree(parser: argparse.ArgumentParser, prog: str, level: int) -> list[str]:
    """The sections of a command and of every subcommand below it (those at level 2)."""
    out = _section(parser, prog, level)
    for name, child in _subparsers(parser):
        out += _tree(child, f"{prog} {name}", 2)
    return out


def _render_pages(parser: argparse.ArgumentParser) -> dict[str, str]:
    """One page per top-level command, its subcommands as sections; a group whose page would
    pass LIMIT bytes gets a page per subcommand instead (cli/<group>-<sub>.md), listed on its own."""
    pages: dict[str, str] = {}
    helps = _one_line_help(parser)
    rows = ["| Command | What it does |", "| --- | --- |"]
    for name, child in _subparsers(parser):
        prog, page = f"local-damage {name}", f"{PAGES}/{name}.md"
        subs, sub_help = _subparsers(child), _one_line_help(child)
        body = _tree(child, prog, 1)
        links = {sub: f"{page}#{_anchor(f'{prog} {sub}')}" for sub, _ in subs}
        if len(_page(body).encode()) > LIMIT and subs:
            body = [*_section(child, prog, 1), "| Command | What it does |", "| --- | --- |"]
            for sub, grandchild in subs:
                links[sub] = f"{PAGES}/{name}-{sub}.md"
                pages[links[sub]] = _page(_tree(grandchild, f"{prog} {sub}", 1))
                body.append(
                    f"| [`{name} {sub}`]({name}-{sub}.md) | {_cell(sub_help.get(sub, ''))} |"
                )
        pages[page] = _page(body)
        rows.append(f"| [`{name}`]({page}) | {_cell(helps.get(name, ''))} |")
        rows += [
            f"| [`{name} {sub}`]({links[sub]}) | {_cell(sub_help.get(sub, ''))} |"
            for sub, _ in subs
        ]
    options = [
        f"`{', '.join(a.option_strings)}` ({a.help})"
        for a in parser._actions
        if a.option_strings and a.help and not isinstance(a, argparse._HelpAction)
    ]
    index = [
        "# Command-line reference",
        "",
        (parser.description or "").strip(),
        "",
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
        "Every command prints its own help with `--help`"
        + ("; other options: " + ", ".join(options) if options else "")
        + ".",
        f"One page per command under [cli/]({PAGES}/), generated from the parser by `{REGENERATE}`;",
        "`tests/cli/test_cli_docs.py` fails when a page and the parser disagree.",
        "",
        *rows,
    ]
    return {INDEX: _page(index), **dict(sorted(pages.items()))}


def render_pages() -> dict[str, str]:
    """The reference as {path relative to docs/: Markdown}, the index first."""
    from cli.main import build_parser

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps help to the terminal width: fix it
    try:
        return _render_pages(build_parser())
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved


def stale_pages(docs: Path, pages: dict[str, str]) -> list[Path]:
    """Pages under docs/cli/ that no command renders any more."""
    return sorted(p for p in (docs / PAGES).glob("*.md") if f"{PAGES}/{p.name}" not in pages)


def write(docs: Path) -> list[Path]:
    """Write every page under ``docs`` (each atomically) and remove stale ones; the paths written."""
    pages = render_pages()
    (docs / PAGES).mkdir(parents=True, exist_ok=True)
    written = []
    for rel, text in pages.items():
        path = docs / rel
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        written.append(path)
    for path in stale_pages(docs, pages):
        path.unlink()
    return written


if __name__ == "__main__":
    if len(sys.argv) > 2 or any(a.startswith("-") for a in sys.argv[1:]):
        sys.exit("usage: python -m cli.docs [DOCS_DIR]  (default: docs)")
    for written in write(Path(sys.argv[1] if len(sys.argv) == 2 else "docs")):
        print(written)
