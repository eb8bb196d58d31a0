"""Whether a whole scene looks like the imagery the model learnt from (runtime.familiarity): the
reference `calibrate --scene-only` stores in the model, the verdict of scoring, and where the
analyst reads it (the command's summary, the outputs' metadata, score-batch, the app).

Real parts: the tiny exported model of the ``score_model`` fixture run by ONNX Runtime, its
synthetic chip store and scene; the reference is fitted by the command, then moved above or
below every building's familiarity to force each verdict.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_cli, shared_data


def test_the_verdict_follows_the_median_against_the_reference():
    from runtime.familiarity import MIN_BUILDINGS, judge_scene, scene_reference, scene_warning

    calibration = np.linspace(0.0, 1.0, 101)
    ref = scene_reference(calibration)
    assert ref["familiarity"] == pytest.approx(0.1)  # the 0.1 quantile
    # most buildings below the reference: unfamiliar, and the warning says what to do
    low = judge_scene(np.r_[np.full(8, 0.05), np.full(4, 0.9)], ref)
    assert low["unfamiliar"] is True and low["buildings"] == 12
    assert low["share_below"] == pytest.approx(8 / 12, abs=1e-6)
    text = scene_warning(low)
    assert text.startswith("grades uncertain on this imagery") and "adapt" in text
    assert "67% of its 12 scored buildings" in text
    # a minority below: familiar, no warning
    high = judge_scene(np.r_[np.full(4, 0.05), np.full(8, 0.9)], ref)
    assert high["unfamiliar"] is False and scene_warning(high) == ""
    # too few buildings to judge, NaN (unscored) ignored
    few = judge_scene(np.r_[np.full(MIN_BUILDINGS - 1, 0.0), np.full(5, np.nan)], ref)
    assert few["unfamiliar"] is None and few["buildings"] == MIN_BUILDINGS - 1
    assert scene_warning(few) == ""
    none = judge_scene(np.array([]), ref)
    assert none["median_familiarity"] is None and none["unfamiliar"] is None


def test_a_malformed_or_missing_reference_judges_nothing():
    from runtime.familiarity import reference_of

    assert reference_of(None) is None
    assert reference_of({"threshold": 0.1}) is None
    assert reference_of({"scene": {"familiarity": "x"}}) is None
    assert reference_of({"scene": {"familiarity": float("nan")}}) is None
    assert reference_of({"scene": {"familiarity": 0.2, "min_buildings": 0}}) is None
    assert reference_of({"scene": {"familiarity": 0.2}})["min_buildings"] == 10


@pytest.fixture(scope="module")
def referenced(score_model, tmp_path_factory) -> Path:
    """The fixture model calibrated on fold 0 of its chips: prototypes, the ood threshold and
    the scene reference, as `calibrate` stores them."""
    out = tmp_path_factory.mktemp("familiar") / "model.onnx"
    chips = score_model.parent / "chips"
    argv = ["calibrate", "--model", score_model, "--chips", chips, "--fold", "0"]
    assert run_cli(*argv, "--out", out, "--quiet") == 0
    return out


def _with_reference(model: Path, value: float, out: Path) -> Path:
    import onnx

    from runtime.contract import save_onnx, set_metadata
    from runtime.predictor import Predictor

    block = dict(Predictor(model).metadata["ood"])
    block["scene"] = {**block["scene"], "familiarity": value}
    proto = onnx.load(str(model))
    set_metadata(proto, {"ood": block})
    save_onnx(proto, out)
    return out


@pytest.mark.slow
def test_scene_only_adds_the_reference_and_changes_nothing_else(
    score_model, referenced, tmp_path, capsys
):
    """A model calibrated before scenes were judged gets the reference `calibrate` would have
    stored, and nothing else of it changes; a model without prototypes is refused by name."""
    import onnx

    from runtime.contract import save_onnx, set_metadata
    from runtime.familiarity import QUANTILE
    from runtime.predictor import Predictor

    full = Predictor(referenced).metadata["ood"]
    assert full["scene"]["quantile"] == QUANTILE and -1 <= full["scene"]["familiarity"] <= 1
    older = tmp_path / "older.onnx"
    proto = onnx.load(str(referenced))
    set_metadata(proto, {"ood": {k: v for k, v in full.items() if k != "scene"}})
    save_onnx(proto, older)
    chips = score_model.parent / "chips"
    out = tmp_path / "again.onnx"
    argv = ["calibrate", "--model", older, "--chips", chips, "--fold", "0", "--scene-only"]
    assert run_cli(*argv, "--out", out, "--quiet") == 0
    before, after = Predictor(older).metadata, Predictor(out).metadata
    assert {k for k in set(before) | set(after) if before.get(k) != after.get(k)} == {"ood"}
    assert {k: v for k, v in after["ood"].items() if k != "scene"} == before["ood"]
    assert after["ood"]["scene"]["familiarity"] == pytest.approx(full["scene"]["familiarity"])
    assert after["ood"]["scene"]["fitted_on"]["fold"] == 0

    argv = ["calibrate", "--model", score_model, "--chips", chips, "--scene-only"]
    assert run_cli(*argv, "--out", tmp_path / "none.onnx", "--quiet") == 2
    assert "no ood prototypes" in capsys.readouterr().err
    assert not (tmp_path / "none.onnx").exists()

    # options --scene-only would ignore are refused by name, before any work
    argv = ["calibrate", "--model", older, "--chips", chips, "--scene-only", "--no-ood"]
    assert run_cli(*argv, "--out", tmp_path / "ignored.onnx", "--quiet") == 2
    assert "leave out --no-ood" in capsys.readouterr().err
    assert not (tmp_path / "ignored.onnx").exists()


@pytest.mark.slow
def test_flags_from_scores_given_equal_flags_from_embeddings(referenced):
    """Scoring hands the flagger the ood scores it computed for the familiarity: the same flags
    as the flagger computing them from the embeddings."""
    from runtime.flags import Flagger
    from runtime.predictor import Predictor

    flagger = Flagger(Predictor(referenced).metadata)
    rng = np.random.default_rng(0)
    z = rng.normal(size=(40, flagger.ood.prototypes.shape[1]))
    z[::3] = -flagger.ood.prototypes.sum(0)  # far from every prototype: ood
    pre = rng.integers(0, 255, (40, 32, 32, 3), dtype=np.uint8)
    post = rng.integers(0, 255, (40, 32, 32, 3), dtype=np.uint8)
    plain = flagger.batch(pre, post, z)
    given = flagger.batch(pre, post, z, ood_scores=flagger.ood.scores(z))
    assert given == plain and any("ood" in f for f in plain)


def _score(model, scene, out: Path, capsys) -> tuple[str, dict]:
    import pyogrio

    argv = ["score", "--pre", *scene.pre, "--post", *scene.post, "--buildings", scene.buildings]
    assert run_cli(*argv, "--model", model, "--out", out) == 0
    err = capsys.readouterr().err
    meta = pyogrio.read_info(out).get("layer_metadata") or {}
    return err, json.loads(meta["local_damage_familiarity"])


@pytest.mark.slow
def test_score_says_when_the_imagery_is_unlike_the_training_data(
    referenced, synthetic_scene, tmp_path, capsys
):
    strange = _with_reference(referenced, 1.01, tmp_path / "strange.onnx")  # above any cosine
    err, verdict = _score(strange, synthetic_scene, tmp_path / "strange.gpkg", capsys)
    assert verdict["unfamiliar"] is True and verdict["buildings"] >= 10
    assert verdict["share_below"] == 1.0 and verdict["reference_familiarity"] == 1.01
    assert "grades uncertain on this imagery" in err and "adapt" in err

    usual = _with_reference(referenced, -1.01, tmp_path / "usual.onnx")  # below any cosine
    err, verdict = _score(usual, synthetic_scene, tmp_path / "usual.gpkg", capsys)
    assert verdict["unfamiliar"] is False and verdict["share_below"] == 0.0
    assert "grades uncertain" not in err


def test_a_model_without_the_reference_reports_no_verdict(
    score_model, synthetic_scene, tmp_path, capsys
):
    import pyogrio

    s = synthetic_scene
    out = tmp_path / "plain.gpkg"
    argv = ["score", "--pre", *s.pre, "--post", *s.post, "--buildings", s.buildings]
    assert run_cli(*argv, "--model", score_model, "--out", out) == 0
    assert "grades uncertain" not in capsys.readouterr().err
    assert "local_damage_familiarity" not in (pyogrio.read_info(out).get("layer_metadata") or {})


@pytest.mark.slow
def test_score_batch_lists_the_unfamiliar_scenes(referenced, synthetic_scene, tmp_path, capsys):
    import shutil

    strange = _with_reference(referenced, 1.01, tmp_path / "strange.onnx")
    scenes = tmp_path / "scenes"
    for name in ("a", "b"):
        for sub, paths in (("pre", synthetic_scene.pre), ("post", synthetic_scene.post)):
            (scenes / name / sub).mkdir(parents=True)
            for p in paths:
                shutil.copy(p, scenes / name / sub / Path(p).name)
        shutil.copy(synthetic_scene.buildings, scenes / name / Path(synthetic_scene.buildings).name)
    argv = ["score-batch", "--scenes", scenes, "--out", tmp_path / "out", "--model", strange]
    assert run_cli(*argv, "--quiet") == 0
    err = capsys.readouterr().err
    assert "grades uncertain on the imagery of 2 scene(s)" in err and "a, b" in err


@pytest.mark.slow
def test_the_app_tells_the_analyst(referenced, score_model, tmp_path):
    from app.web.app import assess_tile
    from data_prep.synthetic import tile_name
    from runtime.predictor import Predictor

    xbd = score_model.parent / "xbd"
    name = tile_name(0)
    label = xbd / "labels" / f"{name}_post_disaster.json"
    pre = next((xbd / "images").glob(f"{name}_pre_disaster.*"))
    post = next((xbd / "images").glob(f"{name}_post_disaster.*"))
    strange = Predictor(_with_reference(referenced, 1.01, tmp_path / "strange.onnx"))
    result = assess_tile(strange, pre, post, label, tmp_path / "sessions" / "20260101-000001")
    assert "**Grades uncertain on this imagery**" in result.summary()
    usual = Predictor(_with_reference(referenced, -1.01, tmp_path / "usual.onnx"))
    result = assess_tile(usual, pre, post, label, tmp_path / "sessions" / "20260101-000002")
    assert "Grades uncertain" not in result.summary()


@pytest.mark.realdata
def test_the_bundled_model_finds_a_tile_of_a_known_event_familiar(tmp_path):
    """A Santa Rosa tile of an event the bundled model learnt (one of its training tiles) is
    familiar through the whole scoring path, with its median familiarity well above the
    reference."""
    import pyogrio

    from runtime.registry import default_model

    images = shared_data("xbd_extra") / "images"
    labels = shared_data("xbd_extra") / "labels"
    tile = "santa-rosa-wildfire_00000144"
    out = tmp_path / "tile.gpkg"
    argv = ["score", "--pre", images / f"{tile}_pre_disaster.png"]
    argv += ["--post", images / f"{tile}_post_disaster.png"]
    argv += ["--labels", labels / f"{tile}_post_disaster.json", "--out", out, "--quiet"]
    assert run_cli(*argv, "--model", default_model()) == 0
    verdict = json.loads(pyogrio.read_info(out)["layer_metadata"]["local_damage_familiarity"])
    assert verdict["unfamiliar"] is False and verdict["buildings"] >= 100
    assert verdict["median_familiarity"] > 2 * verdict["reference_familiarity"]
