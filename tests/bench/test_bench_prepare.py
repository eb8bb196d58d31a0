"""`bench prepare` on synthetic data: well-formed figures, as a table and as JSON."""

from __future__ import annotations

import json

import pytest

from bench.prepare import bench_prepare, format_table
from cli.main import main
from data_prep.spec import ChipSpec
from data_prep.store import read_manifest
from data_prep.xbd import prepare_xbd


@pytest.mark.slow
def test_bench_figures_are_well_formed(synthetic_xbd, tmp_path, capsys):
    figures = bench_prepare(
        synthetic_xbd, spec=ChipSpec(chip_size=32), workers=[1, 2], as_json=True, repeat=1
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(figures))
    prepare_xbd(synthetic_xbd, tmp_path / "c", spec=ChipSpec(chip_size=32))
    assert figures["buildings"] == len(read_manifest(tmp_path / "c")) > 0
    assert figures["tiles"] == 3 and figures["images"] == 6
    assert [r["workers"] for r in figures["results"]] == [1, 2]
    for r in figures["results"]:
        assert r["decode_s"] > 0 and r["extract_s"] > 0
        assert r["decode_buildings_per_s"] == pytest.approx(
            figures["buildings"] / r["decode_s"], rel=0.01
        )
        assert r["extract_buildings_per_s"] == pytest.approx(
            figures["buildings"] / r["extract_s"], rel=0.01
        )
        assert r["ratio"] == pytest.approx(r["decode_s"] / r["extract_s"], rel=0.01)
        assert r["decode_cpu_s"] > 0 and r["extract_cpu_s"] > 0 and r["cpu_ratio"] > 0
    assert figures["results"][0]["speedup"] == 1.0


def test_bench_table_and_cli(synthetic_xbd, capsys):
    rc = main(
        [
            "bench",
            "prepare",
            "--root",
            str(synthetic_xbd),
            "--workers",
            "1",
            "--limit",
            "2",
            "--chip-size",
            "32",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.strip().splitlines()
    assert lines[0].startswith("xBD chip extraction: 2 tiles, 4 images")
    assert lines[1].split() == [
        "workers",
        "decode-only",
        "bldg/s",
        "extraction",
        "bldg/s",
        "ratio",
        "speedup",
        "cpu",
        "ratio",
    ]
    cells = lines[2].split()
    assert (
        cells[0] == "1" and float(cells[1]) > 0 and float(cells[2]) > 0 and float(cells[4]) == 1.0
    )
    assert float(cells[3]) == pytest.approx(float(cells[2]) / float(cells[1]), abs=0.01)
    assert float(cells[5]) > 0

    rc = main(["bench", "prepare", "--root", str(synthetic_xbd), "--workers", "1", "--json"])
    figures = json.loads(capsys.readouterr().out)
    assert rc == 0 and figures["results"][0]["extract_buildings_per_s"] > 0
    assert format_table(figures).splitlines()[0].startswith("xBD chip extraction: 3 tiles")


@pytest.mark.slow
def test_bench_json_checks_targets(synthetic_xbd, capsys):
    figures = bench_prepare(
        synthetic_xbd, spec=ChipSpec(chip_size=32), workers=[2, 1], as_json=True, repeat=1
    )
    capsys.readouterr()
    by_workers = {r["workers"]: r for r in figures["results"]}
    assert by_workers[1]["speedup"] == 1.0  # speedup is over one worker, whatever the order
    checks = figures["checks"]
    assert checks["ratio_one_worker"] == by_workers[1]["ratio"]
    assert checks["ratio_one_worker_met"] == (by_workers[1]["ratio"] >= 0.70)
    assert checks["speedup_two_workers"] == by_workers[2]["speedup"]
    assert checks["speedup_two_workers_met"] == (by_workers[2]["speedup"] >= 1.8)
    load = figures["load_average"]
    assert len(load["before"]) == 3 and all(x >= 0 for x in load["after"])

    only_two = bench_prepare(
        synthetic_xbd, spec=ChipSpec(chip_size=32), workers=[2], repeat=1, print_result=False
    )
    assert only_two["checks"]["ratio_one_worker_met"] is None
    assert only_two["checks"]["speedup_two_workers_met"] is None
