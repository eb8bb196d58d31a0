"""`local-damage bench map`: the web map's size, write cost and draw time on a synthetic scene."""

from __future__ import annotations

import json

import pytest

from bench.map import CHROMIUM


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_map_json(capsys):
    from cli.main import main

    rc = main(["bench", "map", "--size", "1024", "--json"])
    assert rc == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["scene"] == "synthetic-1024px"
    assert 0.01 < row["map_mb"] < 5
    assert row["score_s"] > 0 and row["score_with_map_s"] > 0
    assert 0 < row["map_write_s"] < row["score_with_map_s"]
    if CHROMIUM.is_file():
        # 10 x 10 cells of 100 px: every building drawn, every one graded, nothing fetched
        assert row["drawn"] == 100 and row["scored"] == 100
        assert row["open_to_drawn_ms"] >= row["render_ms"] > 0
        assert row["blocked"] == 0
    else:
        assert "chromium" in row["render"]


def test_bench_map_names_a_wrong_joplin_folder(tmp_path, capsys):
    from cli.main import main

    assert main(["bench", "map", "--joplin", str(tmp_path), "--size", "0"]) != 0
    assert "footprints/joplin.geojson" in capsys.readouterr().err
