"""`local-damage bench city` at a tiny size: it runs, and its figures add up (not timed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.city import districts, format_city, make_city
from tests.conftest import run_cli


def test_districts_cover_every_building_once(tmp_path):
    scene = make_city(tmp_path / "s", 30, spacing=50)  # 6 x 6 cells
    assert scene.name == "s"
    parts = districts(scene, 4)
    assert [p.name for p in parts] == [f"s-d{i:02d}" for i in range(4)]
    assert all(p.pre == scene.pre and p.post == scene.post for p in parts)
    uids = [
        f["properties"]["uid"]
        for p in parts
        for f in json.loads(Path(p.buildings).read_text())["features"]
    ]
    assert len(uids) == 36 and len(set(uids)) == 36
    tops = [
        max(v[1] for f in json.loads(Path(p.buildings).read_text())["features"]
            for v in f["geometry"]["coordinates"][0])
        for p in parts
    ]  # fmt: skip
    assert tops == sorted(tops, reverse=True)  # strips from north to south


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_city_tiny(tmp_path, capsys):
    argv = ["bench", "city", "--buildings", "30", "--small", "9", "--workers", "2"]
    assert run_cli(*argv, "--spacing", "60", "--dir", tmp_path, "--json") == 0
    figures = json.loads(capsys.readouterr().out)
    assert [r["workers"] for r in figures["runs"]] == [1, 2]
    for run in figures["runs"]:
        small, city = run["scenes"]
        assert (small["scene"], city["scene"]) == ("small", "city")
        assert (small["buildings"], city["buildings"]) == (9, 36)  # whole cells: 3 x 3, 6 x 6
        for r in run["scenes"]:
            assert r["scored"] > 0 and r["seconds"] > 0 and 50 < r["peak_rss_mb"] < 10_000
            assert r["ms_per_building"] == pytest.approx(1000 * r["seconds"] / r["buildings"])
        assert run["ratio"] == pytest.approx(city["ms_per_building"] / small["ms_per_building"])
    one = figures["runs"][0]["scenes"]
    assert one[1]["stages"]["read"] > 0 and one[1]["peak_rss_mb"] >= one[1]["rss_before_mb"]
    assert len(figures["runs"][1]["scenes"][1]["worker_rss_mb"]) == 2
    table = format_city(figures)
    assert "city/small ms per building" in table and "peak RSS" in table
    assert run_cli("bench", "city", "--buildings", "0") == 2
