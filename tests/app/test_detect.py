"""Scoring without footprints: the localiser runtime (runtime.localizer), its use by `score` (scene
and xBD modes), `demo` and the app, and the `source` column.

The localiser here is a real ONNX graph built with onnx.helper that carries the localiser
contract (uint8 ``image`` [N, H, W, 3] -> float ``building`` [N, H, W], metadata task
``localize``): a pixel is building when its channel mean is brighter than a level (a sigmoid of
the scaled difference). The scenes are bright rectangles (buildings) on dark ground, so the
buildings it should find are known.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.app.rects import (
    DAMAGE_MODEL,
    RECTS,
    draw,
    make_localizer,
)
from tests.conftest import REPO, run_cli


def no_bundled_localizer(monkeypatch, tmp_path):
    """This process sees no default localiser: no ./models and an empty bundled folder."""
    import runtime.registry

    empty = tmp_path / "no-models"
    empty.mkdir(exist_ok=True)
    monkeypatch.setattr(runtime.registry, "BUNDLED_MODELS", empty)
    monkeypatch.chdir(empty)


@pytest.fixture(scope="module")
def loc(tmp_path_factory) -> Path:
    return make_localizer(tmp_path_factory.mktemp("loc") / "localizer.onnx")


def _read(path: Path):
    import geopandas as gpd

    return gpd.read_file(path)


# --------------------------------------------------------------------------- the runtime


def test_localizer_reads_the_contract_and_refuses_other_models(loc, tmp_path):
    from runtime.contract import ModelError
    from runtime.localizer import Localizer
    from runtime.predictor import Predictor

    model = Localizer(loc)
    assert (model.tile_size, model.scale, model.threshold, model.min_area_px) == (64, 1.0, 0.5, 20)
    with pytest.raises(ModelError, match="damage model, not a building localiser"):
        Localizer(DAMAGE_MODEL)
    with pytest.raises(ModelError, match="not found"):
        Localizer(tmp_path / "missing.onnx")
    with pytest.raises(ModelError, match="not a building localiser"):
        Localizer(make_localizer(tmp_path / "other.onnx", task="segment"))
    with pytest.raises(ModelError, match="tile_size must be a multiple of 32"):
        Localizer(make_localizer(tmp_path / "odd.onnx", tile_size=50))
    # the damage-model loader says what a localiser is, and the model picker does not offer it
    with pytest.raises(ModelError, match="building localiser.*--localizer"):
        Predictor(loc)


def test_model_lists_leave_localizers_out(loc, tmp_path):
    import shutil

    from runtime.registry import default_model, list_models

    shutil.copy(loc, tmp_path / "localizer.onnx")
    shutil.copy(loc, tmp_path / "a-localizer.onnx")
    assert list_models(tmp_path) == []
    shutil.copy(DAMAGE_MODEL, tmp_path / "z.onnx")
    assert list_models(tmp_path) == [tmp_path / "z.onnx"]
    assert default_model(tmp_path) == tmp_path / "z.onnx"


@pytest.mark.parametrize(
    ("shape", "scale"), [((200, 150), 1.0), ((37, 300), 1.0), ((200, 150), 0.5)]
)
def test_predict_windows_stitch_without_seams(loc, tmp_path, shape, scale):
    """The fixture's answer is per pixel, so windows stitched right give the whole-image answer."""
    import cv2

    from runtime.localizer import Localizer

    model = Localizer(make_localizer(tmp_path / "l.onnx", scale=scale, tile_size=64))
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    prob = model.predict(image)
    assert prob.shape == shape and prob.dtype == np.float32
    # one window per runtime call (the default) or several: the same answer
    np.testing.assert_array_equal(model.predict(image, batch_size=3), prob)
    small = (
        image
        if scale == 1.0
        else cv2.resize(image, None, fx=scale, fy=scale, interpolation=cv2.INTER_AREA)
    )
    direct = 1 / (1 + np.exp(-0.2 * (small.astype(np.float32).mean(axis=2) - 150)))
    if scale == 1.0:
        np.testing.assert_allclose(prob, direct, atol=1e-5)
    else:
        back = cv2.resize(direct.astype(np.float32), shape[::-1], interpolation=cv2.INTER_LINEAR)
        np.testing.assert_allclose(prob, back, atol=1e-3)


def test_detect_finds_the_rectangles(loc):
    from runtime.localizer import Localizer

    polygons = Localizer(loc).detect(draw())
    assert len(polygons) == len(RECTS)
    truth = sorted((c1 - c0) * (r1 - r0) for c0, r0, c1, r1 in RECTS)
    assert sorted(p.area for p in polygons) == pytest.approx(truth, rel=0.1)
    mask = Localizer(loc).mask(draw())
    assert mask.dtype == bool and mask.sum() == sum(truth)


def test_scene_blocks_keep_each_building_once(loc, rect_scene):
    """Small blocks cut buildings at their edges; each is still found once and whole."""
    from data_prep.mosaic import open_scene
    from runtime.localizer import Localizer, detect_scene

    model = Localizer(loc)
    with open_scene([rect_scene["pre"]], [rect_scene["post"]]) as scene:
        whole = list(detect_scene(model, scene, block_size=1024, progress=False))
        blocks = list(detect_scene(model, scene, block_size=48, margin=48, progress=False))
    assert len(whole) == len(RECTS) == len(blocks)
    key = sorted((round(p.centroid.x, 3), round(p.centroid.y, 3), round(p.area, 3)) for p in whole)
    assert key == sorted(
        (round(p.centroid.x, 3), round(p.centroid.y, 3), round(p.area, 3)) for p in blocks
    )
    for truth in rect_scene["boxes"]:  # in the scene CRS, each over its true footprint
        best = max(whole, key=lambda p: p.intersection(truth).area)
        assert best.intersection(truth).area / best.union(truth).area > 0.85


# --------------------------------------------------------------------------- score


def test_score_scene_without_footprints(loc, rect_scene, tmp_path, capsys):
    out = tmp_path / "detected.geojson"
    code = run_cli(
        "score", "--pre", rect_scene["pre"], "--post", rect_scene["post"], "--localizer", loc,
        "--model", DAMAGE_MODEL, "--out", out, "--raster", tmp_path / "c.tif",
        "--overlay", tmp_path / "o.png", "--quiet",
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"{len(RECTS)} building(s) detected" in err
    df = _read(out)
    assert len(df) == len(RECTS)
    assert set(df["source"]) == {"detected"}
    assert set(df["status"]) == {"scored"}
    assert df["damage"].notna().all() and (df["confidence"] > 0).all()
    assert df["uid"].str.startswith("detected-").all()
    assert df.crs.to_epsg() == 4326
    assert (tmp_path / "c.tif").is_file() and (tmp_path / "o.png").is_file()


def test_score_with_footprints_says_given(loc, rect_scene, tmp_path):
    out = tmp_path / "given.gpkg"
    code = run_cli(
        "score", "--pre", rect_scene["pre"], "--post", rect_scene["post"],
        "--buildings", rect_scene["footprints"], "--model", DAMAGE_MODEL, "--out", out, "--quiet",
    )  # fmt: skip
    assert code == 0
    df = _read(out)
    assert set(df["source"]) == {"given"} and len(df) == len(RECTS)


def test_detected_and_given_grade_alike(loc, rect_scene, tmp_path):
    """Detected footprints close to the true ones are graded like them."""
    from app.scoring.common import ScoreOptions
    from app.scoring.detect import score_scene_detected
    from app.scoring.scene import score_scene
    from runtime.localizer import Localizer
    from runtime.predictor import Predictor

    predictor = Predictor(DAMAGE_MODEL)
    given = score_scene(
        predictor, [rect_scene["pre"]], [rect_scene["post"]], rect_scene["footprints"],
        tmp_path / "g.gpkg", options=ScoreOptions(progress=False),
    )  # fmt: skip
    found = score_scene_detected(
        predictor, [rect_scene["pre"]], [rect_scene["post"]], tmp_path / "d.gpkg",
        options=ScoreOptions(progress=False), localizer=Localizer(loc),
    )  # fmt: skip
    assert found.detected == len(RECTS) and given.detected is None
    assert found.to_dict()["detected"] == len(RECTS)
    g, d = _read(tmp_path / "g.gpkg"), _read(tmp_path / "d.gpkg")
    matched = 0
    for _, row in g.iterrows():
        best = d.geometry.intersection(row.geometry).area.idxmax()
        matched += d.loc[best, "damage"] == row["damage"]
    assert matched >= len(RECTS) - 1


def test_score_xbd_mode_without_labels(loc, rect_scene, tmp_path, capsys):
    out = tmp_path / "tile.gpkg"
    code = run_cli(
        "score", "--pre", rect_scene["pre_png"], "--post", rect_scene["post_png"],
        "--localizer", loc, "--model", DAMAGE_MODEL, "--out", out, "--quiet",
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    assert "scene rects_00000001" in err
    df = _read(out)
    assert len(df) == len(RECTS) and set(df["source"]) == {"detected"}
    assert set(df["status"]) == {"scored"} and df["damage"].notna().all()
    # pixel coordinates: the first rectangle's polygon lies on its pixels
    c0, r0, c1, r1 = RECTS[0]
    import shapely

    assert df.geometry.intersection(shapely.box(c0, r0, c1, r1)).area.max() > 0.9 * (c1 - c0) * (
        r1 - r0
    )
    # with the label file the same command marks the buildings given
    from app.scoring.common import ScoreOptions
    from app.scoring.xbd import score_xbd
    from runtime.predictor import Predictor

    labels = tmp_path / "rects_00000001_post_disaster.json"
    labels.write_text(
        json.dumps(
            {
                "features": {
                    "xy": [
                        {"properties": {"uid": f"b{i}"}, "wkt": shapely.box(*r).wkt}
                        for i, r in enumerate(RECTS)
                    ]
                }
            }
        )
    )
    score_xbd(
        Predictor(DAMAGE_MODEL), rect_scene["pre_png"], rect_scene["post_png"], labels,
        tmp_path / "given.gpkg", options=ScoreOptions(progress=False),
    )  # fmt: skip
    assert set(_read(tmp_path / "given.gpkg")["source"]) == {"given"}


def test_no_localizer_says_how_to_get_one(rect_scene, tmp_path, monkeypatch, capsys):
    no_bundled_localizer(monkeypatch, tmp_path)
    args = ["score", "--pre", rect_scene["pre"], "--post", rect_scene["post"]]
    args += ["--model", DAMAGE_MODEL, "--out", tmp_path / "x.geojson", "--quiet"]
    assert run_cli(*args) == 2
    err = capsys.readouterr().err
    assert "no building localiser model available" in err and "--localizer PATH" in err
    assert not (tmp_path / "x.geojson").exists()
    assert run_cli(*args, "--localizer", tmp_path / "nope.onnx") == 2
    assert "nope.onnx: localiser model file not found" in capsys.readouterr().err
    assert run_cli(*args, "--localizer", DAMAGE_MODEL) == 2
    assert "damage model, not a building localiser" in capsys.readouterr().err


def test_nothing_detected_is_a_clear_error(rect_scene, tmp_path, capsys):
    dark = make_localizer(tmp_path / "blind.onnx", level=300.0)  # nothing is that bright
    args = ["score", "--pre", rect_scene["pre"], "--post", rect_scene["post"], "--quiet"]
    args += ["--model", DAMAGE_MODEL, "--localizer", dark, "--out", tmp_path / "x.geojson"]
    assert run_cli(*args) == 2
    assert "found no building in the pre imagery" in capsys.readouterr().err


def test_demo_detect(loc, tmp_path, capsys):
    code = run_cli("demo", "--detect", "--localizer", loc, "--out", tmp_path, "--quiet")
    err = capsys.readouterr().err
    assert code == 0, err
    df = _read(tmp_path / "buildings.geojson")
    assert len(df) and set(df["source"]) == {"detected"}


# --------------------------------------------------------------------------- the app


def test_app_assesses_a_tile_without_footprints(loc, rect_scene, tmp_path):
    from app.web.app import assess_tile, building_chips, save_correction
    from runtime.localizer import Localizer
    from runtime.predictor import Predictor

    predictor, localizer = Predictor(DAMAGE_MODEL), Localizer(loc)
    for pre, post, kind in (
        (rect_scene["pre"], rect_scene["post"], "vector"),
        (rect_scene["pre_png"], rect_scene["post_png"], "xbd"),
    ):
        out = tmp_path / kind
        result = assess_tile(predictor, pre, post, None, out, localizer=localizer)
        assert result.mode == kind and result.buildings == len(RECTS)
        assert {r["status"] for r in result.rows} == {"scored"}
        assert all(r["uid"].startswith("detected-") for r in result.rows)
        assert "detected" in result.summary()
        assert set(_read(result.vector)["source"]) == {"detected"}
        assert {r["source"] for r in result.rows} == {"detected"}  # the app's table says so too
        pre_chip, post_chip = building_chips(predictor, result.session, 0)
        assert pre_chip.shape == post_chip.shape == (*(predictor.spec.chip_size,) * 2, 3)
        assert save_correction(result.session, 0, "destroyed").is_file()


def test_app_callback_detects_with_the_models_folder_localizer(
    loc, rect_scene, tmp_path, monkeypatch
):
    """The Assess button's function with no footprints uses models/localizer.onnx of the app's
    models folder; without one it says how to get one."""
    import shutil

    from app.web.app import build_app
    from app.web.assess import app_localizer
    from app.web.sessions import AppError

    no_bundled_localizer(monkeypatch, tmp_path)
    with pytest.raises(AppError, match="no building localiser model available"):
        app_localizer(tmp_path / "empty")
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(DAMAGE_MODEL, models / "default.onnx")
    shutil.copy(loc, models / "localizer.onnx")
    blocks, _ = build_app(models, work_dir=tmp_path / "work")
    assess = next(f for f in blocks.fns.values() if f.api_name == "assess_tile").fn
    model = str((models / "default.onnx").resolve())
    overlay, summary, table, files, session = assess(
        model, str(rect_scene["pre"]), str(rect_scene["post"]), None
    )
    assert f"**{len(RECTS)} buildings**" in summary and "detected" in summary
    assert len(table) == len(RECTS) and Path(overlay).is_file()
    assert set(_read(files[0])["source"]) == {"detected"}
    dropdown = next(b for b in blocks.blocks.values() if getattr(b, "elem_id", None) == "model")
    assert [c[1] for c in dropdown.choices] == [model]  # the localiser is not offered as a model


# --------------------------------------------------------------------------- score-batch


@pytest.mark.slow
def test_score_batch_detects_scenes_without_footprints(
    loc, rect_scene, tmp_path, monkeypatch, capsys
):
    csv = tmp_path / "scenes.csv"
    pre, post = rect_scene["pre"], rect_scene["post"]
    csv.write_text(
        "name,pre,post,buildings\n"
        f"given,{pre},{post},{rect_scene['footprints']}\n"
        f"found,{pre},{post},\n"
        f",{pre},{post},\n"  # no name, no footprints: named after its first pre file
    )
    out = tmp_path / "out"
    args = ["score-batch", "--scenes", csv, "--model", DAMAGE_MODEL, "--quiet"]
    assert run_cli(*args, "--out", out, "--localizer", loc) == 0
    summary = json.loads((out / "summary.json").read_text())
    by_name = {e["name"]: e for e in summary["scenes"]}
    assert not summary["problems"] and len(by_name) == 3
    (unnamed,) = set(by_name) - {"given", "found"}
    assert unnamed.endswith("scene_pre")
    assert by_name["found"]["report"]["detected"] == len(RECTS)
    assert by_name["given"]["report"]["detected"] is None
    assert set(_read(out / "given.geojson")["source"]) == {"given"}
    assert set(_read(out / "found.geojson")["source"]) == {"detected"}
    assert len(_read(by_name[unnamed]["outputs"]["vector"])) == len(RECTS)

    # no localiser at all: the scenes without footprints fail with the reason, the rest go on
    # (in this process, where the install is patched to have no bundled localiser)
    no_bundled_localizer(monkeypatch, tmp_path)
    capsys.readouterr()
    assert run_cli(*args, "--out", tmp_path / "out2", "--workers", "1") == 0
    summary = json.loads((tmp_path / "out2" / "summary.json").read_text())
    by_name = {e["name"]: e for e in summary["scenes"]}
    assert by_name["given"]["status"] == "scored"
    assert by_name["found"]["status"] == "failed"
    assert "no building localiser model available" in by_name["found"]["error"]
    assert "--localizer PATH" in capsys.readouterr().err


def test_scene_folder_without_footprints(rect_scene, tmp_path):
    import shutil

    from app.scoring.batch import read_scene_list

    for name, with_footprints in (("a", True), ("b", False)):
        folder = tmp_path / "scenes" / name
        for phase in ("pre", "post"):
            (folder / phase).mkdir(parents=True)
            shutil.copy(rect_scene[phase], folder / phase)
        if with_footprints:
            shutil.copy(rect_scene["footprints"], folder)
    jobs, problems = read_scene_list(tmp_path / "scenes")
    assert not problems and [j.name for j in jobs] == ["a", "b"]
    assert jobs[0].buildings.endswith("footprints.geojson") and jobs[1].buildings is None


@pytest.mark.slow
def test_footprint_free_scoring_runs_without_torch(loc, rect_scene, tmp_path):
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from runtime.localizer import Localizer\n"
        "from runtime.predictor import Predictor\n"
        "from app.scoring.common import ScoreOptions\n"
        "from app.scoring.detect import score_scene_detected\n"
        f"r = score_scene_detected(Predictor({str(DAMAGE_MODEL)!r}), [{str(rect_scene['pre'])!r}], "
        f"[{str(rect_scene['post'])!r}], {str(tmp_path / 'o.gpkg')!r}, "
        f"options=ScoreOptions(progress=False), localizer=Localizer({str(loc)!r}))\n"
        "assert r.detected and r.scored, r.summary()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
