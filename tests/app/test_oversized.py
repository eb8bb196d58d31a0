"""The ``oversized`` flag: a building the localiser found that is larger than any building it
learnt from (its metadata's ``largest_building_px``) is graded but flagged, in scene and xBD
modes and in the app; given footprints never are.

The synthetic scenes and the brightness localiser are those of ``tests/app/rects.py``; the
real case is the shipped localiser on the xBD tile where it takes a bank of cloud for one
building (models/localizer.md).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.app.rects import DAMAGE_MODEL, RECTS, RES, make_localizer
from tests.conftest import REPO, run_cli, shared_data

#: Between the areas of the test scene's rectangles (720-1,296 px): some above, some below.
LARGEST = 1100


@pytest.fixture(scope="module")
def capped_loc(tmp_path_factory):
    return make_localizer(
        tmp_path_factory.mktemp("capped") / "localizer.onnx", largest_building_px=LARGEST
    )


def _flagged_and_areas(path, pixel_size: float):
    """Whether each output building is flagged ``oversized``, its area in pixels of the scene
    (GeoJSON outputs measured in the scene's UTM zone) and the table."""
    import geopandas as gpd

    df = gpd.read_file(path)
    if df.crs is not None and df.crs.is_geographic:
        df = df.to_crs("EPSG:32615")
    flagged = df["flags"].fillna("").str.split(";").apply(lambda f: "oversized" in f)
    return flagged.to_numpy(), (df.geometry.area / pixel_size**2).to_numpy(), df


def test_localizer_reads_its_largest_building(capped_loc, tmp_path):
    from runtime.localizer import Localizer

    assert Localizer(capped_loc).largest_building_px == LARGEST
    assert Localizer(capped_loc).card()["largest_building_px"] == LARGEST
    plain = make_localizer(tmp_path / "plain.onnx")
    assert Localizer(plain).largest_building_px is None
    from runtime.contract import ModelError

    with pytest.raises(ModelError, match="largest_building_px"):
        Localizer(make_localizer(tmp_path / "bad.onnx", largest_building_px=-3))


@pytest.mark.parametrize("mode", ["scene", "xbd"])
def test_detections_larger_than_the_training_buildings_are_flagged(
    capped_loc, rect_scene, tmp_path, capsys, mode
):
    suffix = "" if mode == "scene" else "_png"
    out = tmp_path / "d.gpkg"
    code = run_cli(
        "score", "--pre", rect_scene["pre" + suffix], "--post", rect_scene["post" + suffix],
        "--localizer", capped_loc, "--model", DAMAGE_MODEL, "--out", out, "--quiet",
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    flagged, areas, df = _flagged_and_areas(out, RES if mode == "scene" else 1.0)
    assert len(df) == len(RECTS)
    # exactly the footprints over the limit, and both kinds are present
    assert (flagged == (areas > LARGEST)).all(), list(zip(flagged, areas, strict=True))
    assert 0 < flagged.sum() < len(df)
    assert f"{flagged.sum()} detected building(s) cover more than {LARGEST:,} px" in err
    # still graded: the flag asks for a check, it does not withhold the grade
    assert df["damage"].notna().all() and set(df["status"]) == {"scored"}
    # other flags keep their place before it
    from runtime.flags import FLAGS

    for text in df["flags"].fillna(""):
        names = [f for f in text.split(";") if f]
        assert names == sorted(names, key=FLAGS.index)


def test_given_footprints_and_unsaying_localizers_flag_nothing(rect_scene, tmp_path):
    from app.scoring.common import ScoreOptions
    from app.scoring.detect import score_scene_detected
    from app.scoring.scene import score_scene
    from runtime.localizer import Localizer
    from runtime.predictor import Predictor

    predictor = Predictor(DAMAGE_MODEL)
    tiny = ScoreOptions(progress=False, largest_building_px=1)  # every footprint is larger
    score_scene(
        predictor, [rect_scene["pre"]], [rect_scene["post"]], rect_scene["footprints"],
        tmp_path / "given.gpkg", options=tiny,
    )  # fmt: skip
    flagged, _, df = _flagged_and_areas(tmp_path / "given.gpkg", RES)
    assert set(df["source"]) == {"given"} and not flagged.any()
    plain = Localizer(make_localizer(tmp_path / "plain.onnx"))
    score_scene_detected(
        predictor, [rect_scene["pre"]], [rect_scene["post"]], tmp_path / "plain.gpkg",
        options=ScoreOptions(progress=False), localizer=plain,
    )  # fmt: skip
    flagged, _, df = _flagged_and_areas(tmp_path / "plain.gpkg", RES)
    assert set(df["source"]) == {"detected"} and not flagged.any()
    # the options' own limit wins over the localiser's
    report = score_scene_detected(
        predictor, [rect_scene["pre"]], [rect_scene["post"]], tmp_path / "all.gpkg",
        options=tiny, localizer=plain,
    )  # fmt: skip
    flagged, _, _ = _flagged_and_areas(tmp_path / "all.gpkg", RES)
    assert flagged.all() and any("flagged oversized" in n for n in report.notes)


def test_app_flags_oversized_detections(capped_loc, rect_scene, tmp_path):
    from app.web.assess import assess_tile
    from runtime.localizer import Localizer
    from runtime.predictor import Predictor

    result = assess_tile(
        Predictor(DAMAGE_MODEL), rect_scene["pre"], rect_scene["post"], None, tmp_path,
        localizer=Localizer(capped_loc),
    )  # fmt: skip
    flagged, areas, df = _flagged_and_areas(result.vector, RES)
    assert set(df["source"]) == {"detected"}
    assert (flagged == (areas > LARGEST)).all() and flagged.any()


@pytest.mark.realdata
def test_the_cloud_taken_for_a_building_is_flagged(tmp_path):
    """Guatemala-volcano 00000011 (the shipped localiser's test fold): the bank of cloud it finds
    as one 189,000 px building is flagged, the house-sized detections are not."""
    from runtime.localizer import load_localizer

    root = shared_data("xbd_sample")
    localizer = REPO / "models" / "localizer.onnx"
    largest = load_localizer(localizer).largest_building_px
    assert largest is not None and 10_000 < largest < 100_000
    pre = root / "images" / "guatemala-volcano_00000011_pre_disaster.png"
    out = tmp_path / "gv.gpkg"
    code = run_cli(
        "score", "--pre", pre, "--post", str(pre).replace("_pre_", "_post_"),
        "--localizer", localizer, "--model", DAMAGE_MODEL, "--out", out, "--quiet",
    )  # fmt: skip
    assert code == 0
    flagged, areas, _ = _flagged_and_areas(out, 1.0)
    assert (flagged == (areas > largest)).all()
    assert flagged.sum() == 1 and areas[flagged][0] > 100_000
    assert np.median(areas[~flagged]) < 2_000
