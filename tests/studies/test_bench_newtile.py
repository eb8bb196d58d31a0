"""`local-damage bench new-tile`: draws of k labels on tiles the model did not train on, the rest
of the tile graded by the base and the adapted model, and the share of draws made worse."""

from __future__ import annotations

import numpy as np

from tests.conftest import run_cli


def test_draws_leave_out_training_tiles_and_count_the_draws_made_worse(score_model, capsys):
    from runtime.predictor import Predictor
    from runtime.training_tiles import training_tiles
    from studies.newtile import WORSE, NewTileOptions, bench_new_tile

    chips = score_model.parent / "chips"
    options = NewTileOptions(ks=(2, 4), draws=6, min_eval=2)
    result = bench_new_tile(score_model, [str(chips)], options)
    trained = training_tiles(Predictor(score_model).metadata).tiles or frozenset()
    rows = result["rows"]
    assert rows and {r["k"] for r in rows} <= {2, 4}
    assert not {r["tile"] for r in rows} & trained  # the model's own tiles are never drawn
    for s in result["summary"]:
        sel = [r for r in rows if r["arm"] == s["arm"] and r["k"] == s["k"]]
        gains = np.asarray([r["adapted"] - r["base"] for r in sel])
        assert s["draws"] == len(sel) == 6
        assert s["worse_share"] == round(float(np.mean(gains < -WORSE)), 4)
        assert s["gain"] == round(float(gains.mean()), 4)
    assert (
        run_cli(
            "bench",
            "new-tile",
            "--model",
            score_model,
            "--chips",
            chips,
            "--k",
            "2",
            "--draws",
            "2",
            "--min-eval",
            "2",
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| heads | 2 | 2 |" in out and "worse by > 0.01" in out
