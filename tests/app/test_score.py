"""`local-damage score`: per-building grades from an ONNX model on scenes and xBD tiles.

The model is the session's tiny exported model (``score_model`` in conftest.py: the real
make_xbd -> prepare_xbd -> train -> export pipeline). The large scenes of the memory measurement
come from ``data_prep.synthetic_scene.make_large_scene`` (see docs/scoring.md).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, run_cli, shared_data

CLASS_COLOURS_TOL = 3  # grey levels of blending/rounding in the overlay


@pytest.fixture(scope="module")
def scene_scored(tmp_path_factory, synthetic_scene, score_model):
    """The synthetic scene scored once through the CLI with GeoJSON, raster and overlay."""
    out = tmp_path_factory.mktemp("scored")
    s = synthetic_scene
    rc = run_cli(
        "score",
        "--pre",
        *s.pre,
        "--post",
        *s.post,
        "--buildings",
        s.buildings,
        "--model",
        score_model,
        "--out",
        out / "scene.geojson",
        "--raster",
        out / "scene.tif",
        "--overlay",
        out / "scene.png",
        "--batch-size",
        "5",
        "--block-size",
        "200",
        "--quiet",
    )
    assert rc == 0
    return out


def _probability_checks(df, class_names):
    from app.scoring.common import probability_columns

    cols = probability_columns(class_names)
    scored = df[df["status"] == "scored"]
    probs = scored[cols].to_numpy(dtype=float)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-4)
    np.testing.assert_allclose(scored["confidence"].to_numpy(float), probs.max(axis=1), atol=1e-6)
    ids = scored["damage_id"].to_numpy(dtype=float).astype(int)
    np.testing.assert_array_equal(ids, probs.argmax(axis=1))
    assert list(scored["damage"]) == [class_names[i] for i in ids]
    unscored = df[df["status"] != "scored"]
    assert unscored["damage"].isna().all()
    assert unscored[cols + ["confidence", "damage_id"]].isna().all().all()


def test_scene_geojson_statuses_and_probabilities(scene_scored, synthetic_scene, predictor):
    import geopandas as gpd

    s = synthetic_scene
    path = scene_scored / "scene.geojson"
    raw = json.loads(path.read_text())
    assert "crs" not in raw  # RFC 7946
    df = gpd.read_file(path)
    assert df.crs.to_epsg() == 4326
    assert len(df) == s.n_buildings
    status = dict(zip(df["uid"], df["status"], strict=True))
    assert {u for u, st in status.items() if st == "scored"} == set(s.covered_uids)
    assert sum(st == "not_covered" for st in status.values()) == s.not_covered
    _probability_checks(df, predictor.class_names)
    # the input's own `damage` attribute is kept under a new name, unchanged
    from pyogrio.raw import read

    meta, _, _, values = read(str(s.buildings))
    truth = dict(zip(values[list(meta["fields"]).index("uid")], values[1], strict=True))
    assert dict(zip(df["uid"], df["input_damage"], strict=True)) == truth
    # lon/lat order, inside the imagery
    west, south, east, north = s.lonlat_bounds
    scored = df[df["status"] == "scored"]
    minx, miny, maxx, maxy = scored.total_bounds
    assert west <= minx and maxx <= east and south <= miny and maxy <= north


def test_scene_with_test_time_augmentation(
    tmp_path, scene_scored, synthetic_scene, score_model, predictor
):
    """`score --tta flips`: the same buildings scored, each grade the mean over the flips (other
    probabilities than the plain run), and the GeoPackage's model metadata says so."""
    import geopandas as gpd
    import pyogrio

    from app.scoring.common import probability_columns

    s = synthetic_scene
    out = tmp_path / "tta.gpkg"
    argv = ["score", "--pre", *s.pre, "--post", *s.post, "--buildings", s.buildings]
    argv += ["--model", score_model, "--out", out, "--block-size", "200", "--quiet"]
    assert run_cli(*argv, "--tta", "flips") == 0
    tta = gpd.read_file(out).to_crs(4326)
    plain = gpd.read_file(scene_scored / "scene.geojson")
    assert list(tta["uid"]) == list(plain["uid"]) and list(tta["status"]) == list(plain["status"])
    _probability_checks(tta, predictor.class_names)
    cols = probability_columns(predictor.class_names)
    scored = tta["status"] == "scored"
    diff = np.abs(tta.loc[scored, cols].to_numpy(float) - plain.loc[scored, cols].to_numpy(float))
    assert diff.max() > 1e-3
    card = json.loads(pyogrio.read_info(out)["layer_metadata"]["local_damage_model"])
    assert card["tta"] == "flips"


def test_scene_raster_aligns_with_pre_grid(scene_scored, synthetic_scene):
    import geopandas as gpd
    import rasterio
    import shapely

    from data_prep.mosaic import open_scene

    s = synthetic_scene
    with open_scene(s.pre, s.post) as scene:
        grid = scene.grid
    with rasterio.open(scene_scored / "scene.tif") as ds:
        assert ds.crs == grid.crs
        assert ds.transform.almost_equals(grid.transform)
        assert (ds.width, ds.height) == (grid.width, grid.height)
        assert ds.nodata == 255
        assert ds.tags(ns="IMAGE_STRUCTURE").get("LAYOUT") == "COG"
        band = ds.read(1)
    df = gpd.read_file(scene_scored / "scene.geojson").to_crs(grid.crs)
    pixels = grid.to_pixels(df.geometry.to_numpy())
    inside = shapely.point_on_surface(pixels)
    rows = np.floor(shapely.get_y(inside)).astype(int)
    cols = np.floor(shapely.get_x(inside)).astype(int)
    seen_classes = set()
    for k, (st, r, c) in enumerate(zip(df["status"], rows, cols, strict=True)):
        if not (0 <= r < grid.height and 0 <= c < grid.width):
            continue
        if st == "scored":
            assert band[r, c] == int(df["damage_id"].iloc[k])
            seen_classes.add(int(band[r, c]))
        else:
            assert band[r, c] == 255
    assert seen_classes
    # every labelled pixel lies under some scored building
    assert (band != 255).sum() <= sum(p.area for p in pixels[df["status"] == "scored"]) + 50


def test_scene_overlay_colours_buildings(scene_scored, synthetic_scene):
    import cv2
    import geopandas as gpd
    import shapely

    from app.scoring.outputs import CLASS_COLOURS, mosaic_preview, overlay_size
    from data_prep.mosaic import open_scene

    s = synthetic_scene
    img = cv2.cvtColor(cv2.imread(str(scene_scored / "scene.png")), cv2.COLOR_BGR2RGB)
    with open_scene(s.pre, s.post) as scene:
        grid = scene.grid
        w, h = overlay_size(grid.width, grid.height)
        background = mosaic_preview(scene.post, grid, w, h)
    assert img.shape[1] == w and img.shape[0] > h  # the legend band lies below the image
    df = gpd.read_file(scene_scored / "scene.geojson").to_crs(grid.crs)
    scored = df[df["status"] == "scored"]
    centres = shapely.point_on_surface(grid.to_pixels(scored.geometry.to_numpy()))
    for cid, pt in zip(scored["damage_id"].astype(int), centres, strict=True):
        x, y = int(pt.x * w / grid.width), int(pt.y * h / grid.height)
        expected = 0.45 * np.array(CLASS_COLOURS[cid]) + 0.55 * background[y, x]
        assert np.abs(img[y, x] - expected).max() <= CLASS_COLOURS_TOL + 2


def test_gpkg_in_pre_grid_crs_matches_geojson(tmp_path, synthetic_scene, score_model):
    import geopandas as gpd

    s = synthetic_scene
    out = tmp_path / "scene.gpkg"
    assert (
        run_cli(
            "score",
            "--pre",
            *s.pre,
            "--post",
            *s.post,
            "--buildings",
            s.buildings_gpkg,
            "--model",
            score_model,
            "--out",
            out,
            "--quiet",
        )
        == 0
    )
    gp = gpd.read_file(out)
    assert gp.crs.to_epsg() == 32615
    source = gpd.read_file(s.buildings_gpkg).to_crs(32615)
    dist = gp.geometry.centroid.distance(source.geometry.centroid)
    assert float(dist.max()) < 0.01
    # the same buildings from a file in another CRS get the same grades
    gj = gpd.read_file(tmp_path.parent / "missing") if False else None  # noqa: F841
    ref = gpd.read_file(_geojson_of(tmp_path, s, score_model))
    a = gp.set_index("uid").sort_index()
    b = ref.set_index("uid").sort_index()
    assert list(a["status"]) == list(b["status"])
    np.testing.assert_allclose(
        a["p_destroyed"].to_numpy(float),
        b["p_destroyed"].to_numpy(float),
        atol=1e-3,
        equal_nan=True,
    )


def _geojson_of(tmp_path, s, model) -> Path:
    out = tmp_path / "ref.geojson"
    assert (
        run_cli(
            "score",
            "--pre",
            *s.pre,
            "--post",
            *s.post,
            "--buildings",
            s.buildings,
            "--model",
            model,
            "--out",
            out,
            "--quiet",
        )
        == 0
    )
    return out


def test_scene_chips_are_the_prepare_scene_chips(tmp_path, synthetic_scene, predictor):
    """Scoring grades exactly the chips `prepare scene` cuts with the model's chip spec."""
    import geopandas as gpd

    from app.scoring.common import ScoreOptions, probability_columns
    from app.scoring.scene import score_scene
    from data_prep.scene_store import prepare_scene
    from data_prep.store import ChipReader, read_manifest

    s = synthetic_scene
    report = score_scene(
        predictor,
        s.pre,
        s.post,
        s.buildings,
        tmp_path / "s.geojson",
        options=ScoreOptions(progress=False),
    )
    assert report.scored == s.covered and report.not_covered == s.not_covered
    prepare_scene(
        s.pre, s.post, s.buildings, tmp_path / "chips", spec=predictor.spec, progress=False
    )
    manifest = read_manifest(tmp_path / "chips")
    reader = ChipReader(tmp_path / "chips")
    pairs = [reader.pair(row) for _, row in manifest.iterrows()]
    expected = predictor.predict(np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs]))
    df = gpd.read_file(tmp_path / "s.geojson").set_index("uid")
    got = df.loc[list(manifest["uid"]), probability_columns(predictor.class_names)]
    np.testing.assert_allclose(got.to_numpy(float), expected.probabilities, atol=1e-5)


def _xbd_tile(root: Path, name: str = "synthetic-flood_00000000"):
    return (
        root / "images" / f"{name}_pre_disaster.png",
        root / "images" / f"{name}_post_disaster.png",
        root / "labels" / f"{name}_post_disaster.json",
    )


def test_xbd_labels_mode(tmp_path, synthetic_xbd, score_model, predictor):
    import geopandas as gpd

    from app.scoring.common import probability_columns
    from data_prep.store import ChipReader, read_manifest
    from data_prep.xbd import XbdOptions, prepare_xbd

    pre, post, labels = _xbd_tile(synthetic_xbd)
    out = tmp_path / "tile.geojson"
    rc = run_cli(
        "score",
        "--pre",
        pre,
        "--post",
        post,
        "--labels",
        labels,
        "--model",
        score_model,
        "--out",
        out,
        "--raster",
        tmp_path / "tile.tif",
        "--overlay",
        tmp_path / "tile.png",
        "--quiet",
    )
    assert rc == 0
    data = json.loads(labels.read_text())
    buildings = [
        f
        for f in data["features"]["xy"]
        if f["properties"].get("feature_type", "building") == "building"
    ]
    df = gpd.read_file(out)
    assert df.crs.to_epsg() == 4326
    assert len(df) == len(buildings)
    assert list(df["uid"]) == [f["properties"]["uid"] for f in buildings]
    # the building with broken WKT is kept, marked skipped; un-classified ones are graded
    skipped = df[df["status"].str.startswith("skipped")]
    assert len(skipped) == 1 and "invalid WKT" in skipped["status"].iloc[0]
    assert (df.loc[df["subtype"] == "un-classified", "status"] == "scored").all()
    _probability_checks(df, predictor.class_names)
    lonlat = {f["properties"]["uid"]: f["wkt"] for f in data["features"]["lng_lat"]}
    import shapely

    row = df[df["status"] == "scored"].iloc[0]
    ref = shapely.from_wkt(lonlat[row["uid"]])
    assert row.geometry.normalize().equals_exact(ref.normalize(), 1e-7)

    # the chips graded are those `prepare xbd` cuts with the same spec
    prepare_xbd(
        [synthetic_xbd], tmp_path / "chips", predictor.spec, XbdOptions(include_unclassified=True)
    )
    manifest = read_manifest(tmp_path / "chips")
    manifest = manifest[manifest["tile"] == "synthetic-flood_00000000"]
    reader = ChipReader(tmp_path / "chips")
    pairs = [reader.pair(r) for _, r in manifest.iterrows()]
    expected = predictor.predict(np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs]))
    got = df.set_index("uid").loc[list(manifest["uid"]), probability_columns(predictor.class_names)]
    np.testing.assert_allclose(got.to_numpy(float), expected.probabilities, atol=1e-5)

    import warnings

    import rasterio
    from rasterio.errors import NotGeoreferencedWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGeoreferencedWarning)
        with rasterio.open(pre) as img:
            size = (img.width, img.height)
        with rasterio.open(tmp_path / "tile.tif") as ds:
            assert (ds.width, ds.height) == size
            band = ds.read(1)
    xy = {f["properties"]["uid"]: shapely.from_wkt(f["wkt"]) for f in buildings[:3]}
    for uid, poly in xy.items():
        p = shapely.point_on_surface(poly)
        st = df.set_index("uid").loc[uid]
        if st["status"] == "scored":
            assert band[int(p.y), int(p.x)] == int(st["damage_id"])


def test_xbd_pre_label_and_pixel_gpkg(tmp_path, synthetic_xbd, score_model):
    """A pre-disaster label (no subtypes) works; a GeoPackage of a plain PNG is in pixels."""
    import geopandas as gpd

    pre, post, labels = _xbd_tile(synthetic_xbd)
    pre_label = labels.with_name(labels.name.replace("_post_", "_pre_"))
    out = tmp_path / "tile.gpkg"
    rc = run_cli(
        "score", "--pre", pre, "--post", post, "--labels", pre_label, "--model", score_model,
        "--out", out, "--quiet",
    )  # fmt: skip
    assert rc == 0
    df = gpd.read_file(out)
    assert df.crs is None
    scored = df[df["status"] == "scored"]
    assert len(scored) > 0
    minx, miny, maxx, maxy = scored.total_bounds
    assert minx >= -20 and maxx <= 1044 and miny >= -20 and maxy <= 1044  # pixel coordinates


def test_xbd_geojson_without_lnglat_is_refused(tmp_path, synthetic_xbd, score_model, capsys):
    pre, post, labels = _xbd_tile(synthetic_xbd)
    data = json.loads(labels.read_text())
    data["features"]["lng_lat"] = []
    stripped = tmp_path / "no_lnglat.json"
    stripped.write_text(json.dumps(data))
    out = tmp_path / "tile.geojson"
    rc = run_cli(
        "score", "--pre", pre, "--post", post, "--labels", stripped, "--model", score_model,
        "--out", out, "--raster", tmp_path / "t.tif", "--quiet",
    )  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert str(stripped) in err and ".gpkg" in err
    assert list(tmp_path.iterdir()) == [stripped]  # nothing else written, no temporaries


@pytest.mark.slow
def test_scoring_does_not_import_torch(tmp_path, synthetic_scene, score_model):
    """`local-damage score` runs on a machine without PyTorch: nothing on its path imports it."""
    s = synthetic_scene
    code = (
        "import sys\n"
        "from cli.main import main\n"
        "rc = main(sys.argv[1:])\n"
        "print('TORCH', 'torch' in sys.modules, 'RC', rc)\n"
    )
    argv = [sys.executable, "-c", code, *map(str, _score_argv(s, score_model, tmp_path / "o.gpkg"))]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)
    assert "TORCH False RC 0" in done.stdout, done.stdout + done.stderr[-2000:]


# ------------------------------------------------------------------------------ bad input


def _score_argv(s, model, out, buildings=None, post=None):
    return [
        "score",
        "--pre",
        *s.pre,
        "--post",
        *(post or s.post),
        "--buildings",
        buildings or s.buildings,
        "--model",
        model,
        "--out",
        out,
        "--quiet",
    ]


def test_model_that_is_not_onnx(tmp_path, synthetic_scene, capsys):
    bad = tmp_path / "model.onnx"
    bad.write_text("not a model")
    rc = run_cli(*_score_argv(synthetic_scene, bad, tmp_path / "o.geojson"))
    assert rc == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "ONNX" in err
    assert not (tmp_path / "o.geojson").exists()


def test_model_without_metadata(tmp_path, synthetic_scene, score_model, capsys):
    import onnx

    proto = onnx.load(str(score_model))
    del proto.metadata_props[:]
    bare = tmp_path / "bare.onnx"
    onnx.save(proto, str(bare))
    rc = run_cli(*_score_argv(synthetic_scene, bare, tmp_path / "o.geojson"))
    assert rc == 2
    err = capsys.readouterr().err
    assert str(bare) in err and "metadata" in err
    assert not (tmp_path / "o.geojson").exists()


def test_images_without_overlap(tmp_path, synthetic_scene, score_model, capsys):
    import rasterio
    from affine import Affine

    src = synthetic_scene.post[0]
    moved = tmp_path / "post_far.tif"
    shutil.copyfile(src, moved)
    with rasterio.open(moved, "r+") as ds:
        t = ds.transform
        ds.transform = Affine(t.a, t.b, t.c + 1.0, t.d, t.e, t.f)  # one degree east
    rc = run_cli(*_score_argv(synthetic_scene, score_model, tmp_path / "o.geojson", post=[moved]))
    assert rc == 2
    err = capsys.readouterr().err
    assert "do not overlap" in err and str(moved) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["post_far.tif"]


def test_empty_and_outside_footprints(tmp_path, synthetic_scene, score_model, capsys):
    empty = tmp_path / "empty.geojson"
    empty.write_text('{"type": "FeatureCollection", "features": []}\n')
    rc = run_cli(*_score_argv(synthetic_scene, score_model, tmp_path / "o.geojson", empty))
    assert rc == 2
    assert str(empty) in capsys.readouterr().err
    assert not (tmp_path / "o.geojson").exists()

    from data_prep.synthetic_scene import make_bad_scene_inputs

    bad = make_bad_scene_inputs(tmp_path / "bad", synthetic_scene)
    rc = run_cli(*_score_argv(synthetic_scene, score_model, tmp_path / "o.geojson", bad.outside))
    assert rc == 2
    err = capsys.readouterr().err
    assert str(bad.outside) in err and "overlaps" in err
    assert not (tmp_path / "o.geojson").exists()

    # the footprint file is read once, for the buildings and their attributes: its errors still
    # name it and leave nothing written
    missing = tmp_path / "missing.geojson"
    for path, words in ((bad.unreadable, "cannot be read"), (missing, "not found")):
        rc = run_cli(*_score_argv(synthetic_scene, score_model, tmp_path / "o.geojson", path))
        assert rc == 2
        err = capsys.readouterr().err
        assert str(path) in err and words in err
        assert not (tmp_path / "o.geojson").exists()


def test_bad_output_names_are_refused_before_work(tmp_path, synthetic_scene, capsys):
    unread = tmp_path / "unread.onnx"  # never opened: the outputs are refused first
    unread.write_text("not a model")
    rc = run_cli(*_score_argv(synthetic_scene, unread, tmp_path / "o.shp"))
    assert rc == 2
    assert ".geojson or .gpkg" in capsys.readouterr().err
    argv = _score_argv(synthetic_scene, unread, tmp_path / "o.geojson")
    rc = run_cli(*argv, "--overlay", tmp_path / "o.jpg")
    assert rc == 2
    assert "PNG" in capsys.readouterr().err


def test_failed_scene_leaves_no_outputs(tmp_path, synthetic_scene, predictor, monkeypatch):
    """A failure after the raster is written removes it: a scene's outputs are all or nothing."""
    import app.scoring.outputs
    from app.scoring.common import ScoreOptions
    from app.scoring.scene import score_scene
    from app.scoring.writer import OutputPaths

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(app.scoring.outputs, "write_overlay", broken)
    s = synthetic_scene
    with pytest.raises(OSError, match="disk full"):
        score_scene(
            predictor,
            s.pre,
            s.post,
            s.buildings,
            OutputPaths(tmp_path / "o.geojson", tmp_path / "o.tif", tmp_path / "o.png"),
            options=ScoreOptions(progress=False),
        )
    assert list(tmp_path.iterdir()) == []


def test_scene_reads_its_footprint_file_once(tmp_path, synthetic_scene, predictor, monkeypatch):
    """The buildings and the attributes written out come from one read of the footprint file."""
    import pyogrio.raw

    from app.scoring.common import ScoreOptions
    from app.scoring.scene import score_scene

    reads = []
    read = pyogrio.raw.read

    def counted(path, *args, **kwargs):
        reads.append(str(path))
        return read(path, *args, **kwargs)

    monkeypatch.setattr(pyogrio.raw, "read", counted)
    s = synthetic_scene
    out = tmp_path / "o.geojson"
    score_scene(predictor, s.pre, s.post, s.buildings, out, options=ScoreOptions(progress=False))
    assert reads == [str(s.buildings)]
    features = json.loads(out.read_text())["features"]
    assert len(features) == s.n_buildings
    assert {f["properties"]["uid"] for f in features} >= set(s.covered_uids)


def test_small_scene_is_read_once_and_timed_as_read(
    tmp_path, synthetic_scene, predictor, monkeypatch
):
    """A scene whose buildings share one read: pre and post are each read once (the alignment
    blocks and the chips are cut from it), and its seconds are the ``read`` stage's."""
    from app.scoring.common import ScoreOptions
    from app.scoring.scene import score_scene
    from data_prep.mosaic import Mosaic

    reads = []
    read = Mosaic.read

    def counted(self, *args, **kwargs):
        reads.append(args)
        time.sleep(0.25)  # a slow disk: its seconds must land in "read"
        return read(self, *args, **kwargs)

    monkeypatch.setattr(Mosaic, "read", counted)
    s = synthetic_scene
    options = ScoreOptions(progress=False, profile=True)
    report = score_scene(
        predictor, s.pre, s.post, s.buildings, tmp_path / "o.geojson", options=options
    )
    assert not report.alignment["applied"]
    assert len(reads) == 2 and reads[0] == reads[1]  # pre and post, the same window
    assert report.stages["read"] >= 0.5 > report.stages["align"] > 0


# ------------------------------------------------------------------------------ real data


@pytest.mark.realdata
def test_joplin_geotiff(tmp_path, score_model, predictor):
    import geopandas as gpd
    import rasterio
    import shapely

    from data_prep.mosaic import open_scene

    root = shared_data("joplin_geotiff")
    pre = sorted((root / "pre").glob("*.tif"))
    post = sorted((root / "post").glob("*.tif"))
    footprints = root / "footprints" / "joplin.geojson"
    out = tmp_path / "joplin.gpkg"
    rc = run_cli(
        "score", "--pre", *pre, "--post", *post, "--buildings", footprints, "--model",
        score_model, "--out", out, "--raster", tmp_path / "joplin.tif", "--quiet",
    )  # fmt: skip
    assert rc == 0
    df = gpd.read_file(out)
    source = gpd.read_file(footprints)
    assert len(df) == len(source)
    counts = df["status"].value_counts()
    assert counts.get("scored", 0) > 100 and counts.get("not_covered", 0) > 100
    _probability_checks(df, predictor.class_names)
    with open_scene(pre, post) as scene:
        grid, coverage = scene.grid, scene.coverage
    assert df.crs == grid.crs
    scored = df[df["status"] == "scored"]
    assert shapely.contains(coverage.buffer(grid.res), scored.geometry.to_numpy()).all()
    with rasterio.open(tmp_path / "joplin.tif") as ds:
        assert ds.crs == grid.crs and ds.transform.almost_equals(grid.transform)
        assert (ds.width, ds.height) == (grid.width, grid.height)
        pts = shapely.point_on_surface(grid.to_pixels(scored.geometry.to_numpy()))
        rows, cols = (
            np.floor(shapely.get_y(pts)).astype(int),
            np.floor(shapely.get_x(pts)).astype(int),
        )
        band = ds.read(1)
    # overlapping footprints: the later one wins; most buildings show their own class
    agree = band[rows, cols] == scored["damage_id"].to_numpy(int)
    assert agree.mean() > 0.95


@pytest.mark.realdata
def test_puertorico_geotiff(tmp_path, score_model, predictor):
    import geopandas as gpd
    import rasterio
    import shapely

    from data_prep.synthetic_scene import write_footprints

    root = shared_data("puertorico_geotiff")
    pre, post = root / "pre" / "tile_0_107.tif", root / "post" / "tile_0_107.tif"
    with rasterio.open(pre) as ds:
        left, bottom, right, top = ds.bounds
        crs = ds.crs.to_string()
    side = right - left
    boxes = [
        shapely.box(left + f * side, bottom + g * side, left + f * side + 12, bottom + g * side + 9)
        for f, g in ((0.2, 0.2), (0.5, 0.5), (0.7, 0.3), (0.3, 0.8))
    ]
    boxes.append(shapely.box(right + 50, bottom, right + 60, bottom + 10))  # outside the imagery
    fp = write_footprints(
        tmp_path / "fp.geojson",
        np.array(boxes, dtype=object),
        crs,
        {"uid": np.array([f"pr{i}" for i in range(len(boxes))], dtype=object)},
        "GeoJSON",
    )
    out = tmp_path / "pr.geojson"
    rc = run_cli(
        "score", "--pre", pre, "--post", post, "--buildings", fp, "--model", score_model,
        "--out", out, "--overlay", tmp_path / "pr.png", "--quiet",
    )  # fmt: skip
    assert rc == 0
    df = gpd.read_file(out)
    assert list(df["status"]) == ["scored"] * 4 + ["not_covered"]
    _probability_checks(df, predictor.class_names)
    back = df.geometry.iloc[:4].to_crs(crs)
    dist = back.centroid.distance(gpd.GeoSeries(boxes[:4], crs=crs).centroid)
    assert float(dist.max()) < 0.01  # metres
    assert (tmp_path / "pr.png").stat().st_size > 0


# ------------------------------------------------------------------------------ memory


_MEASURE = """
import sys, time
from cli.main import main
start = time.perf_counter()
rc = main(sys.argv[1:])
seconds = time.perf_counter() - start
hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]
print(f'PEAK_KB {hwm} SECONDS {seconds:.2f} RC {rc}')
"""


def measure_score(scene: Path, model: Path, out: Path) -> tuple[float, float]:
    """Peak RSS (MB) and seconds of `local-damage score` with raster and overlay, in a subprocess."""
    argv = [
        sys.executable, "-c", _MEASURE, "score",
        "--pre", scene / "pre" / "pre.tif", "--post", scene / "post" / "post.tif",
        "--buildings", scene / "buildings.geojson", "--model", model,
        "--out", out / f"{scene.name}.gpkg", "--raster", out / f"{scene.name}.tif",
        "--overlay", out / f"{scene.name}.png", "--quiet",
    ]  # fmt: skip
    done = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, cwd=REPO, check=False
    )
    line = [x for x in done.stdout.splitlines() if x.startswith("PEAK_KB")]
    assert line, done.stderr[-2000:]
    parts = line[0].split()
    assert parts[5] == "0", done.stderr[-2000:]
    return int(parts[1]) / 1024.0, float(parts[3])


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_scene_size(tmp_path, score_model):
    """2000 x 2000 vs 8000 x 8000 px at the same building density (16x the pixels and buildings)."""
    import geopandas as gpd

    from data_prep.synthetic_scene import make_large_scene

    results = {}
    for size in (2000, 8000):
        scene = tmp_path / f"large{size}"
        n = make_large_scene(scene, size)
        peak, seconds = measure_score(scene, score_model, tmp_path)
        results[size] = (n, peak, seconds)
    print()
    print("| scene (px) | buildings | peak RSS (MB) | seconds |")
    print("|---|---|---|---|")
    for size, (n, peak, seconds) in results.items():
        print(f"| {size} x {size} | {n} | {peak:.0f} | {seconds:.1f} |")
    small, large = results[2000][1], results[8000][1]
    assert large - small < 64, results  # MB
    # both runs did the work: every building of each scene graded (16x the buildings in the large
    # one), and the peaks are those of a real scoring process (measured 491 and 512 MB; over
    # 100 MB), not of a run that failed early
    assert results[8000][0] >= 15 * results[2000][0] > 0
    for size, (n, peak, _) in results.items():
        frame = gpd.read_file(tmp_path / f"large{size}.gpkg")
        assert len(frame) == n and (frame["status"] == "scored").all(), size
        assert 100 < peak < 4096, results


def _a_cost_that_moves_grades(scene_scored, predictor):
    """``(plain, probability columns, scored mask, p, cost)`` of the fixture scene graded with
    the most probable grade, and a cost (6 significant digits) that turns some of its damaged
    grades to no-damage but not all."""
    import geopandas as gpd

    from app.scoring.common import probability_columns

    plain = gpd.read_file(scene_scored / "scene.geojson")
    cols = probability_columns(predictor.class_names)
    scored = (plain["status"] == "scored").to_numpy()
    p = plain.loc[scored, cols].to_numpy(float)
    damaged = p.argmax(axis=1) > 0
    assert damaged.sum() >= 2, "the tiny model grades too few buildings damaged to test the rule"
    ratio = np.sort(np.delete(p[damaged], 0, axis=1).max(axis=1) / p[damaged, 0])
    cost = np.sqrt(ratio[0] * ratio[-1]) if ratio[0] < ratio[-1] else ratio[0] * 2
    return plain, cols, scored, p, float(f"{cost:.6g}")


def test_false_alarm_cost_moves_grades_not_probabilities(
    tmp_path, scene_scored, synthetic_scene, score_model, predictor
):
    """`score --false-alarm-cost C`: the same probabilities, each grade the one of least expected
    cost (runtime.grading), and the GeoPackage says which rule gave them."""
    import geopandas as gpd
    import pyogrio

    from app.scoring.common import GRADES_KEY
    from runtime.grading import grades

    plain, cols, scored, p, cost = _a_cost_that_moves_grades(scene_scored, predictor)
    s = synthetic_scene
    out = tmp_path / "costly.gpkg"
    argv = ["score", "--pre", *s.pre, "--post", *s.post, "--buildings", s.buildings]
    argv += ["--model", score_model, "--out", out, "--block-size", "200", "--quiet"]
    assert run_cli(*argv, "--false-alarm-cost", f"{cost:.6g}") == 0
    costly = gpd.read_file(out).to_crs(4326)
    assert list(costly["status"]) == list(plain["status"])
    assert np.allclose(costly.loc[scored, cols].to_numpy(float), p, atol=1e-6)
    want = grades(p, predictor.class_names, float(f"{cost:.6g}"))
    assert list(costly.loc[scored, "damage_id"]) == list(want)
    assert (want != p.argmax(axis=1)).any() and (want == 0).sum() > (p.argmax(axis=1) == 0).sum()
    meta = pyogrio.read_info(out)["layer_metadata"]
    assert json.loads(meta[GRADES_KEY])["false_alarm_cost"] == pytest.approx(cost, rel=1e-5)
    assert GRADES_KEY not in (
        pyogrio.read_info(scene_scored / "scene.geojson").get("layer_metadata") or {}
    )


def _with_grade_rule(model, out, block):
    import onnx

    from runtime.contract import save_onnx, set_metadata

    proto = onnx.load(str(model))
    set_metadata(proto, {"grade_rule": block})
    return save_onnx(proto, out)


def test_the_models_own_grade_rule_is_the_default(
    tmp_path, scene_scored, synthetic_scene, score_model, predictor
):
    """A model whose card carries a grade rule (metadata ``grade_rule``, written by `export`)
    grades with it when the analyst sets no cost, says so, and yields to an explicit cost."""
    import geopandas as gpd
    import pyogrio

    from app.scoring.common import GRADES_KEY
    from runtime.grading import grades
    from runtime.predictor import Predictor

    plain, cols, scored, p, cost = _a_cost_that_moves_grades(scene_scored, predictor)
    own = _with_grade_rule(score_model, tmp_path / "own.onnx", {"false_alarm_cost": cost})
    assert Predictor(own).false_alarm_cost == pytest.approx(cost)
    assert Predictor(score_model).false_alarm_cost == 1.0  # no rule: the most probable grade
    s = synthetic_scene
    argv = ["score", "--pre", *s.pre, "--post", *s.post, "--buildings", s.buildings]
    argv += ["--model", own, "--block-size", "200", "--quiet"]
    assert run_cli(*argv, "--out", tmp_path / "own.gpkg") == 0
    graded = gpd.read_file(tmp_path / "own.gpkg")
    want = grades(p, predictor.class_names, cost)
    assert (want != p.argmax(axis=1)).any()
    assert list(graded.loc[scored, "damage_id"]) == list(want)
    rule = json.loads(pyogrio.read_info(tmp_path / "own.gpkg")["layer_metadata"][GRADES_KEY])
    assert rule["set_by"] == "model" and rule["false_alarm_cost"] == pytest.approx(cost)
    # the analyst's cost wins: 1 gives the most probable grade again, and no rule is recorded
    assert run_cli(*argv, "--out", tmp_path / "plain.gpkg", "--false-alarm-cost", "1") == 0
    again = gpd.read_file(tmp_path / "plain.gpkg")
    assert list(again.loc[scored, "damage_id"]) == list(p.argmax(axis=1))
    meta = pyogrio.read_info(tmp_path / "plain.gpkg").get("layer_metadata") or {}
    assert GRADES_KEY not in meta


@pytest.mark.parametrize("block", [{"false_alarm_cost": 0}, {"false_alarm_cost": "x"}, [2]])
def test_a_model_with_a_broken_grade_rule_is_refused(tmp_path, score_model, block):
    from runtime.contract import ModelError
    from runtime.predictor import Predictor

    bad = _with_grade_rule(score_model, tmp_path / "bad.onnx", block)
    with pytest.raises(ModelError, match=r"bad\.onnx.*grade_rule"):
        Predictor(bad)
