"""docs/cli.md and docs/cli/*.md are the parser's own help, so they cannot drift from the commands."""

from __future__ import annotations

import re

from cli.docs import render_pages, stale_pages, write
from cli.main import build_parser, main
from tests.conftest import REPO

DOCS = REPO / "docs"
FIX = "regenerate with: python -m cli.docs docs"


def test_cli_reference_is_current():
    pages = render_pages()
    assert "cli.md" in pages
    stale = [
        rel
        for rel, text in pages.items()
        if not (DOCS / rel).is_file() or (DOCS / rel).read_text() != text
    ]
    assert not stale, f"out of date: {stale}; {FIX}"
    lingering = stale_pages(DOCS, pages)
    assert not lingering, f"no command renders {[p.name for p in lingering]}; {FIX}"


def test_every_command_has_a_page_linked_from_the_index(capsys):
    pages = render_pages()
    index = pages["cli.md"]
    text = "\n".join(pages.values())
    parser = build_parser()
    for action in parser._actions:
        if getattr(action, "choices", None) and isinstance(action.choices, dict):
            for name, child in action.choices.items():
                assert f"](cli/{name}.md)" in index
                assert f"# `local-damage {name}`" in pages[f"cli/{name}.md"]
                for sub_action in child._actions:
                    if isinstance(getattr(sub_action, "choices", None), dict):
                        for sub in sub_action.choices:
                            assert f"# `local-damage {name} {sub}`" in text
                            assert f"[`{name} {sub}`](cli/{name}" in index
    assert main([]) == 2  # no command: prints help, exit 2
    assert "usage: local-damage" in capsys.readouterr().out


def test_links_between_the_pages_resolve():
    pages = render_pages()
    anchors = {
        rel: {
            re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
            for h in re.findall(r"(?m)^#+ (.*)$", re.sub(r"(?s)```.*?```", "", text))
        }
        for rel, text in pages.items()
    }
    for rel, text in pages.items():
        for target in re.findall(r"\]\(([^)]+\.md(?:#[^)]*)?)\)", text):
            path, _, anchor = target.partition("#")
            resolved = (DOCS / rel).parent.joinpath(path).resolve().relative_to(DOCS.resolve())
            assert resolved.as_posix() in pages, f"{rel} links to {target}"
            assert not anchor or anchor in anchors[resolved.as_posix()], f"{rel} links to {target}"


def test_write_replaces_the_pages_and_removes_stale_ones(tmp_path):
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "gone.md").write_text("a command that no longer exists\n")
    (tmp_path / "cli" / "notes.txt").write_text("not a page\n")
    written = write(tmp_path)
    pages = render_pages()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == sorted(pages)
    assert not (tmp_path / "cli" / "gone.md").exists()
    assert (tmp_path / "cli" / "notes.txt").exists()
    assert not list(tmp_path.rglob("*.tmp"))
    assert all((tmp_path / rel).read_text() == text for rel, text in pages.items())
