"""The stage profile of scoring: `local-damage score --profile` and :mod:`data_prep.timing`."""

from __future__ import annotations

import json
import re

import pytest

from app.scoring.common import STAGES
from data_prep.timing import StageTimes, stage_table
from tests.conftest import run_cli


def test_stage_times_add_merge_and_table():
    t = StageTimes()
    assert not t
    t.add("read", 0.25)
    with t.stage("cut"):
        pass
    t.add("read", 0.5)
    t.merge({"cut": 1.0, "infer": 2.0})
    d = t.as_dict()
    assert list(d) == ["read", "cut", "infer"]
    assert d["read"] == pytest.approx(0.75) and d["cut"] >= 1.0 and d["infer"] == 2.0
    lines = stage_table({"infer": 2.0, "read": 1.0}, 4.0, per=100, order=("read", "infer"))
    names = [line.split()[0] for line in lines[1:]]
    assert names == ["read", "infer", "other", "total"]  # order first, the rest as other
    other = lines[3].split()
    assert float(other[1]) == pytest.approx(1.0) and other[2] == "25.0%"
    assert float(other[3]) == pytest.approx(10.0)  # ms per building: 1 s over 100


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_score_profile_prints_stage_times(tmp_path, synthetic_scene, score_model, capsys):
    s = synthetic_scene
    args = ["score", "--pre", *s.pre, "--post", *s.post, "--buildings", s.buildings]
    args += ["--model", score_model, "--quiet", "--batch-size", "5", "--block-size", "200"]
    assert run_cli(*args, "--out", tmp_path / "plain.geojson", "--json") == 0
    plain = json.loads(capsys.readouterr().out)
    assert "stages" not in plain  # only when asked for

    rc = run_cli(*args, "--out", tmp_path / "p.geojson", "--overlay", tmp_path / "p.png",
                 "--profile", "--json")  # fmt: skip
    assert rc == 0
    got = capsys.readouterr()
    report = json.loads(got.out)
    stages = report["stages"]
    for name in ("open", "align", "plan", "read", "cut", "context", "infer", "flags", "outputs"):
        assert stages[name] >= 0, name
    assert stages["read"] > 0 and stages["infer"] > 0 and stages["outputs"] > 0
    assert set(stages) <= set(STAGES)
    assert sum(stages.values()) <= report["seconds"] * 1.01
    # the printed total is the scene's time (the JSON's is rounded to ms: compare to 0.01 s)
    printed = re.search(r"stages of the (\d+\.\d\d) s:", got.err)
    assert printed and abs(float(printed.group(1)) - report["seconds"]) <= 0.006, got.err
    table = got.err.split("stages of the")[1].splitlines()[1:]
    assert table[0].split() == ["stage", "seconds", "share", "ms/building"]
    assert [line.split()[0] for line in table[1:]][-1] == "total"
    # the same grades with and without the profile
    a = json.loads((tmp_path / "plain.geojson").read_text())["features"]
    b = json.loads((tmp_path / "p.geojson").read_text())["features"]
    assert [f["properties"] for f in a] == [f["properties"] for f in b]
