"""`local-damage bench score`: score-batch throughput for 1 and 2 workers, as ratios."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_score_json(capsys):
    from cli.main import main

    argv = ["bench", "score", "--count", "3", "--workers", "1", "2", "--large", "800", "--json"]
    assert main(argv) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["scenes"] == 3 and figures["buildings"] > 0
    assert figures["baseline_workers"] == 1 and figures["cpu_count"] >= 1
    rows = figures["rows"]
    assert [r["workers"] for r in rows] == [1, 2]
    assert rows[0]["where"] == "in this process"
    assert rows[1]["where"] == "embedded Dask cluster"
    assert rows[0]["scenes_ratio"] == rows[0]["buildings_ratio"] == 1.0
    for r in rows:
        assert r["failed"] == 0 and r["seconds"] > 0 and r["startup_s"] >= 0
        assert r["scenes_per_s"] > 0 and r["buildings_per_s"] > 0
        # every run scores the same buildings, so the two rates are in the same ratio
        assert r["buildings_per_s"] == pytest.approx(
            r["scenes_per_s"] * figures["buildings"] / figures["scenes"], rel=0.01
        )
        assert r["buildings_ratio"] == pytest.approx(
            r["buildings_per_s"] / rows[0]["buildings_per_s"], rel=0.01
        )
    one = figures["one_core"]
    assert one["threads"] == 1 and one["network_pairs_per_s"] > 0
    assert [r["input"] for r in one["rows"]] == ["synthetic batch (3)", "synthetic scene 800 px"]
    assert one["rows"][1]["buildings"] == 64  # one building per 100 px cell
    for r in one["rows"]:
        assert r["buildings_per_s"] == pytest.approx(r["buildings"] / r["seconds"], rel=0.01)
        assert r["ratio"] == pytest.approx(
            r["buildings_per_s"] / one["network_pairs_per_s"], rel=0.02
        )
        assert r["goal_met"] == (r["ratio"] >= 0.5)
        for stage in ("read", "align", "cut", "context", "infer", "flags", "outputs"):
            assert r["stages"][stage] > 0, stage
        assert sum(r["stages"].values()) <= r["scene_seconds"] * 1.01


def test_one_core_table():
    from bench.score_core import format_one_core

    row = {"input": "x", "scenes": 1, "buildings": 100, "scored": 100, "seconds": 2.0,
           "scene_seconds": 2.0, "buildings_per_s": 50.0, "ratio": 0.25, "goal_met": False,
           "stages": {"read": 0.5, "infer": 1.0}}  # fmt: skip
    text = format_one_core({"threads": 1, "batch_size": 32, "network_pairs_per_s": 200.0,
                            "rows": [row]})  # fmt: skip
    assert "not met" in text and "0.25" in text
    ms = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()[-5:-1]}
    assert ms == {"read": 5.0, "infer": 10.0, "other": 5.0, "total": 20.0}


def test_bench_score_table_and_errors(tmp_path, capsys):
    from bench.score import format_table
    from cli.main import main

    table = format_table(
        {
            "model": "m.onnx",
            "scenes": 2,
            "buildings": 80,
            "cpu_count": 2,
            "load_average": 0.5,
            "baseline_workers": 1,
            "rows": [
                {"workers": w, "where": "here", "startup_s": 1.0, "seconds": s,
                 "scenes_per_s": 2 / s, "buildings_per_s": 80 / s, "buildings_ratio": 2.0 / s}
                for w, s in ((1, 2.0), (2, 1.0))
            ],
        }
    )  # fmt: skip
    assert "ratio" in table and "2.00" in table
    (tmp_path / "empty").mkdir()
    assert main(["bench", "score", "--scenes", str(tmp_path / "empty")]) == 2
    assert "holds no scene folders" in capsys.readouterr().err
