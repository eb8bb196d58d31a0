"""The xView2 challenge on xBD tiles: its scoring targets, and its score (pure NumPy).

**Targets.** xView2 scoring rasters of an xBD tile: building and damage targets drawn from its label polygons.

The challenge scorer (``xview2_metrics.py`` of https://github.com/DIUx-xView/xView2_scoring)
reads, per tile, a localisation target (0 background, 1 building) and a damage target (0
background, 1 no-damage, 2 minor-damage, 3 major-damage, 4 destroyed). The challenge shipped them
as PNGs without the code that drew them; here they are drawn from the post label's polygons
(``features.xy``, pixel WKT, x = column, y = row) the way the published solutions do (e.g.
``create_masks.py`` of https://github.com/vdurnov/xview2_1st_place_solution):

- every building polygon, whatever its subtype, is a building of the localisation target;
- its damage value is :data:`XVIEW2_VALUES` of ``properties.subtype``; ``un-classified``
  buildings (ones the annotators could not grade) take 1, as in that solution;
- polygons are burnt in file order, a later one winning where two overlap.

Polygons are burnt with :func:`rasterio.features.rasterize` (a pixel belongs to a polygon when its
centre lies inside), the rule the scoring outputs use (:func:`app.scoring.outputs.write_class_raster`) and
the localiser's masks (:mod:`data_prep.masks`); OpenCV's ``fillPoly`` on rounded vertices, which
those solutions use, also takes boundary pixels, so their masks are a little larger.

**Score.** The xView2 challenge score: pixel localisation F1, damage F1 and their weighted sum.

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

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from data_prep.spec import CLASS_NAMES, UNCLASSIFIED

#: xView2 damage value of each xBD subtype (0 is background).
XVIEW2_VALUES: dict[str, int] = {
    **{name: i + 1 for i, name in enumerate(CLASS_NAMES)},
    UNCLASSIFIED: 1,
}


@dataclass
class XView2Targets:
    """The scoring targets of one tile.

    Attributes:
        localization: uint8 [H, W], 1 on building pixels, 0 elsewhere.
        damage: uint8 [H, W], the building's xView2 damage value 1-4, 0 elsewhere.
        buildings: building polygons drawn.
        unclassified: how many of them were ``un-classified`` (drawn as 1).
        skipped: ``(uid, reason)`` of polygons that could not be drawn (invalid or empty WKT).
    """

    localization: np.ndarray
    damage: np.ndarray
    buildings: int = 0
    unclassified: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)


def rasterize_values(
    geometries: Sequence, values: Sequence[int], shape: tuple[int, int]
) -> np.ndarray:
    """Burn pixel-coordinate polygons into a uint8 [H, W] raster, 0 where none lies.

    Args:
        geometries: shapely polygons in pixel coordinates (x = column, y = row); None entries
            are left out.
        values: value 1-255 of each polygon.
        shape: ``(height, width)``.

    Returns:
        uint8 [H, W]: the value of the last polygon whose interior holds the pixel's centre.
    """
    from rasterio.features import rasterize

    height, width = int(shape[0]), int(shape[1])
    pairs = [(g, int(v)) for g, v in zip(geometries, values, strict=True) if g is not None]
    pairs = [(g, v) for g, v in pairs if not g.is_empty]
    if not pairs:
        return np.zeros((height, width), np.uint8)
    return rasterize(pairs, out_shape=(height, width), fill=0, dtype="uint8")


def xview2_targets(label: str | os.PathLike, shape: tuple[int, int]) -> XView2Targets:
    """Localisation and damage targets of an xBD post-disaster label file.

    Args:
        label: the tile's ``*_post_disaster.json`` (``features.xy`` polygons with a damage
            ``subtype``).
        shape: ``(height, width)`` of the tile's image.

    Returns:
        The targets (see :class:`XView2Targets`).

    Raises:
        ValueError: naming the file, when it is not an xBD label file, or a building has no
            damage subtype (a pre-disaster label) or an unknown one.
    """
    import shapely

    path = Path(label)
    try:
        data = json.loads(path.read_bytes())
        xy = data["features"]["xy"]
        if not isinstance(xy, list):
            raise TypeError("features.xy is not a list")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not an xBD label file with features.xy ({exc})") from exc
    uids, wkts, values = [], [], []
    unclassified = 0
    for i, feature in enumerate(xy):
        props = (feature.get("properties") if isinstance(feature, dict) else None) or {}
        if props.get("feature_type", "building") != "building":
            continue
        uid = str(props.get("uid") or f"#{i}")
        subtype = str(props.get("subtype") or "").strip().lower()
        if subtype not in XVIEW2_VALUES:
            what = f"damage subtype {subtype!r}" if subtype else "no damage subtype"
            raise ValueError(
                f"{path}: building {uid} has {what}; targets need a post-disaster label with "
                f"one of {', '.join(XVIEW2_VALUES)}"
            )
        unclassified += subtype == UNCLASSIFIED
        wkt = feature.get("wkt")
        uids.append(uid)
        wkts.append(wkt if isinstance(wkt, str) else None)
        values.append(XVIEW2_VALUES[subtype])
    geoms = shapely.from_wkt(np.array(wkts, dtype=object), on_invalid="ignore") if wkts else []
    skipped = [
        (uid, "invalid or empty polygon WKT")
        for uid, g in zip(uids, geoms, strict=True)
        if g is None or g.is_empty
    ]
    damage = rasterize_values(list(geoms), values, shape)
    return XView2Targets(
        localization=(damage > 0).astype(np.uint8),
        damage=damage,
        buildings=len(uids) - len(skipped),
        unclassified=unclassified,
        skipped=skipped,
    )


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
    """``len(f1s) / sum(1 / (f1 + epsilon))``: the reference's damage F1 of the class F1s.

    With ``epsilon`` 0 it is the plain harmonic mean, exactly 0 when any F1 is 0 (as the
    per-building ``xview2_damage_f1`` of the evaluation metrics takes it).

    Raises:
        ValueError: no F1 scores, or a negative one.
    """
    arr = np.asarray(f1s, dtype=np.float64)
    if arr.size == 0:
        raise ValueError("no F1 scores to combine")
    if np.any(arr < 0):
        raise ValueError(f"F1 scores must be non-negative, got {arr.tolist()}")
    shifted = arr + epsilon
    if np.any(shifted == 0):
        return 0.0
    return float(arr.size / np.sum(1.0 / shifted))


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
