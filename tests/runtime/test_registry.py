"""The bundled models by name (``--model default``, ``--localizer localizer``) from any folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runtime.registry import BUNDLED_MODELS, model_names, resolve_model
from tests.conftest import REPO, run_cli

BUNDLED = REPO / "models"


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A working folder outside the project, without a models/ folder."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


def test_names_resolve_to_the_bundled_files_from_any_folder(elsewhere):
    assert BUNDLED_MODELS.resolve() == BUNDLED.resolve()
    assert {"default", "localizer"} <= set(model_names())
    for value in ("default", "default.onnx", "models/default.onnx"):
        assert resolve_model(value).resolve() == (BUNDLED / "default.onnx").resolve()
    assert resolve_model("localizer").resolve() == (BUNDLED / "localizer.onnx").resolve()


def test_a_path_that_exists_is_kept_as_given(elsewhere, score_model):
    shutil.copy(score_model, elsewhere / "default.onnx")
    # a file of that name here is the file meant, not the bundled one
    assert resolve_model("default.onnx") == Path("default.onnx")
    assert resolve_model(score_model) == score_model


def test_a_name_of_no_model_lists_the_names(elsewhere):
    from runtime.contract import ModelError

    with pytest.raises(ModelError) as info:
        resolve_model("defualt", kind="localiser model")
    text = str(info.value)
    assert text.startswith("defualt: localiser model file not found")
    assert "default" in text.split("names:")[1] and "localizer" in text.split("names:")[1]
    with pytest.raises(ModelError, match="no/such.onnx: model file not found"):
        resolve_model("no/such.onnx")


@pytest.mark.slow
def test_adapt_takes_the_bundled_model_by_name_elsewhere(elsewhere, score_model):
    chips = score_model.parent / "chips"
    for value in ("default", "models/default.onnx"):
        out = elsewhere / f"{value.replace('/', '-')}-adapted.onnx"
        code = run_cli("adapt", "--model", value, "--chips", chips, "--out", out, "--quiet")
        assert code == 0
        from runtime.predictor import Predictor

        block = Predictor(out).metadata["adaptation"]
        assert block["base_model"]["file"] == "default.onnx"


@pytest.mark.slow
def test_evaluate_xview2_and_calibrate_by_name_elsewhere(elsewhere, score_model, synthetic_xbd):
    from data_prep.synthetic import tile_name

    args = ["evaluate", "xview2", "--xbd", synthetic_xbd, "--tiles", tile_name(0), "--quiet"]
    assert run_cli(*args, "--model", "default", "--out", elsewhere / "x1") == 0
    first = json.loads((elsewhere / "x1" / "metrics.json").read_text())
    assert first["source"]["model"] == str(BUNDLED_MODELS / "default.onnx")
    # without --model: the bundled default too
    assert run_cli(*args, "--out", elsewhere / "x2") == 0
    second = json.loads((elsewhere / "x2" / "metrics.json").read_text())
    assert second["modes"] == first["modes"]
    chips = score_model.parent / "chips"
    out = elsewhere / "calibrated.onnx"
    args = ["calibrate", "--model", "default", "--chips", chips, "--fold", "0", "--out", out]
    assert run_cli(*args, "--no-ood", "--quiet") == 0
    assert out.is_file()


@pytest.mark.slow
def test_score_and_demo_by_name_elsewhere(elsewhere, synthetic_xbd, capsys):
    from data_prep.synthetic import tile_name

    name = tile_name(0)
    args = ["score", "--pre", synthetic_xbd / "images" / f"{name}_pre_disaster.png"]
    args += ["--post", synthetic_xbd / "images" / f"{name}_post_disaster.png"]
    args += ["--labels", synthetic_xbd / "labels" / f"{name}_post_disaster.json", "--quiet"]
    assert run_cli(*args, "--model", "default", "--out", elsewhere / "a.geojson") == 0
    assert run_cli(*args, "--model", "nope", "--out", elsewhere / "b.geojson") == 2
    err = capsys.readouterr().err
    assert "nope: model file not found" in err and "default" in err.split("names:")[1]
    assert not (elsewhere / "b.geojson").exists()
    demo = ["demo", "--model", "default", "--detect", "--localizer", "localizer", "--quiet"]
    assert run_cli(*demo, "--out", elsewhere / "demo") == 0
    assert f"model: {BUNDLED_MODELS / 'default.onnx'}" in capsys.readouterr().err
