"""The xView2 challenge score: pixel localisation F1, damage F1 and their weighted sum.

Reproduces the challenge's reference scorer, ``xview2_metrics.py`` of
https://github.com/DIUx-xView/xView2_scoring (its last commit, ea0793d), which reads, per image, four
uint8 rasters of values 0-4: localisation prediction ``lp`` and target ``lt``, damage prediction
``dp`` and target ``dt`` (0 = background, 1 no-damage, 2 minor-damage, 3 major-damage,
4 destroyed). What it does, and what this module does the same way:

- **Building masks.** Any value > 0 is a building (``RowPairCalculator.extract_buildings``,
  lines 66-70).
- **Localisation counts.** TP / FN / FP of the binary masks ``lp > 0`` against ``lt > 0`` over
  every pixel (``compute_tp_fn_fp(lp_b, lt_b, 1)``, lines 72-85 and 102).
- **Damage counts** (``get_row_pair``, lines 87-105). ``dp`` is first multiplied by the
  localisation mask (``dp * lp_b``: "only give credit to damages where buildings are
  predicted"), then both ``dp`` and ``dt`` are cut to the *target* building pixels (``dt > 0``);
  predictions outside target buildings never count. Per class c in 1-4, on every image: TP = pred
  c and target c, FN = pred not c and target c, FP = pred c and target not c. A target building
  pixel predicted 0 (no building, or no grade) is a FN of its class and a FP of none. (The first
  commit, e34328c, skipped a class on images without a target pixel of it, FPs included; commit
  acb007a, "Fixed improper counting of false positives", removed that, and so does this module.)
- **Pooling.** Counts are summed over all images first (``get_lf1r``, ``get_df1rs``, lines
  220-240); F1 is computed once from the totals, not averaged per image.
- **F1** (``F1Recorder``, lines 107-145). precision = 0 when TP = 0, else TP / (TP + FP); recall
  likewise with FN; F1 = 0 when precision or recall is 0, else their harmonic mean. A class with
  no target pixel anywhere has TP = 0, hence F1 = 0.
- **Damage F1.** ``4 / sum(1 / (f1_c + 1e-6))`` over the four classes, always all four; one class
  at F1 0 pulls it to about 4e-6 (``XviewMetrics.df1``, lines 246-250).
- **Score.** ``0.3 * localisation F1 + 0.7 * damage F1`` (``XviewMetrics.score``, lines 252-255).

Pure NumPy: :class:`XView2Counts` accumulates the counts tile by tile (arrays of any equal shape;
the reference insists on 1024 x 1024 PNGs), :meth:`XView2Counts.scores` turns them into the
figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

#: xView2 damage values 1-4 in order (0 is background).
XVIEW2_CLASSES: tuple[str, ...] = ("no-damage", "minor-damage", "major-damage", "destroyed")
#: Added to each class F1 before the harmonic mean, as the reference scorer does.
EPSILON = 1e-6
#: Weights of localisation and damage F1 in the overall score.
LOCALIZATION_WEIGHT = 0.3
DAMAGE_WEIGHT = 0.7


def f1_from_counts(tp: int, fp: int, fn: int) -> tuple[float, float, float]:
    """``(precision, recall, f1)`` from counts, with the reference scorer's zero rules.

    Precision and recall are 0 when TP is 0; F1 is 0 when either is 0.
    """
    if min(tp, fp, fn) < 0:
        raise ValueError(f"counts must be non-negative, got TP {tp}, FP {fp}, FN {fn}")
    if tp == 0:
        return 0.0, 0.0, 0.0
    precision = tp / (tp + fp)
    recall = tp / (tp + fn)
    return float(precision), float(recall), float(2 * precision * recall / (precision + recall))


def xview2_harmonic_mean(f1s: ArrayLike, epsilon: float = EPSILON) -> float:
    """``len(f1s) / sum(1 / (f1 + epsilon))``: the reference's damage F1 of the class F1s."""
    arr = np.asarray(f1s, dtype=np.float64)
    if arr.size == 0:
        raise ValueError("no F1 scores to combine")
    return float(arr.size / np.sum(1.0 / (arr + epsilon)))


def _as_map(x: ArrayLike, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be a 2-D [H, W] raster, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > 4):
        raise ValueError(
            f"{name} values must be 0-4 (0 background, 1-4 damage classes), "
            f"got {arr.min()}-{arr.max()}"
        )
    return arr


@dataclass
class XView2Counts:
    """Pixel counts of the xView2 score, summed over the tiles added so far.

    Attributes:
        loc: ``[TP, FN, FP]`` of the building masks.
        damage: int64 [4, 3]: ``[TP, FN, FP]`` of damage classes 1-4 (rows), over the target
            building pixels.
        tiles: number of tiles added.
    """

    loc: np.ndarray = field(default_factory=lambda: np.zeros(3, np.int64))
    damage: np.ndarray = field(default_factory=lambda: np.zeros((4, 3), np.int64))
    tiles: int = 0

    def add(
        self,
        loc_pred: ArrayLike,
        damage_pred: ArrayLike,
        loc_target: ArrayLike,
        damage_target: ArrayLike,
    ) -> None:
        """Add one tile: four [H, W] rasters of values 0-4 (any value > 0 is a building).

        Args:
            loc_pred: predicted buildings (the reference's ``lp``).
            damage_pred: predicted damage class 1-4, 0 where none (``dp``).
            loc_target: target buildings (``lt``).
            damage_target: target damage class 1-4, 0 outside buildings (``dt``).
        """
        lp = _as_map(loc_pred, "loc_pred") > 0
        dp = _as_map(damage_pred, "damage_pred")
        lt = _as_map(loc_target, "loc_target") > 0
        dt = _as_map(damage_target, "damage_target")
        shapes = {a.shape for a in (lp, dp, lt, dt)}
        if len(shapes) != 1:
            raise ValueError(f"the four rasters of a tile must have one shape, got {shapes}")
        self.loc += [
            np.count_nonzero(lp & lt),
            np.count_nonzero(~lp & lt),
            np.count_nonzero(lp & ~lt),
        ]
        on_target = dt > 0
        pred = np.where(lp, dp, 0)[on_target]
        targ = dt[on_target]
        for c in range(1, 5):
            is_target = targ == c
            is_pred = pred == c
            self.damage[c - 1] += [
                np.count_nonzero(is_pred & is_target),
                np.count_nonzero(~is_pred & is_target),
                np.count_nonzero(is_pred & ~is_target),
            ]
        self.tiles += 1

    def __iadd__(self, other: XView2Counts) -> XView2Counts:
        self.loc = self.loc + other.loc
        self.damage = self.damage + other.damage
        self.tiles += other.tiles
        return self

    def scores(self) -> dict[str, Any]:
        """The xView2 figures of the pooled counts.

        Returns:
            ``{"score", "localization_f1", "damage_f1", "localization": {"precision", "recall",
            "f1", "tp", "fn", "fp"}, "damage": {class name: {same keys}}, "tiles"}``; the
            reference's JSON keys ``damage_f1_<class>`` are the ``damage[<class>]["f1"]`` values.
        """

        def block(tp: int, fn: int, fp: int) -> dict[str, Any]:
            p, r, f1 = f1_from_counts(int(tp), int(fp), int(fn))
            return {
                "precision": p,
                "recall": r,
                "f1": f1,
                "tp": int(tp),
                "fn": int(fn),
                "fp": int(fp),
            }

        loc = block(*self.loc)
        damage = {name: block(*self.damage[i]) for i, name in enumerate(XVIEW2_CLASSES)}
        df1 = xview2_harmonic_mean([d["f1"] for d in damage.values()])
        return {
            "score": LOCALIZATION_WEIGHT * loc["f1"] + DAMAGE_WEIGHT * df1,
            "localization_f1": loc["f1"],
            "damage_f1": df1,
            "localization": loc,
            "damage": damage,
            "tiles": self.tiles,
        }


def xview2_scores(
    tiles: list[tuple[ArrayLike, ArrayLike, ArrayLike, ArrayLike]],
) -> dict[str, Any]:
    """The xView2 figures of ``(loc_pred, damage_pred, loc_target, damage_target)`` tiles
    (see :meth:`XView2Counts.add` and :meth:`XView2Counts.scores`)."""
    counts = XView2Counts()
    for tile in tiles:
        counts.add(*tile)
    return counts.scores()
