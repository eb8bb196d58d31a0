"""Pre and post given the wrong way round: the scoring report warns (app.scoring.order).

The dates path runs on the synthetic scene with acquisition dates written into its tiles'
metadata (real GeoTIFF tags, read back by rasterio). The grades path needs a model that sees
real damage, so it runs on the real Joplin scene and xBD tiles with the bundled model.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from app.scoring.order import MARGIN
from tests.conftest import run_cli, shared_data


def _dated_copies(paths, folder: Path, when: str) -> list[Path]:
    """Copies of GeoTIFF tiles whose GDAL ``IMAGERY`` metadata says they were taken ``when``."""
    import rasterio

    folder.mkdir(parents=True)
    out = []
    for p in paths:
        dst = folder / Path(p).name
        shutil.copy(p, dst)
        with rasterio.open(dst, "r+") as ds:
            ds.update_tags(ns="IMAGERY", ACQUISITIONDATETIME=when)
            ds.update_tags(TIFFTAG_DATETIME="2024:01:01 00:00:00")  # when the file was written
        out.append(dst)
    return out


@pytest.fixture(scope="module")
def dated_scene(tmp_path_factory, synthetic_scene):
    """The synthetic scene's tiles, pre dated 2011-05-20 and post 2011-05-23."""
    root = tmp_path_factory.mktemp("dated")
    pre = _dated_copies(synthetic_scene.pre, root / "pre", "2011-05-20T17:05:31.000Z")
    post = _dated_copies(synthetic_scene.post, root / "post", "2011:05:23 16:58:02")
    return pre, post, synthetic_scene.buildings


def test_parse_date():
    from app.scoring.order import parse_date

    assert parse_date("2011-05-23T17:01:02.5Z") == datetime(2011, 5, 23, 17, 1, 2)
    assert parse_date("2011:05:23 17:01:02") == datetime(2011, 5, 23, 17, 1, 2)
    assert parse_date("20110523") == datetime(2011, 5, 23)
    assert parse_date("2011-13-40") is None
    assert parse_date("NEAREST") is None


def test_rule_thresholds():
    """The rule of docs/scoring.md: most of the sample damaged when exchanged, clearly more than
    given, on enough buildings."""
    from app.scoring.order import MIN_SAMPLE, looks_reversed

    assert looks_reversed(64, 0.03, 0.97)  # the Joplin scene swapped
    assert not looks_reversed(64, 0.97, 0.05)  # the Joplin scene as given
    assert not looks_reversed(64, 0.06, 0.36)  # an intact Florence tile: 0.30 more, not most
    assert not looks_reversed(64, 0.30, 0.55)  # most, but not clearly more
    assert not looks_reversed(MIN_SAMPLE - 1, 0.0, 1.0)  # too few buildings to say


def test_sample_is_bounded_and_seeded():
    from app.scoring.order import SAMPLE_SIZE, OrderSample

    def draw():
        sample = OrderSample()
        for row in range(1000):
            chip = np.full((4, 4, 3), row % 251, np.uint8)
            sample.offer(row, chip, chip)
        return sample

    a, b = draw(), draw()
    assert len(a) == SAMPLE_SIZE and a.rows == b.rows
    assert max(a.rows) > 500  # late buildings are drawn too, not only the first 64
    assert all(int(c[0, 0, 0]) == r % 251 for r, c in zip(a.rows, a.pre, strict=True))


class _ReadsTheChip:
    """A model whose grade is written in the chip it is given as pre (1: destroyed, else
    no-damage), counting the pairs it grades: the stopping rule of ``grade_order`` is what is
    under test here, the network's part is the bundled model's in the tests below."""

    def __init__(self):
        self.graded = 0

    def predict(self, pre, post, batch_size=32):
        from types import SimpleNamespace

        self.graded += len(pre)
        probabilities = np.zeros((len(pre), 4), np.float32)
        probabilities[np.arange(len(pre)), 3 * (pre[:, 0, 0, 0] == 1)] = 1.0
        return SimpleNamespace(probabilities=probabilities)


def test_exchanged_grading_stops_only_when_the_rest_cannot_matter():
    """Over random samples the verdict, and the figures of a reversed sample, are those of the
    whole sample graded exchanged; a stop leaves no way for the rest to make it reversed."""
    from app.scoring.order import MIN_SAMPLE, OrderSample, grade_order, looks_reversed

    rng = np.random.default_rng(3)
    saved = reversed_seen = 0
    for _ in range(300):
        n = int(rng.integers(MIN_SAMPLE, 65))
        exchanged = rng.random(n) < rng.choice([0.05, 0.3, 0.6, 0.95])
        given = (rng.random(n) < rng.choice([0.05, 0.3, 0.6])).astype(int)
        sample = OrderSample(size=64)
        for row in range(n):
            post = np.full((4, 4, 3), int(exchanged[row]), np.uint8)  # graded as pre when exchanged
            sample.offer(row, np.zeros((4, 4, 3), np.uint8), post)
        model = _ReadsTheChip()
        got = grade_order(model, sample, given, step=8)
        full = float(exchanged.mean())
        assert got.reversed == looks_reversed(n, float((given > 0).mean()), full)
        assert model.graded == got.exchanged and got.to_dict()["exchanged"] == got.exchanged
        if got.exchanged < n:
            saved += 1
            d = round((got.damaged_exchanged or 0.0) * got.exchanged)
            assert not looks_reversed(n, got.damaged_given, (d + n - got.exchanged) / n)
        if got.reversed:
            reversed_seen += 1
            assert got.exchanged == n and got.damaged_exchanged == full
    assert saved > 50 and reversed_seen > 20
    sample = OrderSample()
    for row in range(20):
        sample.offer(row, np.zeros((4, 4, 3), np.uint8), np.ones((4, 4, 3), np.uint8))
    model = _ReadsTheChip()
    got = grade_order(model, sample, np.full(20, 2))  # all damaged as given: cannot be reversed
    assert model.graded == 0 and got.to_dict()["damaged_exchanged"] is None and not got.reversed


@pytest.mark.slow
def test_swapped_dates_warn_everywhere(tmp_path, dated_scene, score_model, capsys):
    """Post dated before pre: the CLI, the JSON report and both vector formats say so."""
    import pyogrio

    pre, post, buildings = dated_scene
    out = tmp_path / "swapped.geojson"
    argv = ["score", "--pre", *post, "--post", *pre, "--buildings", buildings]
    rc = run_cli(*argv, "--model", score_model, "--out", out, "--quiet", "--json")
    assert rc == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["order"]["method"] == "dates" and report["order"]["reversed"] is True
    assert report["order"]["dates"]["verdict"] == "reversed"
    assert "warning: pre and post look exchanged" in captured.err
    assert "IMAGERY:ACQUISITIONDATETIME 2011-05-20" in captured.err
    member = json.loads(out.read_text())["local_damage_order"]
    assert member == report["order"] and "taken before" in member["warning"]

    gpkg = tmp_path / "swapped.gpkg"
    assert run_cli(*argv, "--model", score_model, "--out", gpkg, "--quiet") == 0
    stored = pyogrio.read_info(gpkg)["layer_metadata"]
    assert json.loads(stored["local_damage_order"])["method"] == "dates"
    capsys.readouterr()


def test_right_dates_do_not_warn(tmp_path, dated_scene, score_model, capsys):
    pre, post, buildings = dated_scene
    out = tmp_path / "right.geojson"
    argv = ["score", "--pre", *pre, "--post", *post, "--buildings", buildings]
    assert run_cli(*argv, "--model", score_model, "--out", out, "--quiet", "--json") == 0
    captured = capsys.readouterr()
    order = json.loads(captured.out)["order"]
    assert order["method"] == "dates" and order["reversed"] is False
    assert order["dates"]["written_pre"][0]["key"] == "TIFFTAG_DATETIME"  # reported, not used
    assert "exchanged" not in captured.err
    assert "local_damage_order" not in json.loads(out.read_text())


def test_app_status_warns(tmp_path, dated_scene, score_model):
    """The web app's tile summary leads with the warning; the right order has none."""
    from app.web.assess import assess_tile
    from runtime.predictor import Predictor

    pre, post, buildings = dated_scene
    predictor = Predictor(score_model)
    swapped = assess_tile(predictor, post[0], pre[0], buildings, tmp_path / "s")
    assert "**Warning**: pre and post look exchanged" in swapped.summary()
    right = assess_tile(predictor, pre[0], post[0], buildings, tmp_path / "r")
    assert right.warning == "" and "Warning" not in right.summary()


def test_batch_summary_warns(tmp_path, dated_scene, score_model, capsys):
    """score-batch: the swapped scene's line in the summary, its report in summary.json."""
    pre, post, buildings = dated_scene
    for name, a, b in (("right", pre, post), ("swapped", post, pre)):
        folder = tmp_path / "scenes" / name
        for sub, paths in (("pre", a), ("post", b)):
            (folder / sub).mkdir(parents=True)
            for p in paths:
                (folder / sub / p.name).symlink_to(p)
        (folder / "footprints.geojson").symlink_to(buildings)
    out = tmp_path / "out"
    argv = ["score-batch", "--scenes", tmp_path / "scenes", "--model", score_model]
    assert run_cli(*argv, "--out", out, "--workers", "1", "--quiet") == 0
    err = capsys.readouterr().err
    assert "warning: scene swapped: pre and post look exchanged: the post imagery" in err
    assert "scene right:" not in err
    scenes = {s["name"]: s for s in json.loads((out / "summary.json").read_text())["scenes"]}
    assert scenes["swapped"]["report"]["order"]["reversed"] is True
    assert scenes["right"]["report"]["order"]["warning"] == ""


def test_undated_synthetic_scene_is_graded_both_ways(tmp_path, synthetic_scene, score_model):
    """Without dates the sample is graded both ways; grades stay those of the order given."""
    from app.scoring.common import ScoreOptions
    from app.scoring.scene import score_scene
    from runtime.predictor import Predictor

    s = synthetic_scene
    predictor = Predictor(score_model)
    opts = ScoreOptions(progress=False)
    report = score_scene(predictor, s.pre, s.post, s.buildings, tmp_path / "a.gpkg", options=opts)
    assert report.order["method"] == "grades"
    assert report.order["grades"]["sample"] == report.scored == s.covered
    again = score_scene(predictor, s.pre, s.post, s.buildings, tmp_path / "b.gpkg", options=opts)
    assert again.order == report.order


# ------------------------------------------------------------------------------ real data


def _bundled():
    from runtime.registry import default_model

    return default_model()


@pytest.mark.realdata
def test_joplin_swapped_warns(tmp_path, capsys):
    """The real Joplin scene: swapped, the check warns; in the right order it does not."""
    root = shared_data("joplin_geotiff")
    pre = sorted((root / "pre").glob("*.tif"))
    post = sorted((root / "post").glob("*.tif"))
    fp = root / "footprints" / "joplin.geojson"
    model = _bundled()
    orders = {}
    for name, a, b in (("right", pre, post), ("swapped", post, pre)):
        out = tmp_path / f"{name}.gpkg"
        argv = ["score", "--pre", *a, "--post", *b, "--buildings", fp, "--model", model]
        assert run_cli(*argv, "--out", out, "--quiet", "--json") == 0
        captured = capsys.readouterr()
        orders[name] = (json.loads(captured.out)["order"], captured.err)
    order, err = orders["swapped"]
    assert order["method"] == "grades" and order["reversed"] is True
    assert order["grades"]["sample"] == 64
    # clearly past the rule's margin (the bundled model: 0.05 damaged as given, 0.73 exchanged)
    gap = order["grades"]["damaged_exchanged"] - order["grades"]["damaged_given"]
    assert gap > MARGIN + 0.2
    assert "warning: pre and post look exchanged" in err
    order, err = orders["right"]
    assert order["reversed"] is False and "exchanged" not in err


@pytest.mark.realdata
@pytest.mark.parametrize(
    ("tile", "swapped_warns"),
    [("joplin-tornado_00000000", True), ("santa-rosa-wildfire_00000045", False)],
    ids=["damaged", "intact"],
)
def test_xbd_tiles_both_ways(tmp_path, tile, swapped_warns):
    """A damaged xBD tile swapped warns; an intact one warns neither way."""
    from app.scoring.common import ScoreOptions
    from app.scoring.xbd import score_xbd
    from runtime.predictor import Predictor

    root = shared_data("xbd_sample")
    pre = root / "images" / f"{tile}_pre_disaster.png"
    post = root / "images" / f"{tile}_post_disaster.png"
    labels = root / "labels" / f"{tile}_post_disaster.json"
    predictor = Predictor(_bundled())
    opts = ScoreOptions(progress=False)
    right = score_xbd(predictor, pre, post, labels, tmp_path / "r.gpkg", options=opts)
    swapped = score_xbd(predictor, post, pre, labels, tmp_path / "s.gpkg", options=opts)
    assert right.order["method"] == swapped.order["method"] == "grades"
    assert right.order["reversed"] is False and not right.order_warning
    assert swapped.order["reversed"] is swapped_warns
    assert bool(swapped.order_warning) is swapped_warns


def test_dates_from_an_open_file_equal_those_from_its_path(dated_scene):
    """Scoring reads the dates from the tiles it has open: the same dates as opening them."""
    import rasterio

    from app.scoring.order import date_order, file_dates

    pre, post, _ = dated_scene
    with rasterio.open(pre[0]) as ds:
        assert file_dates(pre[0], ds) == file_dates(pre[0])
        assert not ds.closed  # left open for the scene
    opened = {str(p): rasterio.open(p) for p in (*pre, *post)}
    try:
        assert date_order(pre, post, opened) == date_order(pre, post)
        assert date_order(pre, post, opened).verdict == "right"
    finally:
        for ds in opened.values():
            ds.close()
