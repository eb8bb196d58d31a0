"""The ``misaligned`` flag end to end: a scene scored with its post image moved through its
transform (and the scene correction turned off) has its buildings flagged, the unmoved scene
does not, and the scene correction takes the flags away again; the same for a real xBD tile in
xBD mode with a moved post PNG."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.data_prep.test_alignment import _shifted_copies


def _flags(path) -> list[str]:
    import geopandas as gpd

    frame = gpd.read_file(path)
    frame = frame[frame["status"] == "scored"]
    assert len(frame) > 5
    return list(frame["flags"].fillna(""))


def _share(flags: list[str]) -> float:
    return float(np.mean(["misaligned" in f for f in flags]))


def test_a_scene_moved_by_12_pixels_is_flagged_misaligned(synthetic_scene, score_model, tmp_path):
    from app.scoring.common import ScoreOptions
    from app.scoring.scene import score_scene
    from runtime.predictor import Predictor

    s = synthetic_scene
    predictor = Predictor(score_model)
    moved = _shifted_copies([Path(p) for p in s.post], tmp_path / "post", 12, -9)
    off = ScoreOptions(progress=False, align="off")
    score_scene(predictor, s.pre, s.post, s.buildings, tmp_path / "ref.geojson", options=off)
    score_scene(predictor, s.pre, moved, s.buildings, tmp_path / "moved.geojson", options=off)
    ref, got = _share(_flags(tmp_path / "ref.geojson")), _share(_flags(tmp_path / "moved.geojson"))
    assert ref <= 0.05, ref
    assert got >= 0.8, got
    # with the scene correction on, the move is corrected and the flags go away again
    on = ScoreOptions(progress=False)
    score_scene(predictor, s.pre, moved, s.buildings, tmp_path / "fixed.geojson", options=on)
    assert _share(_flags(tmp_path / "fixed.geojson")) <= 0.05


@pytest.mark.realdata
def test_a_real_xbd_tile_with_a_moved_post_is_flagged_misaligned(tmp_path):
    """joplin-tornado_00000000 (its post lines up: median residual 0.4 px) scored in xBD mode as
    it is, and with its post image moved 9 px right and 8 px up (12 px): with the scene
    correction off the moved buildings are flagged, with it on the move is corrected."""
    import cv2

    from app.scoring.common import ScoreOptions
    from app.scoring.xbd import score_xbd
    from runtime.predictor import Predictor
    from tests.conftest import REPO, shared_data

    root = shared_data("xbd_sample")
    model = REPO / "models" / "default.onnx"
    name = "joplin-tornado_00000000"
    pre = root / "images" / f"{name}_pre_disaster.png"
    post = root / "images" / f"{name}_post_disaster.png"
    labels = root / "labels" / f"{name}_post_disaster.json"
    image = cv2.imread(str(post), cv2.IMREAD_UNCHANGED)
    move = np.float32([[1, 0, 9], [0, 1, -8]])
    moved = cv2.warpAffine(image, move, image.shape[1::-1], borderMode=cv2.BORDER_REFLECT)
    moved_path = tmp_path / post.name
    cv2.imwrite(str(moved_path), moved)
    predictor = Predictor(model)
    run = dict(options=ScoreOptions(progress=False, align="off"))
    score_xbd(predictor, pre, post, labels, tmp_path / "ref.gpkg", **run)
    score_xbd(predictor, pre, moved_path, labels, tmp_path / "moved.gpkg", **run)
    on = ScoreOptions(progress=False)
    score_xbd(predictor, pre, moved_path, labels, tmp_path / "fixed.gpkg", options=on)
    assert _share(_flags(tmp_path / "ref.gpkg")) <= 0.02
    assert _share(_flags(tmp_path / "moved.gpkg")) >= 0.95
    assert _share(_flags(tmp_path / "fixed.gpkg")) <= 0.02


def test_the_flaggers_context_limit_is_its_own():
    from runtime.flags import Flagger

    rng = np.random.default_rng(0)
    chip = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)
    assert Flagger(context_px=0.25).pair(chip, chip, context_px=0.5) == ["misaligned"]
    assert Flagger(misaligned_px=0.25).pair(chip, chip, context_px=0.5) == []
