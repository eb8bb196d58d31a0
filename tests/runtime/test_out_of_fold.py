"""A model trained on every labelled chip, calibrated from its recipe's cross-validation:
temperature on out-of-fold logits, ``ood`` threshold and scene reference carried over by rank."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cli.main import main
from runtime.calibration import CalibrationError, fit_temperature
from runtime.evaluation.out_of_fold import calibrate_from_folds, fold_ranks, read_oof_logits
from runtime.flags import class_prototypes, ood_scores

CLASSES = ["no-damage", "minor-damage", "major-damage", "destroyed"]


def _props(path: Path) -> dict:
    import onnx

    return {p.key: json.loads(p.value) for p in onnx.load(str(path)).metadata_props}


def _oof_csv(path: Path, t_true: float, n: int = 4000, seed: int = 0) -> Path:
    """Out-of-fold predictions whose labels are drawn from softmax(logits / t_true)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, size=(n, 4))
    p = np.exp(logits / t_true)
    p /= p.sum(1, keepdims=True)
    labels = np.array([rng.choice(4, p=row) for row in p])
    frame = pd.DataFrame(logits, columns=[f"logit_{c}" for c in CLASSES]).assign(label=labels)
    frame.to_csv(path, index=False)
    return path


@pytest.fixture(scope="module")
def embedded(score_model, chips):
    """``(chip ids, labels, z)`` of every labelled chip of the tiny store by the tiny model."""
    from runtime.evaluation.chips import select_chips
    from runtime.evaluation.scorers import OnnxScorer

    ids = select_chips(chips, None)[0]
    scored = OnnxScorer(score_model).score(chips, ids, views=1)
    return np.array(ids), scored.labels, scored.z.astype(np.float64)


def _fold_run(root: Path, ids, train_z, test_z) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    np.savez(
        root / "embeddings.npz",
        train_ids=ids,
        train_z=train_z.astype(np.float16),
        test_ids=ids[: len(test_z)],
        test_z=test_z.astype(np.float16),
    )
    return root


def test_ranks_are_the_quantiles_when_held_out_chips_look_like_training_chips(
    embedded, chips, tmp_path
):
    ids = embedded[0]
    z = np.random.default_rng(0).normal(size=(len(ids), 16))
    same = _fold_run(tmp_path / "same", ids, z, z)
    got = fold_ranks(chips, [same], 4, quantiles=(0.1, 0.5))
    # held-out familiarity equal to the training familiarity: a quantile keeps its rank
    assert got["ranks"] == pytest.approx([0.1, 0.5], abs=2.0 / len(ids))

    rng = np.random.default_rng(1)
    noisy = z + rng.normal(0, 3.0 * np.abs(z).mean(), size=z.shape)
    far = _fold_run(tmp_path / "far", ids, z, noisy)
    got_far = fold_ranks(chips, [far], 4, quantiles=(0.1, 0.5))
    # held-out chips less familiar than the training chips: their quantiles sit lower in the
    # training chips' familiarity, so the carried-over threshold flags less of them
    assert got_far["ranks"][1] < 0.5 - 0.1
    both = fold_ranks(chips, [same, far], 4, quantiles=(0.1, 0.5))
    assert both["ranks"] == pytest.approx(np.mean([got["ranks"], got_far["ranks"]], axis=0))
    assert [f["run"] for f in both["folds"]] == [str(same), str(far)]


def test_calibrate_from_folds_stores_the_oof_temperature_and_the_carried_threshold(
    score_model, chips, embedded, tmp_path
):
    from runtime.predictor import Predictor

    ids, labels, z = embedded
    oof = _oof_csv(tmp_path / "oof_predictions.csv", t_true=2.0)
    rng = np.random.default_rng(2)
    fold = _fold_run(tmp_path / "fold0", ids, z, z + rng.normal(0, np.abs(z).mean(), z.shape))
    out = tmp_path / "raw.onnx"
    got = calibrate_from_folds(score_model, chips, out, oof, [fold], temperature=False)

    props = _props(out)
    cal, ood = props["calibration"], props["ood"]
    assert cal == got["calibration"] and ood == got["ood"]
    logits, y = read_oof_logits(oof, CLASSES)
    assert cal["method"] == "raw" and cal["temperature"] == 1.0
    assert cal["fitted_temperature"] == pytest.approx(fit_temperature(logits, y), rel=1e-9)
    assert cal["fitted_temperature"] == pytest.approx(2.0, rel=0.15)
    assert cal["fitted_on"]["n"] == len(y) and cal["fitted_on"]["chips"] == str(oof)
    assert Predictor(out).temperature == 1.0

    # the threshold: the carried-over rank of the model's own training chips' familiarity,
    # prototypes from every labelled chip of the store
    ood_rank, scene_rank = fold_ranks(chips, [fold], 4)["ranks"]
    protos, _ = class_prototypes(z, labels, 4)
    own = ood_scores(z, protos)
    assert ood["threshold"] == pytest.approx(np.quantile(own, ood_rank), abs=1e-6)
    assert ood["scene"]["familiarity"] == pytest.approx(np.quantile(own, scene_rank), abs=1e-6)
    assert ood["threshold_from"]["rank_from_folds"]["ranks"] == [ood_rank, scene_rank]
    assert ood["threshold_from"]["n"] == len(ids)
    assert ood["scene"]["training_rank"] == pytest.approx(scene_rank, abs=1e-6)
    assert "0.1 quantile of held-out buildings'" in ood["scene"]["rule"]

    applied = tmp_path / "applied.onnx"
    calibrate_from_folds(score_model, chips, applied, oof, [fold], temperature=True)
    assert Predictor(applied).temperature == pytest.approx(cal["fitted_temperature"])


def test_bad_inputs_name_the_file_and_write_nothing(score_model, chips, embedded, tmp_path):
    ids, _, z = embedded
    oof = _oof_csv(tmp_path / "oof.csv", t_true=1.0, n=200)
    out = tmp_path / "out.onnx"
    empty = tmp_path / "no-embeddings"
    empty.mkdir()
    with pytest.raises(CalibrationError, match="no-embeddings/embeddings.npz: no fold embeddings"):
        calibrate_from_folds(score_model, chips, out, oof, [empty])
    short = tmp_path / "short.csv"
    pd.read_csv(oof).drop(columns=["logit_destroyed"]).to_csv(short, index=False)
    fold = _fold_run(tmp_path / "fold", ids, z, z)
    with pytest.raises(CalibrationError, match="short.csv: no column.*logit_destroyed"):
        calibrate_from_folds(score_model, chips, out, short, [fold])
    stranger = _fold_run(tmp_path / "stranger", np.array(["nowhere:1"] * len(z)), z, z)
    with pytest.raises(CalibrationError, match="not in .*give the chip store the folds"):
        calibrate_from_folds(score_model, chips, out, oof, [stranger])
    assert not out.exists()


@pytest.mark.slow
def test_export_out_of_fold(score_model, embedded, tmp_path, capsys):
    ids, _, z = embedded
    run = score_model.parent / "run"
    oof = _oof_csv(tmp_path / "oof.csv", t_true=1.5, n=1000)
    fold = _fold_run(tmp_path / "fold", ids, z, z)
    out = tmp_path / "model.onnx"
    base = ["export", "--run", str(run), "--out", str(out)]
    assert main([*base, "--oof-predictions", str(oof), "--oof-folds", str(fold)]) == 0
    text = capsys.readouterr().out
    assert "temperature T = " in text and "carried over as the" in text
    props = _props(out)
    assert props["calibration"]["method"] == "temperature scaling"
    assert props["ood"]["threshold_from"]["rank_from_folds"]["folds"][0]["run"] == str(fold)

    assert main([*base, "--oof-predictions", str(oof)]) == 2
    assert "--oof-predictions and --oof-folds go together" in capsys.readouterr().err
    # a fold run without embeddings is named before any export, and nothing is written
    bad, empty = tmp_path / "bad.onnx", tmp_path / "empty-fold"
    empty.mkdir()
    args = [*base[:-1], str(bad), "--oof-predictions", str(oof), "--oof-folds", str(empty)]
    assert main(args) == 2
    assert "empty-fold/embeddings.npz: no fold embeddings" in capsys.readouterr().err
    assert not bad.exists() and not bad.with_suffix(".parity.json").exists()
    both = [*base, "--oof-predictions", str(oof), "--oof-folds", str(fold), "--calibrate-fold"]
    assert main([*both, "0"]) == 2
    assert "not both" in capsys.readouterr().err
