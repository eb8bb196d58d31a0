"""The xView2 score against hand-computed cases (the rules of the challenge's xview2_metrics.py)."""

from __future__ import annotations

import numpy as np
import pytest

from data_prep.xview2 import (
    EPSILON,
    XView2Counts,
    f1_from_counts,
    xview2_harmonic_mean,
    xview2_scores,
)


def _hm(*f1s: float) -> float:
    """The reference's harmonic mean, written out."""
    return len(f1s) / sum(1 / (f + EPSILON) for f in f1s)


# a 4 x 4 tile worked by hand: targets, predicted buildings, predicted damage
DT = np.array([[1, 1, 0, 0], [2, 2, 0, 0], [3, 4, 0, 0], [0, 0, 0, 0]], np.uint8)
LP = np.array([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], np.uint8)
DP = np.array([[1, 2, 0, 0], [2, 2, 0, 0], [3, 3, 4, 0], [0, 0, 0, 0]], np.uint8)


def test_hand_computed_tile():
    s = xview2_scores([(LP, DP, DT > 0, DT)])
    # localisation: 5 of the 6 building pixels found, (1, 1) missed, (2, 2) predicted outside
    assert s["localization"] == {
        "tp": 5,
        "fn": 1,
        "fp": 1,
        "precision": pytest.approx(5 / 6),
        "recall": pytest.approx(5 / 6),
        "f1": pytest.approx(5 / 6),
    }
    d = s["damage"]
    # (1, 1) is predicted 2 but not a predicted building, so it counts as 0: a miss of class 2;
    # (2, 2) is predicted 4 outside every target building: it does not count for damage
    assert (d["no-damage"]["tp"], d["no-damage"]["fn"], d["no-damage"]["fp"]) == (1, 1, 0)
    assert (d["minor-damage"]["tp"], d["minor-damage"]["fn"], d["minor-damage"]["fp"]) == (1, 1, 1)
    assert (d["major-damage"]["tp"], d["major-damage"]["fn"], d["major-damage"]["fp"]) == (1, 0, 1)
    assert (d["destroyed"]["tp"], d["destroyed"]["fn"], d["destroyed"]["fp"]) == (0, 1, 0)
    f1s = [d[c]["f1"] for c in ("no-damage", "minor-damage", "major-damage", "destroyed")]
    assert f1s == pytest.approx([2 / 3, 1 / 2, 2 / 3, 0.0])
    assert s["damage_f1"] == pytest.approx(_hm(2 / 3, 1 / 2, 2 / 3, 0.0), rel=1e-12)
    assert s["damage_f1"] == pytest.approx(4 / (1.5 + 2 + 1.5 + 1e6), rel=1e-5)  # ~4e-6
    assert s["score"] == pytest.approx(0.3 * 5 / 6 + 0.7 * s["damage_f1"], rel=1e-12)
    assert s["tiles"] == 1


def test_perfect_prediction_scores_one():
    s = xview2_scores([(DT > 0, DT, DT > 0, DT)])
    assert s["localization_f1"] == 1.0
    assert all(d["f1"] == 1.0 for d in s["damage"].values())
    # the reference adds 1e-6 to each F1 before the harmonic mean: 1 + 1e-6, not exactly 1
    assert s["damage_f1"] == pytest.approx(1 + EPSILON, rel=1e-12)
    assert s["score"] == pytest.approx(1.0, abs=1e-6)


def test_no_building_predicted():
    empty = np.zeros_like(DT)
    s = xview2_scores([(empty, DP, DT > 0, DT)])  # damage without buildings earns nothing
    assert (s["localization"]["tp"], s["localization"]["fn"], s["localization"]["fp"]) == (0, 6, 0)
    assert s["localization_f1"] == 0.0
    assert all(d["f1"] == 0.0 and d["tp"] == 0 and d["fp"] == 0 for d in s["damage"].values())
    assert s["damage_f1"] == pytest.approx(4 / (4 / EPSILON))
    assert s["score"] == pytest.approx(0.7 * EPSILON)


def test_class_absent_from_every_target_zeroes_damage_f1():
    dt = np.array([[1, 2], [3, 3]], np.uint8)  # no destroyed building
    s = xview2_scores([(dt > 0, dt, dt > 0, dt)])
    assert [d["f1"] for d in s["damage"].values()] == [1.0, 1.0, 1.0, 0.0]
    assert s["damage_f1"] == pytest.approx(_hm(1, 1, 1, 0), rel=1e-12)
    assert s["damage_f1"] < 1e-5
    assert s["score"] == pytest.approx(0.3 + 0.7 * _hm(1, 1, 1, 0))


def test_false_positives_count_on_tiles_without_the_class():
    # tile A has class 2 only, predicted right; tile B has no class 2 but two pixels predicted 2:
    # the scorer (since its commit acb007a) counts those as false positives of class 2
    a = np.full((2, 2), 2, np.uint8)
    b_target = np.ones((2, 2), np.uint8)
    b_pred = np.array([[1, 2], [2, 1]], np.uint8)
    s = xview2_scores([(a, a, a, a), (b_target, b_pred, b_target, b_target)])
    minor = s["damage"]["minor-damage"]
    assert (minor["tp"], minor["fn"], minor["fp"]) == (4, 0, 2)
    assert minor["f1"] == pytest.approx(2 * (4 / 6) * 1 / (4 / 6 + 1))
    no = s["damage"]["no-damage"]
    assert (no["tp"], no["fn"], no["fp"]) == (2, 2, 0)


def test_ungraded_building_is_a_miss_not_a_false_positive():
    # a given footprint the model did not grade: building predicted, damage 0
    dt = np.array([[4, 4], [1, 1]], np.uint8)
    dp = np.array([[0, 0], [1, 1]], np.uint8)
    s = xview2_scores([(dt > 0, dp, dt > 0, dt)])
    assert s["localization_f1"] == 1.0
    destroyed = s["damage"]["destroyed"]
    assert (destroyed["tp"], destroyed["fn"], destroyed["fp"]) == (0, 2, 0)
    assert s["damage"]["no-damage"]["f1"] == 1.0


def test_counts_pool_over_tiles_not_averaged():
    one = np.ones((2, 2), np.uint8)
    zero = np.zeros((1, 1), np.uint8)
    counts = XView2Counts()
    counts.add(one, one, one, one)  # tile F1 1
    counts.add(zero, zero, np.ones((1, 1)), np.ones((1, 1)))  # tile F1 0
    s = counts.scores()
    assert (s["localization"]["tp"], s["localization"]["fn"]) == (4, 1)
    assert s["localization_f1"] == pytest.approx(2 * 1 * 0.8 / 1.8)  # 8/9, not (1 + 0) / 2
    assert s["damage"]["no-damage"]["f1"] == pytest.approx(8 / 9)
    # adding counters is the same as adding the tiles to one
    a, b = XView2Counts(), XView2Counts()
    a.add(one, one, one, one)
    b.add(zero, zero, np.ones((1, 1)), np.ones((1, 1)))
    a += b
    assert a.loc.tolist() == counts.loc.tolist() and a.damage.tolist() == counts.damage.tolist()
    assert a.tiles == 2


def test_f1_and_harmonic_mean_rules():
    assert f1_from_counts(0, 5, 5) == (0.0, 0.0, 0.0)
    assert f1_from_counts(3, 1, 0) == pytest.approx((0.75, 1.0, 6 / 7))
    assert xview2_harmonic_mean([0.5, 0.5]) == pytest.approx(0.5 + EPSILON)
    with pytest.raises(ValueError, match="non-negative"):
        f1_from_counts(-1, 0, 0)
    with pytest.raises(ValueError, match="no F1"):
        xview2_harmonic_mean([])


def test_bad_rasters_are_refused():
    counts = XView2Counts()
    with pytest.raises(ValueError, match="one shape"):
        counts.add(DT, DT, DT, DT[:2])
    with pytest.raises(ValueError, match="0-4"):
        counts.add(DT, DT + 1, DT, DT)
    with pytest.raises(ValueError, match="2-D"):
        counts.add(DT[None], DT, DT, DT)
    assert counts.tiles == 0
