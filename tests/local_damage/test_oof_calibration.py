"""Calibration fitted on out-of-fold predictions: cross-fitted by fold, shipped only where it is
nowhere worse than the raw probabilities (local_damage.experiments.oof_calibration)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from local_damage.experiments.oof_calibration import (
    MAPS,
    apply_map,
    calibration_study,
    calibration_table,
    fit_map,
)

NAMES = ["no-damage", "minor-damage", "major-damage", "destroyed"]


def _softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _frame(seed: int, hard_scale: float, easy_scale: float, sure: bool, folds=5, per_fold=600):
    """Out-of-fold predictions of a model whose logits are ``scale`` times the true log-odds,
    labels drawn from the true probabilities (scale 1: calibrated; above 1: over-confident).
    A third of each fold lies on easy tiles, marked intact: with ``sure``, every building there
    is no-damage and the true no-damage logit is 6 (the others 0); else the truth is about 0.9
    no-damage and the labels are drawn from it."""
    rng = np.random.default_rng(seed)
    parts = []
    for f in range(folds):
        n_easy = per_fold // 3
        hard = rng.normal(0, 1.2, (per_fold - n_easy, 4))
        y_hard = np.array([rng.choice(4, p=q) for q in _softmax(hard)])
        if sure:
            easy = np.zeros((n_easy, 4))
            easy[:, 0] = rng.normal(6, 0.5, n_easy)
            y_easy = np.zeros(n_easy, dtype=int)
        else:
            easy = np.column_stack([rng.normal(3, 0.5, n_easy), np.zeros((n_easy, 3))])
            y_easy = np.array([rng.choice(4, p=q) for q in _softmax(easy)])
        for z, y, scale, intact in (
            (hard, y_hard, hard_scale, False),
            (easy, y_easy, easy_scale, True),
        ):
            part = pd.DataFrame(z * scale, columns=[f"logit_{c}" for c in NAMES])
            part.insert(0, "fold", f)
            part.insert(1, "label", y)
            part.insert(2, "intact_tile", intact)
            parts.append(part)
    return pd.concat(parts, ignore_index=True)


def test_over_confident_everywhere_ships_the_temperature():
    frame = _frame(0, hard_scale=2.5, easy_scale=2.5, sure=False)
    study = calibration_study(frame, NAMES)
    t = study["maps"]["temperature"]
    assert study["chosen"] == "temperature", study["why"]
    assert t["worse"] == [] and t["grades_changed"] == 0
    assert t["params"]["temperature"] == pytest.approx(2.5, rel=0.2)
    assert t["figures"]["ece"] < 0.5 * study["raw"]["ece"]


def test_a_map_that_harms_intact_tiles_does_not_ship():
    # hard tiles over-confident, intact tiles sure and right: one temperature softens the sure,
    # right grades of intact tiles, so their ECE rises although the pooled ECE falls
    frame = _frame(2, hard_scale=3.0, easy_scale=1.0, sure=True)
    study = calibration_study(frame, NAMES)
    t = study["maps"]["temperature"]
    assert t["figures"]["ece"] < study["raw"]["ece"]  # better on average ...
    assert t["figures"]["ece_intact"] > study["raw"]["ece_intact"] + 0.05  # ... worse where easy
    assert "pooled intact" in t["worse"]
    assert study["chosen"] is None
    assert study["why"].startswith("raw probabilities ship")
    text = "\n".join(calibration_table("m", study))
    assert "raw probabilities ship" in text and "| temperature |" in text


def test_grade_keeping_maps_keep_every_grade():
    rng = np.random.default_rng(3)
    z = rng.normal(0, 2, (400, 4))
    y = np.array([rng.choice(4, p=q) for q in _softmax(z / 2)])
    for name in MAPS:
        p = apply_map(name, fit_map(name, z, y), z)
        assert np.allclose(p.sum(axis=1), 1)
        if name != "vector scaling":
            assert (p.argmax(axis=1) == z.argmax(axis=1)).all(), name
    assert fit_map("temperature", z, y)["temperature"] == pytest.approx(2, rel=0.25)


def test_unknown_map_and_too_few_folds():
    with pytest.raises(ValueError, match="unknown calibration map"):
        fit_map("isotonic", np.zeros((4, 4)), np.zeros(4, int))
    frame = _frame(4, 1.0, 1.0, True, folds=1, per_fold=60)
    assert calibration_study(frame, NAMES) is None
