"""Plain-text tables for the commands' printed figures: one line of column headers, one line per row.

A :class:`Column` says where a cell's value comes from (a key of the row, or a function of it) and
how it is written (a format spec such as ``.1f``, ``.2%`` or ``!s`` for ``str()``, an alignment
and a width); :func:`text_table` writes the lines, the cells joined by one separator. Cells are
padded to their width but never cut, so a long value widens its line only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Column:
    """One column: its header, its value in a row (a key or a function) and how it is written.

    Attributes:
        header: the column's title, aligned and padded as the cells are.
        value: a key of the row (``row[value]``) or a function of the row.
        spec: a format spec for the value (``".3f"``, ``".2%"``); ``"!s"`` writes ``str(value)``;
            ``""`` writes the value as it is.
        align: ``"<"`` (left) or ``">"`` (right).
        width: the least number of characters of the cell (0: no padding).
    """

    header: str
    value: str | Callable[[Any], Any]
    spec: str = ""
    align: str = ">"
    width: int = 0

    def _write(self, value: Any, spec: str) -> str:
        pad = f"{self.align}{self.width}" if self.width else self.align
        if spec == "!s":
            return format(str(value), pad)
        return format(value, pad + spec)

    def head(self) -> str:
        """The header, padded to the column's width."""
        return self._write(self.header, "")

    def cell(self, row: Any) -> str:
        """The cell of ``row`` in this column."""
        value = self.value(row) if callable(self.value) else row[self.value]
        return self._write(value, self.spec)


def text_table(columns: Sequence[Column], rows: Iterable[Any], sep: str = "  ") -> list[str]:
    """The header line, then one line per row, the cells joined by ``sep``."""
    lines = [sep.join(c.head() for c in columns)]
    lines += [sep.join(c.cell(r) for c in columns) for r in rows]
    return lines
