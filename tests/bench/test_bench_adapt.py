"""`local-damage bench adapt`: the figures it prints are of real adaptations (no timing asserts)."""

from __future__ import annotations

import json

import pytest

from cli.main import main


@pytest.mark.slow
def test_bench_adapt_adapts_each_draw_and_the_baseline(score_model, capsys):
    chips = score_model.parent / "chips"
    args = ["bench", "adapt", "--model", str(score_model), "--chips", str(chips)]
    assert main([*args, "--labels", "6,10", "--repeats", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    assert [r["labels"] for r in rows] == [6, 10, result["pool"]]
    assert [r["baseline"] for r in rows] == [False, False, True]
    for row, draws in zip(rows, (2, 2, 1), strict=True):
        assert len(row["fit_s"]) == len(row["embed_s"]) == draws
        assert sum(row["heads"].values()) == draws
        assert all(a >= f for a, f in zip(row["adapt_s"], row["fit_s"], strict=True))
    # 6 labels over the fixture's 3 tiles: held out a tile at a time (adapt's folds by tile)
    assert rows[0]["scheme"] == "leave-one-tile-out"

    assert main([*args, "--labels", "6", "--repeats", "1"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[:2] == ["labels", "cross-validation"]
    assert table[2].split()[0] == "6" and table[3].split()[0] == f"{result['pool']}*"
