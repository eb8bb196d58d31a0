"""Calibration: ECE / NLL / Brier by hand, temperature fitting, `calibrate`, and T in serving."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cli.main import main
from runtime.calibration import CalibrationError, fit_temperature, scaled_nll
from runtime.metrics import (
    brier_score,
    calibration_metrics,
    ece_sampling_floor,
    expected_calibration_error,
    negative_log_likelihood,
    reliability_bins,
)
from tests.conftest import REPO

#: Four predictions, each alone in its 15-bin confidence bin (0.9 -> bin 13, 0.62 -> 9,
#: 0.7 -> 10, 0.85 -> 12); the first and third are right.
PROBS = np.array([[0.9, 0.1], [0.62, 0.38], [0.3, 0.7], [0.15, 0.85]])
LABELS = np.array([0, 1, 1, 0])


def _softmax64(x: np.ndarray) -> np.ndarray:
    z = np.asarray(x, np.float64)
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _props(path: Path) -> dict:
    import onnx

    return {p.key: json.loads(p.value) for p in onnx.load(str(path)).metadata_props}


# --------------------------------------------------------------------------------------------
# metrics against hand-computed values


def test_ece_one_prediction_per_bin_is_the_mean_gap():
    # every bin holds one prediction: ECE = mean |correct - confidence|
    expected = (abs(1 - 0.9) + abs(0 - 0.62) + abs(1 - 0.7) + abs(0 - 0.85)) / 4  # 0.4675
    assert expected_calibration_error(PROBS, LABELS) == pytest.approx(expected, abs=1e-12)
    table = reliability_bins(PROBS, LABELS)
    assert len(table["count"]) == 15 and len(table["edges"]) == 16
    assert [i for i, c in enumerate(table["count"]) if c] == [9, 10, 12, 13]
    assert table["accuracy"][13] == 1.0 and table["accuracy"][12] == 0.0
    assert table["confidence"][9] == pytest.approx(0.62)
    assert table["accuracy"][0] is None and table["confidence"][0] is None


def test_ece_weighs_bins_by_their_share():
    # two bins: (0, 0.5] and (0.5, 1]. Bin 1 holds 0.9 right, 0.8 wrong, 0.6 right:
    # accuracy 2/3, confidence 0.7667, gap 0.1; bin 0 holds 0.5 (on the edge: lower bin), wrong.
    probs = [[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.5, 0.5]]
    labels = [0, 0, 0, 1]
    table = reliability_bins(probs, labels, bins=2)
    assert table["count"] == [1, 3]
    expected = 3 / 4 * abs(2 / 3 - (0.9 + 0.8 + 0.6) / 3) + 1 / 4 * abs(0 - 0.5)
    assert expected_calibration_error(probs, labels, bins=2) == pytest.approx(expected, abs=1e-12)


def test_nll_and_brier_by_hand():
    nll = -(math.log(0.9) + math.log(0.38) + math.log(0.7) + math.log(0.15)) / 4
    assert negative_log_likelihood(PROBS, LABELS) == pytest.approx(nll, abs=1e-12)
    # per row: 0.01 + 0.01, 0.62^2 + 0.62^2, 0.3^2 + 0.3^2, 0.85^2 + 0.85^2
    brier = (0.02 + 2 * 0.62**2 + 2 * 0.3**2 + 2 * 0.85**2) / 4
    assert brier_score(PROBS, LABELS) == pytest.approx(brier, abs=1e-12)
    m = calibration_metrics(PROBS, LABELS)
    assert m == pytest.approx({"ece": 0.4675, "nll": nll, "brier": brier, "accuracy": 0.5})


def test_perfect_and_uniform_predictions():
    onehot = np.eye(3)[[0, 2, 1, 1]]
    m = calibration_metrics(onehot, [0, 2, 1, 1])
    assert m["ece"] == 0.0 and m["brier"] == 0.0 and m["nll"] == pytest.approx(0.0, abs=1e-9)
    uniform = np.full((4, 4), 0.25)
    assert negative_log_likelihood(uniform, [0, 1, 2, 3]) == pytest.approx(math.log(4))
    assert brier_score(uniform, [0, 1, 2, 3]) == pytest.approx(3 * 0.25**2 + 0.75**2)
    # a zero probability on the true class is clipped, not infinite
    assert math.isfinite(negative_log_likelihood([[1.0, 0.0]], [1]))


def test_ece_floor_is_what_calibrated_predictions_measure_and_shrinks_with_n():
    """Labels drawn from the probabilities themselves (a calibrated model) measure an ECE around
    the floor; the same confidences with fewer right than they claim measure far above it."""
    rng = np.random.default_rng(3)
    for n in (100, 2000):
        probs = rng.dirichlet([0.6, 0.6, 0.6, 0.6], size=n)
        floor = ece_sampling_floor(probs)
        assert 0 < floor["mean"] < floor["p95"] and floor["draws"] == 200
        assert floor == ece_sampling_floor(probs)  # deterministic
        measured = [
            expected_calibration_error(probs, np.array([rng.choice(4, p=row) for row in probs]))
            for _ in range(20)
        ]
        assert 0.5 * floor["mean"] < np.mean(measured) < 1.5 * floor["mean"], (n, floor)
        wrong = probs.argmax(axis=1) + 1 + (rng.random(n) < 0.5)  # never the top class
        assert expected_calibration_error(probs, wrong % 4) > 3 * floor["p95"]
    small = ece_sampling_floor(rng.dirichlet([1, 1, 1, 1], size=100))["mean"]
    large = ece_sampling_floor(rng.dirichlet([1, 1, 1, 1], size=2000))["mean"]
    assert large < 0.5 * small  # about 1 / sqrt(n)
    assert ece_sampling_floor(np.eye(4))["mean"] == 0.0  # certain and right: no chance at all
    with pytest.raises(ValueError, match="non-empty"):
        ece_sampling_floor(np.zeros((0, 4)))


def test_metric_inputs_are_checked():
    with pytest.raises(ValueError, match="sum to 1"):
        expected_calibration_error([[0.5, 0.6]], [0])
    with pytest.raises(ValueError, match=r"class ids in \[0, 2\)"):
        brier_score(PROBS, [0, 1, 1, -1])
    with pytest.raises(ValueError, match="N = 4"):
        negative_log_likelihood(PROBS, [0, 1])


# --------------------------------------------------------------------------------------------
# fitting a temperature


def _synthetic(t_true: float, n: int = 20000, k: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=3.0, size=(n, k))
    p = _softmax64(logits / t_true)
    labels = (rng.random(n)[:, None] > np.cumsum(p, axis=1)).sum(axis=1)
    return logits, labels


@pytest.mark.parametrize("t_true", [0.5, 1.0, 2.5])
def test_fit_recovers_a_known_temperature(t_true):
    logits, labels = _synthetic(t_true)
    t = fit_temperature(logits, labels)
    assert t == pytest.approx(t_true, rel=0.05)
    # it is the minimum: the NLL is no lower a little either side, nor at the true T
    nll = scaled_nll(logits, labels, t)
    assert nll <= scaled_nll(logits, labels, t * 1.02) and nll <= scaled_nll(
        logits, labels, t / 1.02
    )
    assert nll <= scaled_nll(logits, labels, t_true) + 1e-9


def test_fit_tells_temperatures_apart():
    # the check above is not vacuous: labels drawn at T = 2.5 do not fit T = 1 or T = 2
    logits, labels = _synthetic(2.5)
    t = fit_temperature(logits, labels)
    assert t != pytest.approx(1.0, rel=0.05) and t != pytest.approx(2.0, rel=0.05)


def test_temperature_never_changes_the_argmax():
    rng = np.random.default_rng(1)
    logits = rng.normal(scale=4.0, size=(5000, 4)).astype(np.float32)
    from runtime.predictor import softmax

    for t in (0.05, 0.7, 1.0, 3.0, 50.0):
        np.testing.assert_array_equal(softmax(logits / np.float32(t)).argmax(1), logits.argmax(1))


def test_fit_fails_clearly_on_separable_or_uninformative_logits():
    rng = np.random.default_rng(2)
    labels = rng.integers(0, 4, 500)
    separable = np.eye(4)[labels] * 5.0  # always right: the NLL falls as T -> 0
    with pytest.raises(CalibrationError, match="T -> 0.*validation chips"):
        fit_temperature(separable, labels)
    noise = rng.normal(size=(500, 4))
    # logits that point away from the labels: the uniform distribution is best, T -> infinity
    with pytest.raises(CalibrationError, match="T -> infinity.*class order"):
        fit_temperature(noise - 3.0 * np.eye(4)[labels], labels)
    with pytest.raises(CalibrationError, match="unlabelled"):
        fit_temperature(noise[:3], [0, 1, -1])
    with pytest.raises(CalibrationError, match=r"\[N, K\]"):
        fit_temperature(np.zeros((0, 4)), np.zeros(0, int))
    with pytest.raises(CalibrationError, match="NaN"):
        fit_temperature(np.full((2, 4), np.nan), [0, 1])


# --------------------------------------------------------------------------------------------
# `local-damage calibrate` on a tiny exported model


@pytest.fixture(scope="module")
def calibrated(score_model, chips, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("calibrate") / "tiny.calibrated.onnx"
    args = ["calibrate", "--model", str(score_model), "--chips", str(chips), "--fold", "0"]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    return out


def _fold_chips(chips: Path, fold: int):
    from data_prep.split import fold_indices
    from data_prep.store import ChipReader, read_manifest

    ids = set(fold_indices(chips, fold)[1])
    frame = read_manifest(chips)
    records = frame[frame["chip_id"].isin(ids) & (frame["label"] >= 0)].to_dict("records")
    reader = ChipReader(chips)
    pairs = [reader.pair(r) for r in records]
    labels = np.array([r["label"] for r in records])
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs]), labels


def test_calibrate_writes_the_temperature_and_the_predictor_applies_it(
    calibrated, score_model, chips
):
    import onnxruntime as ort

    from runtime.predictor import Predictor

    block = _props(calibrated)["calibration"]
    t = block["temperature"]
    assert block["method"] == "temperature scaling" and t > 0 and t != 1.0
    pre, post, labels = _fold_chips(chips, 0)
    assert block["fitted_on"]["fold"] == 0 and block["fitted_on"]["n"] == len(labels)
    assert block["fitted_on"]["chips"] == str(chips)
    assert "calibration" not in _props(score_model)  # the input model is left as it was

    # the fitted T is the minimum of the NLL of those chips' raw logits, computed here directly
    session = ort.InferenceSession(str(score_model), providers=["CPUExecutionProvider"])
    raw = Predictor(score_model)
    logits = raw.predict(pre, post).logits
    assert fit_temperature(logits, labels) == pytest.approx(t, rel=1e-4)
    assert block["after"]["nll"] <= block["before"]["nll"]
    assert block["after"]["accuracy"] == block["before"]["accuracy"]

    got = Predictor(calibrated).predict(pre, post, batch_size=5)
    assert Predictor(calibrated).temperature == t and raw.temperature is None
    np.testing.assert_allclose(got.logits, logits, atol=1e-6)  # logits stay raw
    np.testing.assert_allclose(got.probabilities, _softmax64(logits / t), atol=1e-6)
    assert not np.allclose(got.probabilities, _softmax64(logits), atol=1e-4)
    np.testing.assert_array_equal(got.probabilities.argmax(1), logits.argmax(1))
    np.testing.assert_array_equal(
        got.probabilities.argmax(1), raw.predict(pre, post).logits.argmax(1)
    )
    del session


def test_calibrate_on_given_chips_equals_the_fold_they_make_up(
    calibrated, score_model, chips, tmp_path
):
    """Chips given by id (a validation slice) fit what the same chips as a fold fit; the stored
    block names the selection; the prototypes can come from given chips too."""
    from data_prep.split import fold_indices
    from runtime.evaluation.calibrate import CalibrationOptions, calibrate_model
    from runtime.evaluation.chips import select_chips

    ids = select_chips(chips, 0)[0]
    assert set(ids) <= set(fold_indices(chips, 0)[1])
    out = tmp_path / "given.onnx"
    given = CalibrationOptions(chip_ids=ids, selection="validation slice", prototype_ids=ids)
    got = calibrate_model(score_model, chips, out, given)
    fold_block = _props(calibrated)["calibration"]
    block = got["calibration"]
    assert block["temperature"] == pytest.approx(fold_block["temperature"], rel=1e-6)
    assert block["fitted_on"]["selection"] == "validation slice"
    assert block["fitted_on"]["fold"] is None and block["fitted_on"]["n"] == len(ids)
    ood = got["ood"]
    assert ood["prototypes_from"]["selection"] == f"{len(ids)} given chips of {chips}"
    assert _props(out)["ood"]["threshold"] == ood["threshold"]
    with pytest.raises(ValueError, match="fold or calibration chips, not both"):
        both = CalibrationOptions(fold=0, chip_ids=ids)
        calibrate_model(score_model, chips, tmp_path / "x.onnx", both)
    with pytest.raises(ValueError, match="prototype folds or prototype chips, not both"):
        both = CalibrationOptions(prototype_folds=[1], prototype_ids=ids)
        calibrate_model(score_model, chips, tmp_path / "x.onnx", both)
    assert not (tmp_path / "x.onnx").exists()


def test_calibrate_in_place_replaces_the_temperature(calibrated, chips, tmp_path):
    model = tmp_path / "m.onnx"
    shutil.copy(calibrated, model)
    args = ["calibrate", "--model", str(model), "--chips", str(chips), "--fold", "0"]
    assert main([*args, "--out", str(model), "--quiet"]) == 0
    # fitted on the raw logits again, not on top of the stored temperature (which would give
    # T close to 1 on the same chips)
    before, after = _props(calibrated)["calibration"], _props(model)["calibration"]
    assert after["temperature"] == pytest.approx(before["temperature"], rel=1e-6)
    assert after["before"] == before["before"]
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]  # no temporary left behind


def test_calibrate_errors_name_the_file(score_model, chips, tmp_path, capsys):
    out = tmp_path / "out.onnx"
    base = ["calibrate", "--model", str(score_model), "--out", str(out), "--quiet"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([*base, "--chips", str(empty)]) == 2
    assert f"{empty / 'manifest.csv'}: no manifest" in capsys.readouterr().err
    assert main([*base, "--chips", str(chips), "--fold", "7"]) == 2
    err = capsys.readouterr().err
    assert f"{chips / 'splits.csv'}: no fold 7" in err and "0, 1, 2" in err
    nosplits = tmp_path / "nosplits"
    shutil.copytree(chips, nosplits)
    (nosplits / "splits.csv").unlink()
    assert main([*base, "--chips", str(nosplits), "--fold", "0"]) == 2
    assert f"{nosplits / 'splits.csv'}: no splits" in capsys.readouterr().err
    missing = tmp_path / "missing.onnx"
    args = ["calibrate", "--model", str(missing), "--chips", str(chips), "--out", str(out)]
    assert main(args) == 2
    assert f"{missing}: model file not found" in capsys.readouterr().err
    assert main([*base[:-3], "--out", str(tmp_path / "x.txt"), "--chips", str(chips)]) == 2
    assert "must end in .onnx" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "x.txt").exists()


def test_predictor_rejects_a_bad_temperature(score_model, tmp_path):
    import onnx

    from runtime.contract import ModelError, save_onnx, set_metadata
    from runtime.predictor import Predictor

    proto = onnx.load(str(score_model))
    set_metadata(proto, {"calibration": {"temperature": -1.0}})
    bad = save_onnx(proto, tmp_path / "bad.onnx")
    with pytest.raises(ModelError, match=rf"{bad}: metadata calibration .*positive"):
        Predictor(bad)


@pytest.mark.slow
def test_calibrate_runs_without_torch(score_model, chips, tmp_path):
    out = tmp_path / "m.onnx"
    code = (
        "import sys\n"
        "from cli.main import main\n"
        f"rc = main(['calibrate', '--model', {str(score_model)!r}, '--chips', {str(chips)!r}, "
        f"'--fold', '0', '--out', {str(out)!r}, '--quiet'])\n"
        "assert rc == 0, rc\n"
        "assert 'torch' not in sys.modules, 'calibrate imported torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "temperature T = " in done.stdout and out.is_file()


# --------------------------------------------------------------------------------------------
# where calibration shows: evaluate, export, the model card


@pytest.mark.slow
def test_evaluate_reports_before_and_after(calibrated, score_model, chips, tmp_path):
    out = tmp_path / "eval"
    args = ["evaluate", "--chips", str(chips), "--fold", "0", "--views", "1", "--no-tsne"]
    assert main([*args, "--model", str(calibrated), "--out", str(out), "--quiet"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    cal = metrics["calibration"]
    block = _props(calibrated)["calibration"]
    assert cal["temperature"] == block["temperature"] and cal["bins"] == 15
    for key in ("ece", "nll", "brier"):  # the same chips the temperature was fitted on
        assert cal["before"][key] == pytest.approx(block["before"][key], abs=1e-5)
        assert cal["after"][key] == pytest.approx(block["after"][key], abs=1e-5)
    assert cal["after"]["nll"] <= cal["before"]["nll"]
    assert cal["before"]["accuracy"] == cal["after"]["accuracy"] == metrics["accuracy"]
    for key in ("before", "after"):
        assert 0 < cal[key]["ece_floor"]["mean"] <= cal[key]["ece_floor"]["p95"] < 1
    assert (out / "reliability.png").stat().st_size > 0

    plain = tmp_path / "plain"
    assert main([*args, "--model", str(score_model), "--out", str(plain), "--quiet"]) == 0
    cal = json.loads((plain / "metrics.json").read_text())["calibration"]
    assert cal["temperature"] is None and cal["after"] is None
    assert cal["before"]["ece"] == pytest.approx(block["before"]["ece"], abs=1e-5)
    assert (plain / "reliability.png").is_file()


@pytest.mark.slow
def test_export_calibrate_fold(calibrated, score_model, tmp_path, capsys):
    run = score_model.parent / "run"
    out = tmp_path / "calibrated.onnx"
    assert main(["export", "--run", str(run), "--out", str(out), "--calibrate-fold", "0"]) == 0
    assert "temperature T = " in capsys.readouterr().out
    props = _props(out)
    assert props["calibration"]["fitted_on"]["fold"] == 0
    # the same fp32 graph as the shared tiny model, so the same temperature as `calibrate` fits
    expected = _props(calibrated)["calibration"]["temperature"]
    assert props["calibration"]["temperature"] == pytest.approx(expected, rel=1e-4)
    parity = json.loads(out.with_suffix(".parity.json").read_text())
    assert "calibration" not in parity and props["parity"] == parity

    bad = tmp_path / "bad.onnx"
    assert main(["export", "--run", str(run), "--out", str(bad), "--calibrate-fold", "9"]) == 2
    assert "no fold 9" in capsys.readouterr().err
    assert not bad.exists() and not bad.with_suffix(".parity.json").exists()


def test_model_card_says_whether_the_model_is_calibrated(calibrated, score_model):
    from app.web.app import card_markdown
    from runtime.predictor import Predictor

    block = _props(calibrated)["calibration"]
    text = card_markdown(Predictor(calibrated))
    assert f"T = {block['temperature']:.4f}" in text
    assert f"fitted on {block['fitted_on']['n']} buildings (fold 0 of" in text
    assert f"ECE {block['before']['ece']:.4f} before, {block['after']['ece']:.4f} after" in text
    assert "- calibration: none" in card_markdown(Predictor(score_model))


@pytest.mark.slow
def test_no_temperature_keeps_the_raw_probabilities_and_records_the_fit(
    calibrated, score_model, chips, tmp_path, capsys
):
    """`--no-temperature` (calibrate and export): T = 1 applied, the fitted T recorded, the ood
    block stored as usual, and a temperature stored before is replaced by the raw one."""
    from app.web.app import card_markdown
    from runtime.predictor import Predictor

    fitted = _props(calibrated)["calibration"]
    model = tmp_path / "raw.onnx"
    shutil.copy(calibrated, model)  # holds a temperature: --no-temperature must drop it
    args = ["calibrate", "--model", str(model), "--chips", str(chips), "--fold", "0"]
    assert main([*args, "--out", str(model), "--no-temperature", "--quiet"]) == 0
    assert "not applied: the model keeps its raw probabilities" in capsys.readouterr().out
    props = _props(model)
    block = props["calibration"]
    assert block["method"] == "raw" and block["temperature"] == 1.0
    assert block["fitted_temperature"] == pytest.approx(fitted["temperature"], rel=1e-6)
    assert block["after"] == block["before"] == fitted["before"]
    assert block["after_if_fitted"] == fitted["after"]
    assert props["ood"]["threshold"] == _props(calibrated)["ood"]["threshold"]

    pre, post, _ = _fold_chips(chips, 0)
    got = Predictor(model).predict(pre, post)
    raw = Predictor(score_model).predict(pre, post)
    np.testing.assert_allclose(got.probabilities, raw.probabilities, atol=1e-7)
    assert not np.allclose(
        got.probabilities, Predictor(calibrated).predict(pre, post).probabilities, atol=1e-4
    )
    text = card_markdown(Predictor(model))
    assert "none applied on purpose" in text and f"T = {fitted['temperature']:.4f}" in text

    run, out = score_model.parent / "run", tmp_path / "exported.onnx"
    base = ["export", "--run", str(run), "--out", str(out)]
    assert main([*base, "--no-temperature"]) == 2
    assert "--no-temperature goes with --calibrate-fold" in capsys.readouterr().err
    assert not out.exists()
    assert main([*base, "--calibrate-fold", "0", "--no-temperature"]) == 0
    exported = _props(out)["calibration"]
    assert exported["method"] == "raw" and Predictor(out).temperature == 1.0
    assert exported["fitted_temperature"] == pytest.approx(fitted["temperature"], rel=1e-4)
