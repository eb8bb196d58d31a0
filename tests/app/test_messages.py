"""Ids and messages a user reads: suggestions that map back to the footprints, no temporary file
named, the app's own hint for reaching it, unmatched filename patterns, GeoJSON coordinates that
are not longitude/latitude, and xBD tiles without a building."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from tests.conftest import REPO, run_cli, shared_data


def _read(path):
    from pyogrio.raw import read

    meta, fids, _, values = read(str(path), read_geometry=False, return_fids=True)
    return dict(zip(meta["fields"], values, strict=True)), fids


# ------------------------------------------------------------------ (a) suggestions' ids


@pytest.mark.parametrize("with_uid", [True, False], ids=["uid", "no-uid"])
def test_suggested_ids_map_back_to_the_footprints(tmp_path, synthetic_scene, score_model, with_uid):
    """Each suggestion names its file, its own id (the uid attribute, else the feature id) and
    its row, which is the row of the scored output: the same building, the same grade."""
    import pandas as pd
    from pyogrio.raw import read, write

    s = synthetic_scene
    fp = s.buildings
    if not with_uid:  # the same footprints, the uid attribute renamed
        meta, _, wkb, values = read(str(s.buildings), return_fids=True)
        fields = ["name" if f == "uid" else f for f in meta["fields"]]
        fp = tmp_path / "nouid.geojson"
        write(str(fp), wkb, field_data=values, fields=fields, crs=meta["crs"], driver="GeoJSON",
              geometry_type="Polygon")  # fmt: skip
    scene = ["--pre", *s.pre, "--post", *s.post, "--buildings", fp, "--model", score_model]
    ranking = tmp_path / "next.csv"
    assert run_cli("adapt", *scene, "--suggest", "6", "--suggest-out", ranking, "--quiet") == 0
    assert run_cli("score", *scene, "--out", tmp_path / "scored.gpkg", "--quiet") == 0
    ranked = pd.read_csv(ranking, dtype={"id": str})
    assert list(ranked.columns[:4]) == ["rank", "id", "row", "file"]
    assert (ranked["file"] == str(fp)).all()
    attrs, fids = _read(fp)
    scored, _ = _read(tmp_path / "scored.gpkg")
    own = attrs["uid"] if with_uid else [str(int(f)) for f in fids]
    for r in ranked.itertuples():
        assert r.id == str(own[r.row])
        assert scored["status"][r.row] == "scored"
        assert scored["damage"][r.row] == r.predicted
        assert abs(scored["confidence"][r.row] - r.confidence) < 1e-4


# ------------------------------------------------------ (b) no temporary file in messages


@pytest.mark.realdata
def test_detected_buildings_are_named_by_the_users_image(tmp_path, xbd_pair):
    """Without footprints, a skipped building is named by the image the user gave, not by the
    temporary label file the detected buildings were written to."""
    from app.scoring.detect import score_xbd_detected
    from runtime.localizer import load_localizer
    from runtime.predictor import Predictor
    from runtime.registry import default_model

    pre, post = xbd_pair(tmp_path, blank_post_left=700)
    predictor = Predictor(default_model())
    report = score_xbd_detected(
        predictor, pre, post, tmp_path / "out.gpkg", localizer=load_localizer()
    )
    assert report.skipped, "the blank half of the post image leaves some building ungraded"
    for s in report.skipped:
        assert s.item.startswith(f"{pre}: detected building detected-"), s.item
        assert "local-damage-detected" not in str(s)


@pytest.mark.realdata
def test_geojson_of_detected_pixel_buildings_names_the_image(tmp_path, xbd_pair, capsys):
    """A JPEG pair without footprints and a GeoJSON output: the error names the user's image
    (it has no georeferencing), before any detection, not a temporary label file."""
    pre, post = xbd_pair(tmp_path)
    out = tmp_path / "out.geojson"
    assert run_cli("score", "--pre", pre, "--post", post, "--out", out) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {pre}: is not georeferenced") and "out.gpkg" in err
    assert "local-damage-detected" not in err and not out.exists()


@pytest.fixture
def xbd_pair():
    """A real xBD pre/post pair as JPEG and PNG, the post's left columns blanked."""

    def make(folder, blank_post_left: int = 0):
        import cv2

        root = shared_data("xbd_sample") / "images"
        tile = "hurricane-florence_00000318"
        pre = cv2.imread(str(root / f"{tile}_pre_disaster.png"))
        post = cv2.imread(str(root / f"{tile}_post_disaster.png"))
        post[:, :blank_post_left] = 0
        cv2.imwrite(str(folder / "before.jpg"), pre)
        cv2.imwrite(str(folder / "after.png"), post)
        return folder / "before.jpg", folder / "after.png"

    return make


# ------------------------------------------------------------- (c) how to reach the app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_app_prints_its_own_hint_not_gradios(tmp_path):
    """The command's console says how to reach the app with its own flags (``--share``), not
    Gradio's "set `share=True` in `launch()`"."""
    from cli.main import build_parser

    port = _free_port()
    argv = [sys.executable, "-m", "cli.main", "app", "--port", str(port), "--work", str(tmp_path)]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()[0].decode()
                time.sleep(0.5)
        time.sleep(1.0)  # what is printed once the server is up
    finally:
        proc.terminate()
        output = proc.communicate(timeout=60)[0].decode()
    assert "share=True" not in output and "launch()" not in output
    assert "--share for a temporary public link" in output
    assert build_parser().parse_args(["app", "--share"]).share is True


# ------------------------------------------------------- (d) unmatched filename patterns


def test_unmatched_pattern_is_named_as_one(tmp_path, synthetic_scene, score_model, capsys):
    s = synthetic_scene
    pattern = tmp_path / "pre" / "*.tif"
    argv = ["score", "--pre", pattern, "--post", *s.post, "--buildings", s.buildings]
    assert run_cli(*argv, "--model", score_model, "--out", tmp_path / "o.geojson") == 2
    err = capsys.readouterr().err
    assert f"'{pattern}' is a filename pattern that matched no file" in err
    quoted = s.pre[0].parent / "*.tif"  # matches: a quoted pattern
    argv = ["score", "--pre", *s.pre, "--post", *s.post, "--buildings", quoted.parent / "*.json"]
    assert run_cli(*argv, "--model", score_model, "--out", tmp_path / "o.geojson") == 2
    assert "matched no file" in capsys.readouterr().err
    from data_prep.errors import not_found

    assert "matches 2 file(s)" in not_found(quoted) and "unquoted" in not_found(quoted)
    assert not_found(tmp_path / "plain.tif") == "file not found"


# ------------------------------------------------- (e) GeoJSON that is not longitude/latitude


def test_projected_geojson_without_crs_is_explained(tmp_path, synthetic_scene, score_model, capsys):
    """Metres in a GeoJSON without a crs member: the file, its bounds and what to do."""
    import geopandas as gpd

    s = synthetic_scene
    projected = gpd.read_file(s.buildings).to_crs("EPSG:32615")
    data = json.loads(projected.to_json())
    data.pop("crs", None)
    bad = tmp_path / "metres.geojson"
    bad.write_text(json.dumps(data))
    argv = ["score", "--pre", *s.pre, "--post", *s.post, "--buildings", bad, "--model", score_model]
    assert run_cli(*argv, "--out", tmp_path / "o.geojson") == 2
    err = capsys.readouterr().err
    x0 = projected.total_bounds[0]
    assert f"error: {bad}: its coordinates span x {x0:.1f}" in err
    assert "outside longitude/latitude" in err and "nan" not in err
    assert "crs member" in err and "EPSG:4326" in err and "GeoPackage" in err
    # the same coordinates with their CRS declared are scored
    data["crs"] = {"type": "name", "properties": {"name": "urn:ogc:def:crs:EPSG::32615"}}
    bad.write_text(json.dumps(data))
    assert run_cli(*argv, "--out", tmp_path / "o.geojson", "--quiet") == 0


# ------------------------------------------------------------ (f) xBD tile without buildings


@pytest.mark.realdata
@pytest.mark.filterwarnings("ignore::rasterio.errors.NotGeoreferencedWarning")
def test_xbd_tile_without_buildings_gives_empty_outputs(tmp_path, capsys):
    """A real xBD tile's images with its label's buildings taken out (full xBD has such tiles):
    empty outputs, exit status 0, and the summary says why."""
    import pyogrio
    import rasterio

    root = shared_data("xbd_sample")
    tile = "hurricane-florence_00000318"
    label = json.loads((root / "labels" / f"{tile}_post_disaster.json").read_text())
    label["features"] = {"lng_lat": [], "xy": []}
    empty = tmp_path / f"{tile}_post_disaster.json"
    empty.write_text(json.dumps(label))
    images = root / "images"
    argv = ["score", "--pre", images / f"{tile}_pre_disaster.png", "--post",
            images / f"{tile}_post_disaster.png", "--labels", empty]  # fmt: skip
    out = tmp_path / "out.gpkg"
    raster = tmp_path / "out.tif"
    rc = run_cli(*argv, "--out", out, "--raster", raster, "--json")
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert f"no buildings in the label file {empty}" in captured.err
    report = json.loads(captured.out)
    assert report["buildings"] == 0 and report["notes"]
    assert len(pyogrio.read_dataframe(out)) == 0
    with rasterio.open(raster) as ds:
        assert (ds.read(1) == ds.nodata).all() and (ds.width, ds.height) == (1024, 1024)
    geojson = tmp_path / "out.geojson"
    assert run_cli(*argv, "--out", geojson, "--quiet") == 0
    assert json.loads(geojson.read_text())["features"] == []
    assert np.isfinite(report["seconds"])


def test_printed_ranking_is_csv(tmp_path, synthetic_scene, score_model, capsys):
    """Printed to the console, the ranking is CSV a reader parses (quoted file paths)."""
    import pandas as pd

    s = synthetic_scene
    scene = ["--pre", *s.pre, "--post", *s.post, "--buildings", s.buildings]
    assert run_cli("adapt", *scene, "--model", score_model, "--suggest", "3") == 0
    ranked = pd.read_csv(io.StringIO(capsys.readouterr().out), dtype={"id": str})
    assert len(ranked) == 3 and set(ranked["id"]) <= set(s.covered_uids)
