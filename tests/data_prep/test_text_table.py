"""The one plain-text table of the commands' figures (data_prep.text_table)."""

from __future__ import annotations

from data_prep.text_table import Column, text_table


def test_columns_pad_align_and_format_their_cells():
    cols = [
        Column("name", "name", "!s", "<", 6),
        Column("rate", "rate", ".1f", ">", 6),
        Column("share", lambda r: r["a"] / r["b"], ".0%", ">", 0),
    ]
    rows = [
        {"name": "one", "rate": 12.345, "a": 1, "b": 4},
        {"name": None, "rate": 3, "a": 3, "b": 3},
    ]
    assert text_table(cols, rows, sep=" | ") == [
        "name   |   rate | share",
        "one    |   12.3 | 25%",
        "None   |    3.0 | 100%",
    ]


def test_a_long_value_widens_its_line_and_no_rows_give_the_header():
    cols = [Column("k", "k", "!s", "<", 3), Column("v", "v", "d", ">", 3)]
    assert text_table(cols, [{"k": "longer", "v": 7}]) == ["k      v", "longer    7"]
    assert text_table(cols, []) == ["k      v"]
