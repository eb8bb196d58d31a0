"""`local-damage demo` and the default-model resolution shared by score, demo and app."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.conftest import REPO, run_cli


@pytest.mark.slow
def test_demo_scores_the_example_scene_end_to_end(tmp_path, score_model, capsys):
    import geopandas as gpd
    import rasterio
    from PIL import Image

    from data_prep.synthetic_scene import make_scene

    out = tmp_path / "demo"
    assert run_cli("demo", "--model", score_model, "--out", out, "--quiet") == 0
    err = capsys.readouterr().err
    assert "synthetic" in err
    assert "local-damage score --model" in err

    truth = make_scene(tmp_path / "truth")
    frame = gpd.read_file(out / "buildings.geojson")
    assert len(frame) == truth.n_buildings
    scored = frame[frame["status"] == "scored"]
    assert len(scored) == truth.covered
    assert set(scored["uid"]) == set(truth.covered_uids)
    assert frame.crs.to_epsg() == 4326
    with rasterio.open(out / "damage.tif") as src:
        classes = src.read(1)
        assert src.crs.to_epsg() == 32615
    present = set(np.unique(classes)) - {src.nodata}
    assert present and present <= {0, 1, 2, 3}
    assert Image.open(out / "overlay.png").size[0] > 0
    # the printed command reproduces the outputs with `score`
    command = next(line for line in err.splitlines() if "local-damage score" in line)
    argv = command.split("local-damage ", 1)[1].split()
    again = tmp_path / "again"
    again.mkdir()
    argv = [a.replace(str(out / "buildings"), str(again / "buildings")) for a in argv]
    argv = [a.replace(str(out / "damage"), str(again / "damage")) for a in argv]
    argv = [a.replace(str(out / "overlay"), str(again / "overlay")) for a in argv]
    assert run_cli(*argv, "--quiet") == 0
    first = json.loads((out / "buildings.geojson").read_text())["features"]
    second = json.loads((again / "buildings.geojson").read_text())["features"]
    assert [f["properties"]["damage"] for f in first] == [f["properties"]["damage"] for f in second]


def test_demo_without_a_model_says_how_to_get_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_cli("demo", "--model", tmp_path / "missing.onnx", "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "missing.onnx" in err


def test_default_model_prefers_default_onnx(tmp_path, score_model):
    from runtime.contract import ModelError
    from runtime.registry import default_model

    with pytest.raises(ModelError, match="no .onnx model"):
        default_model(tmp_path)
    shutil.copy(score_model, tmp_path / "a.onnx")
    assert default_model(tmp_path).name == "a.onnx"
    shutil.copy(score_model, tmp_path / "default.onnx")
    assert default_model(tmp_path).name == "default.onnx"


def test_score_uses_the_models_folder_of_the_working_directory(
    tmp_path, monkeypatch, score_model, synthetic_scene, capsys
):
    (tmp_path / "models").mkdir()
    shutil.copy(score_model, tmp_path / "models" / "default.onnx")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "b.geojson"
    code = run_cli(
        "score",
        "--pre",
        *synthetic_scene.pre,
        "--post",
        *synthetic_scene.post,
        "--buildings",
        synthetic_scene.buildings,
        "--out",
        out,
        "--quiet",
    )
    assert code == 0
    assert len(json.loads(out.read_text())["features"]) == synthetic_scene.n_buildings


BUNDLED = REPO / "models" / "default.onnx"


@pytest.mark.skipif(not BUNDLED.is_file(), reason=f"{BUNDLED} is not in this checkout")
def test_bundled_default_model_serves_the_app_examples(tmp_path):
    """The newcomer's first run: the shipped model loads, says where it comes from, and the
    app's examples (tile and chips) work with it at once."""
    from app.web.app import assess_chip, assess_tile, card_markdown, make_examples
    from runtime.predictor import Predictor
    from runtime.registry import default_model

    assert default_model(REPO / "models") == BUNDLED
    predictor = Predictor(BUNDLED)
    card = predictor.card()
    assert card["license"] == "CC BY-NC-SA 4.0"
    assert card["training_data"]["source"] == "xBD"
    assert card["precision"] == "int8" and predictor.has_change_map
    assert card["test_metrics"]["n"] > 0
    assert BUNDLED.stat().st_size < 25e6
    # it trained on every labelled tile: its test figures are its recipe's out-of-fold ones, on
    # its own training tiles, and the card says they are the recipe's cross-validation
    tested = card["test_metrics"]
    assert set(tested["tiles"]) <= set(card["training_data"]["train_tiles"])
    folds = len(tested["cross_validation"]["folds"])
    # its test figures are those of the grades it gives: under its own rule
    cost = float((card.get("grade_rule") or {}).get("false_alarm_cost", 1.0))
    assert float(tested["cross_validation"].get("false_alarm_cost", 1.0)) == cost
    rule = "" if cost == 1.0 else f"; graded at false-alarm cost {cost:g}, the model's own rule"
    assert (
        f"- its recipe cross-validated ({tested['n']} buildings, {len(tested['tiles'])} tiles, "
        f"{folds} folds; each building graded by a model of the same recipe that never saw its "
        f"tile, not by this model{rule})" in card_markdown(predictor)
    )
    # its temperature and ood threshold come from the folds, not from its training chips
    assert card["calibration"]["method"] == "raw"
    assert "out-of-fold" in card["calibration"]["fitted_on"]["selection"]
    carried = card["ood"]["threshold_from"]["rank_from_folds"]["folds"]
    assert carried
    assert (
        f"threshold carried over from {len(carried)} fold models, where it flagged 0.0100 of "
        "their held-out" in card_markdown(predictor)
    )

    examples = make_examples(tmp_path / "examples")
    pre, post, labels = examples["tile"][0]
    result = assess_tile(predictor, pre, post, labels, tmp_path / "session")
    assert len(result.rows) > 0 and sum(result.counts.values()) > 0
    assert result.overlay.is_file() and result.vector.is_file()
    for pre, post in examples["chip"]:
        chip = assess_chip(predictor, pre, post)
        assert sum(chip.probabilities.values()) == pytest.approx(1.0, abs=1e-4)
        assert chip.change_map is not None and np.isfinite(chip.change_map).all()


def test_demo_json_reports_what_it_wrote(tmp_path, score_model, capsys):
    import json

    import geopandas as gpd

    out = tmp_path / "demo"
    assert run_cli("demo", "--model", score_model, "--out", out, "--quiet", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    frame = gpd.read_file(out / "buildings.geojson")
    assert report["buildings"] == len(frame)
    assert report["scored"] == int((frame["status"] == "scored").sum())
    assert report["example_scene"] == str(out / "scene")
    assert report["command"].startswith("local-damage score --model")
