"""`adapt` recalibrates the kept model's probabilities on the labels: a temperature fitted on
out-of-fold probabilities, kept when the cross-fitted NLL falls clearly: softening from
MIN_LABELS labels, sharpening from MIN_SHARPEN_LABELS.

The rule is tested on built logits whose calibration is known (labels drawn from the softmax of
the logits, then the logits scaled); the end to end test adapts a real ONNX model (the fixture
model, made over-confident by a temperature below 1 in its metadata) and reads the written file
back with ONNX Runtime.
"""

from __future__ import annotations

import numpy as np
import pytest

from app.adapt.fit import BaseModel, adapt_head
from app.adapt.recalibrate import (
    MIN_LABELS,
    MIN_SHARPEN_LABELS,
    recalibrate,
    recalibration_text,
    softened_losses,
)
from runtime.metrics.calibration import expected_calibration_error


def _calibrated(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits and labels drawn from their softmax: calibrated by construction."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=2.0, size=(n, 4))
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    labels = np.array([rng.choice(4, p=row) for row in p])
    return logits, labels


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("scale", "n", "way"),
    [(4.0, 200, "over"), (0.25, MIN_SHARPEN_LABELS + 200, "under")],
    ids=["four-times-too-sure", "four-times-too-soft"],
)
def test_miscalibrated_probabilities_are_rescaled_and_their_ece_falls(seed, scale, n, way):
    """Over-confident probabilities are softened; under-confident ones, from
    MIN_SHARPEN_LABELS labels, sharpened: the temperature undoes the scale."""
    logits, y = _calibrated(n, seed)
    r = recalibrate(scale * logits, y)
    assert r.kept
    assert r.temperature == pytest.approx(scale, rel=0.35)
    assert r.ece[1] < r.ece[0] - 0.05
    assert r.nll[1] < r.nll[0]
    assert f"{way}-confident" in r.why
    # on buildings it did not see, the fitted temperature helps too
    fresh, fy = _calibrated(2000, seed + 100)
    before = expected_calibration_error(_softmax(scale * fresh), fy)
    after = expected_calibration_error(_softmax(scale * fresh / r.temperature), fy)
    assert after < before / 2
    assert "recalibrated" in recalibration_text({"recalibration": r.to_dict()})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_calibrated_probabilities_are_kept_as_they_are(seed):
    logits, y = _calibrated(200, seed)
    r = recalibrate(logits, y)
    assert not r.kept
    assert r.temperature == 1.0
    assert r.fitted is not None and 0.6 < r.fitted < 1.6


def test_under_confident_probabilities_are_not_sharpened_from_few_labels():
    logits, y = _calibrated(MIN_SHARPEN_LABELS - 1, 0)
    r = recalibrate(0.25 * logits, y)
    assert r.fitted is not None and r.fitted < 1.0
    assert not r.kept and r.temperature == 1.0
    assert "sharpen" in r.why and str(MIN_SHARPEN_LABELS) in r.why
    # softening is taken from fewer labels than sharpening
    assert recalibrate(4.0 * logits, y).kept


def test_the_reference_nll_sharpens_only_from_enough_labels():
    """The base model's reference NLL for the heads follows the same rule: with fewer than
    MIN_SHARPEN_LABELS labels an under-confident base keeps its raw NLL; with more, the
    sharpened NLL, far below it."""
    from sklearn.model_selection import KFold

    from runtime.head import log_softmax

    for n, sharpened in ((MIN_SHARPEN_LABELS - 1, False), (300, True)):
        logits, y = _calibrated(n, 4)
        lp = log_softmax(0.25 * logits)
        raw = -lp[np.arange(n), y]
        ref = softened_losses(lp, y, list(KFold(5, shuffle=True, random_state=0).split(y)))
        if sharpened:
            assert ref.mean() < 0.9 * raw.mean()
        else:
            np.testing.assert_allclose(ref, raw)


def test_too_few_labels_keep_the_probabilities():
    logits, y = _calibrated(MIN_LABELS - 1, 0)
    r = recalibrate(8.0 * logits, y)
    assert not r.kept and r.temperature == 1.0 and r.fitted is None
    assert str(MIN_LABELS) in r.why


def test_the_head_is_recalibrated_on_its_out_of_fold_probabilities():
    """``adapt_head`` fits the temperature on the kept head's out-of-fold log-probabilities: an
    over-confident base model kept as it is gets ``T > 1``, and its grades are not changed."""
    logits, y = _calibrated(150, 3)
    z = np.random.default_rng(0).normal(size=(150, 8))
    ad = adapt_head(4.0 * logits, z, y, BaseModel(4), methods=("base",))
    assert ad.head.method == "base"
    assert ad.recalibration.kept and ad.recalibration.temperature > 2.0
    lp = ad.head.log_probabilities(4.0 * logits, z)
    np.testing.assert_array_equal(
        (lp / ad.recalibration.temperature).argmax(1), (4.0 * logits).argmax(1)
    )


#: The temperature the over-confident base claims, and the one its labels are drawn at: the
#: recalibration should find ``TRUE / HOT`` = 5.
HOT, TRUE = 0.02, 0.1


@pytest.fixture(scope="module")
def hot_base(score_model, tmp_path_factory):
    """The fixture model with a temperature of :data:`HOT` in its metadata (its raw logits are
    small: it claims far more confidence than it has)."""
    import onnx

    from runtime.calibration import calibration_block
    from runtime.contract import set_metadata

    proto = onnx.load(str(score_model))
    block = calibration_block(HOT, {"selection": "a test's over-confident base"})
    set_metadata(proto, {"calibration": block})
    out = tmp_path_factory.mktemp("hot") / "hot.onnx"
    onnx.save(proto, str(out))
    return out


def test_adapted_model_file_carries_the_temperature_and_the_predictor_applies_it(
    hot_base, chips, tmp_path
):
    """Labels drawn from the fixture model's probabilities at T = TRUE, given to the same model
    claiming T = HOT: ``adapt`` keeps the base head and recalibrates it; the written file
    carries the temperature, ONNX Runtime's probabilities follow it and the grades do not move."""
    from dataclasses import replace

    from app.adapt.labelled import from_chip_store
    from app.adapt.model import adapt_model, format_adaptation
    from runtime.predictor import Predictor

    hot = Predictor(hot_base)
    store = from_chip_store(chips, hot.class_names)
    store = store.subset(store.labelled)
    rng = np.random.default_rng(0)
    idx = np.tile(np.arange(len(store)), 4)  # each building four times, labels drawn anew
    raw = hot.predict(store.pre, store.post).raw_logits[idx]
    y = (rng.random((len(idx), 1)) > np.cumsum(_softmax(raw.astype(np.float64) / TRUE), 1)).sum(1)
    labelled = replace(
        store,
        ids=[f"{store.ids[i]}#{j}" for j, i in enumerate(idx)],
        events=[store.events[i] for i in idx],
        labels=y,
        pre=store.pre[idx],
        post=store.post[idx],
        refs=[],
    )
    result = adapt_model(hot, labelled, tmp_path / "adapted.onnx", methods=("base",))
    r = result.block["recalibration"]
    assert r["kept"], r
    assert 2.5 < r["temperature"] < 10.0  # the truth is TRUE / HOT = 5
    assert r["ece"][1] < r["ece"][0]
    text = format_adaptation(result.block)
    assert "probabilities recalibrated on the labels" in text
    base_row = result.block["cv"]["candidates"]["base"]
    assert base_row["nll_recalibrated"] < base_row["nll"]  # the over-confident base, softened
    assert f"(recalibrated NLL {base_row['nll_recalibrated']:.4f}, the NLL to beat)" in text
    adapted = Predictor(result.out)
    assert adapted.temperature == pytest.approx(r["temperature"])
    from app.web.model_card import card_markdown

    assert f"T = {r['temperature']:.4f} on the adapted model's output" in card_markdown(adapted)
    old = hot.predict(labelled.pre, labelled.post)
    new = adapted.predict(labelled.pre, labelled.post)
    np.testing.assert_array_equal(new.probabilities.argmax(1), old.probabilities.argmax(1))
    assert expected_calibration_error(new.probabilities, y) < expected_calibration_error(
        old.probabilities, y
    )
    # adapting the adapted model again starts from the base's temperature, not from both
    again = adapt_model(adapted, labelled, tmp_path / "again.onnx", methods=("base",))
    assert again.block["head"]["base_temperature"] == pytest.approx(HOT)
    assert again.block["recalibration"]["temperature"] == pytest.approx(r["temperature"], rel=1e-3)


def test_the_base_model_recalibrated_on_other_folds_is_what_a_head_must_beat():
    """The reference of the heads' rule: the base model's out-of-fold NLL at a temperature fitted
    on the other folds. It is far below the raw NLL of an over-confident base model, equal to
    the raw NLL of a calibrated one within the folds' noise, and the raw NLL itself below
    MIN_LABELS labels (no temperature is ever applied then). A candidate that only beats the raw
    NLL is not kept against it; the base model's row records it."""
    from sklearn.model_selection import KFold

    from app.adapt.fit import choose
    from runtime.head import log_softmax

    logits, y = _calibrated(200, 3)
    folds = list(KFold(5, shuffle=True, random_state=0).split(y))
    rows = np.arange(len(y))
    for scale, near in ((4.0, False), (1.0, True)):
        lp = log_softmax(scale * logits)
        raw = -lp[rows, y]
        ref = softened_losses(lp, y, folds)
        assert ref.shape == raw.shape
        assert abs(ref.mean() - raw.mean()) < 0.02 if near else ref.mean() < 0.6 * raw.mean()
    few = rows[: MIN_LABELS - 1]
    lp = log_softmax(4.0 * logits[few])
    np.testing.assert_allclose(
        softened_losses(lp, y[few], [(few[:5], few[5:]), (few[5:], few[:5])]), -lp[few, y[few]]
    )
    # a candidate between the two: clearly better than the raw base model, not the recalibrated
    hot = -log_softmax(4.0 * logits)[rows, y]
    ref = softened_losses(log_softmax(4.0 * logits), y, folds)
    middle = (hot + ref) / 2 + 0.05
    assert middle.mean() < hot.mean() - 0.1 and middle.mean() > ref.mean()

    def candidates():
        return {
            "base": {"nll": hot.mean(), "accuracy": 0.6, "macro_f1": 0.5},
            "logistic": {"nll": middle.mean(), "accuracy": 0.6, "macro_f1": 0.55},
        }

    losses = {"base": hot, "logistic": middle}
    assert choose(candidates(), losses, ["base", "logistic"]) == "logistic"
    seen = candidates()
    assert choose(seen, losses, ["base", "logistic"], reference=ref) == "base"
    assert seen["base"]["nll_recalibrated"] == pytest.approx(ref.mean(), abs=1e-6)
    assert not seen["logistic"]["clear"]
