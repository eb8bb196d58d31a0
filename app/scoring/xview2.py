"""`local-damage evaluate xview2`: the xView2 challenge score of a model on xBD tiles.

For every selected tile, the targets are drawn from its post label's polygons
(:func:`data_prep.xview2.xview2_targets`) and the predictions are what the product
outputs when it scores the tile (:func:`app.scoring.xbd.score_xbd` and its class raster), then the pixel
counts are pooled over the tiles and scored as the challenge's scorer does
(:mod:`data_prep.xview2`):

- **footprints given**: every label polygon is a predicted building (so localisation F1 is 1 by
  construction), and its pixels carry the model's grade (class id 0-3 -> xView2 value 1-4).
  A building the model does not grade (``not_covered``, or ``skipped``, e.g. blank imagery) keeps
  its footprint but no grade (0): its pixels count as misses of its true class.
- **footprints detected** (``--localizer``): the localiser's building mask on the pre image is
  the localisation prediction; its polygons are graded like footprints and their pixels carry the
  grade, which the scorer counts only where the mask has a building.

Outputs in ``OUT/``: ``metrics.json`` (per mode: score, localisation and damage F1, per-class
precision / recall / F1 and pixel counts, and every tile's counts), ``given/`` (and
``detected/``) with each tile's graded buildings (``<tile>.gpkg``, pixel coordinates) and class
raster (``<tile>.tif``), and with ``--pngs`` the scorer's own input layout under ``xview2/``
(``targets/test_{localization,damage}_NNNNN_target.png`` and ``predictions_<mode>/...``), so the
challenge's ``xview2_metrics.py`` can be run on the same rasters.

Tiles the model was trained on (:mod:`runtime.training_tiles`; for the detected footprints, the
localiser's too) give in-sample figures: every such tile is marked in ``metrics.json``, a row
pooled over any of them is marked "in the model's training data" in the table, the figures of
the other tiles are given apart, and the published test-set figures are printed only beside
rows of tiles the models never trained on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from app.scoring.common import ScoreOptions
from app.scoring.outputs import RASTER_NODATA
from app.scoring.writer import OutputPaths
from app.scoring.xbd import score_xbd
from data_prep.errors import LocalDamageError
from data_prep.imagery import read_rgb
from data_prep.mosaic import SceneError
from data_prep.split import load_splits
from data_prep.store import write_json
from data_prep.text_table import Column, text_table
from data_prep.xbd_tiles import as_roots, find_tiles, roots_label
from data_prep.xview2 import XView2Counts, xview2_targets
from runtime.localizer import Localizer
from runtime.predictor import Predictor
from runtime.training_tiles import IN_TRAINING, NOT_COMPARABLE, TrainingTiles, training_tiles

if TYPE_CHECKING:
    from data_prep.xbd_tiles import XbdTile

METRICS_JSON = "metrics.json"
#: Published (localisation F1, damage F1, overall) on the full xBD test set, for the table.
PUBLISHED = {
    "MambaBDA (ChangeMamba), xBD test set": (0.874, 0.788, 0.814),
    "xView2 baseline, xBD test set": (0.805, 0.034, 0.265),
}


class XView2EvaluationError(LocalDamageError, ValueError):
    """Input that cannot be scored: names the file or option at fault and what to do."""


@dataclass
class TileResult:
    """One tile's predictions for one mode.

    Attributes:
        loc_pred: uint8 [H, W] predicted buildings (1) for the scorer.
        damage_pred: uint8 [H, W] xView2 damage value 1-4 of the graded buildings, 0 elsewhere.
        buildings: footprints handed to the model (label polygons, or detected ones).
        graded: of those, the ones it graded.
    """

    loc_pred: np.ndarray
    damage_pred: np.ndarray
    buildings: int
    graded: int


# ------------------------------------------------------------------------------------ tiles


@dataclass(frozen=True)
class TileSelection:
    """Which xBD tiles :func:`evaluate_xview2` scores (:func:`select_tiles`).

    Attributes:
        tiles: tile names (``<event>_<id>``); None: by ``fold``, or every tile.
        chips: chip store whose ``splits.csv`` deals tiles to folds (with ``fold``).
        fold: score the tiles of this fold of ``chips``.
    """

    tiles: Sequence[str] | None = None
    chips: str | Path | None = None
    fold: int | None = None


def select_tiles(
    root: str | Path | Sequence[str | Path],
    tiles: Sequence[str] | None = None,
    chips: str | Path | None = None,
    fold: int | None = None,
) -> tuple[list[XbdTile], str]:
    """The xBD tiles to score and a description of the selection.

    Args:
        root: xBD root (``images/`` and ``labels/``, or split folders), or several.
        tiles: tile names (``<event>_<id>``); None: by ``fold``, or every tile.
        chips: chip store whose ``splits.csv`` deals tiles to folds (with ``fold``).
        fold: score the tiles of this fold of ``chips``.

    Raises:
        XView2EvaluationError: a named tile is not under ``root``, or lacks its pre image, post
            image or post label; ``fold`` without ``chips``; the selection is empty.
        FileNotFoundError, ValueError: from reading ``splits.csv`` (a message naming the file).
    """
    found, _ = find_tiles(root)
    by_name = {t.name: t for t in found}
    if tiles and fold is not None:
        raise XView2EvaluationError("give --tiles or --fold, not both")
    if fold is not None:
        if chips is None:
            raise XView2EvaluationError(
                "--fold needs --chips: the chip store whose splits.csv deals tiles to folds"
            )
        splits = load_splits(chips)
        folds = sorted(set(splits["fold"]))
        if fold not in folds:
            raise XView2EvaluationError(
                f"{Path(chips) / 'splits.csv'}: no fold {fold}; its folds are {folds}"
            )
        names = sorted(set(splits.loc[splits["fold"] == fold, "tile"]))
        description = f"the {len(names)} tiles of fold {fold} of {Path(chips) / 'splits.csv'}"
    elif tiles:
        names = list(dict.fromkeys(tiles))
        description = f"{len(names)} named tile(s)"
    else:
        names = [t.name for t in found if t.label_exists]
        description = f"every labelled tile under {roots_label(root)}"
    missing = [n for n in names if n not in by_name]
    if missing:
        raise XView2EvaluationError(
            f"{roots_label(root)}: tile(s) not found: {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + " (names are <event>_<id>, as in images/<event>_<id>_pre_disaster.png)"
        )
    selected = [by_name[n] for n in names]
    for t in selected:
        if not t.label_exists:
            raise XView2EvaluationError(
                f"{t.label}: post-disaster label not found; the targets are drawn from it"
            )
        for what, path in (("pre", t.pre), ("post", t.post)):
            if path is None:
                raise XView2EvaluationError(
                    f"{t.images_dir / f'{t.name}_{what}_disaster.png'}: {what}-disaster image "
                    "not found"
                )
    if not selected:
        raise XView2EvaluationError(f"{roots_label(root)}: no tile to score in {description}")
    return selected, description


def _image_shape(path: Path) -> tuple[int, int]:
    import warnings

    import rasterio
    from rasterio.errors import NotGeoreferencedWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGeoreferencedWarning)
        with rasterio.open(path) as src:
            return src.height, src.width


def _read_class_raster(path: Path) -> np.ndarray:
    """xView2 damage values 1-4 from a class raster of class ids 0-3 (0 where no building)."""
    import warnings

    import rasterio
    from rasterio.errors import NotGeoreferencedWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGeoreferencedWarning)
        with rasterio.open(path) as src:
            ids = src.read(1)
    return np.where(ids == RASTER_NODATA, 0, ids.astype(np.int16) + 1).astype(np.uint8)


# ---------------------------------------------------------------------------- predictions


def _grade(
    predictor: Predictor,
    tile: XbdTile,
    label: Path,
    out: Path,
    shape: tuple[int, int],
    batch_size: int,
) -> tuple[np.ndarray, int, int]:
    """Grade the polygons of ``label`` on the tile's images; ``(damage raster 0-4, buildings,
    graded)``."""
    out.mkdir(parents=True, exist_ok=True)
    report = score_xbd(
        predictor,
        tile.pre,
        tile.post,
        label,
        OutputPaths(out / f"{tile.name}.gpkg", raster=out / f"{tile.name}.tif"),
        name=tile.name,
        options=ScoreOptions(batch_size=batch_size, progress=False),
    )
    damage = _read_class_raster(out / f"{tile.name}.tif")
    if damage.shape != tuple(shape):
        raise XView2EvaluationError(
            f"{out / f'{tile.name}.tif'}: {damage.shape} px, the image {shape} px"
        )
    return damage, int(report.buildings), int(report.scored)


def predict_given(
    predictor: Predictor, tile: XbdTile, loc_target: np.ndarray, out: Path, batch_size: int = 32
) -> TileResult:
    """Footprints given: the label polygons are the buildings, graded by the model."""
    damage, buildings, graded = _grade(
        predictor, tile, tile.label, out, loc_target.shape, batch_size
    )
    # the given footprints are the label polygons, so the predicted buildings are the target's
    return TileResult(loc_target.copy(), damage, buildings, graded)


def load_localizer(path: str | Path):
    """The localiser runtime (:class:`runtime.localizer.Localizer`) over an exported model.

    Raises:
        XView2EvaluationError: the model file is missing.
        ModelError: the file is not a localiser model.
    """
    path = Path(path)
    if not path.is_file():
        raise XView2EvaluationError(f"{path}: localiser model not found")
    return Localizer(path)


def detect_buildings(localizer, tile: XbdTile) -> tuple[np.ndarray, list]:
    """The localiser's building mask of the tile's pre image, and its building polygons.

    The mask is :meth:`runtime.localizer.Localizer.mask` (threshold, small blobs dropped), the
    polygons are drawn from that mask by :meth:`~runtime.localizer.Localizer.polygons`, as scoring
    without footprints draws them.

    Returns:
        ``(mask, polygons)``: bool [H, W] and shapely polygons in pixel coordinates.
    """
    mask = np.asarray(localizer.mask(read_rgb(tile.pre))).astype(bool)
    return mask, list(localizer.polygons(mask))


def predict_detected(
    predictor: Predictor,
    tile: XbdTile,
    mask: np.ndarray,
    polygons: Sequence,
    out: Path,
    batch_size: int = 32,
) -> TileResult:
    """Footprints detected: ``mask`` is the predicted buildings, ``polygons`` (pixel
    coordinates) are graded by the model as footprints."""
    shape = _image_shape(tile.pre)
    mask = np.asarray(mask).astype(bool)
    if mask.shape != shape:
        raise XView2EvaluationError(
            f"{tile.pre}: the localiser's mask is {mask.shape[1]}x{mask.shape[0]} px, the image "
            f"{shape[1]}x{shape[0]} px"
        )
    polygons = [g for g in polygons if g is not None and not g.is_empty]
    if not polygons:
        return TileResult(mask.astype(np.uint8), np.zeros(shape, np.uint8), 0, 0)
    out.mkdir(parents=True, exist_ok=True)
    label = out / f"{tile.name}_detected.json"  # the detected footprints as an xBD label
    features = [
        {"properties": {"feature_type": "building", "uid": f"detected-{i}"}, "wkt": g.wkt}
        for i, g in enumerate(polygons)
    ]
    label.write_text(json.dumps({"features": {"xy": features}, "metadata": {}}))
    damage, buildings, graded = _grade(predictor, tile, label, out, shape, batch_size)
    return TileResult(mask.astype(np.uint8), damage, buildings, graded)


# ----------------------------------------------------------------------------- evaluation


def _write_png(path: Path, raster: np.ndarray) -> None:
    import cv2

    path.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(path), raster.astype(np.uint8)):
        raise OSError(f"{path}: could not write the PNG")


def evaluate_xview2(
    root: str | Path | Sequence[str | Path],
    model: str | Path,
    out: str | Path,
    selection: TileSelection | None = None,
    localizer: str | Path | None = None,
    pngs: bool = False,
    batch_size: int = 32,
    progress: bool = False,
) -> dict[str, Any]:
    """Score a damage model (and a localiser) on xBD tiles with the xView2 metric.

    Args:
        root: xBD root, or several (their tiles together).
        model: the damage model (``.onnx``).
        out: output folder.
        selection: which tiles (:class:`TileSelection`; default: every tile of ``root``).
        localizer: a localiser model: also score with the footprints it detects.
        pngs: also write the scorer's PNG layout under ``OUT/xview2``.
        batch_size: chips per inference batch.
        progress: show a progress bar over tiles.

    Returns:
        The dict written to ``OUT/metrics.json``: ``modes`` (``given`` and, with a localiser,
        ``detected``: the figures of :meth:`data_prep.xview2.XView2Counts.scores` plus
        ``buildings`` and ``graded``), ``tiles`` (per tile and mode: buildings, graded, counts),
        ``failed`` (tiles left out, with the reason), ``selection``, ``source`` and ``targets``.

    Raises:
        XView2EvaluationError, XbdRootError, ModelError, FileNotFoundError: bad inputs, before
            anything is scored. A tile that fails while being scored is left out, listed in
            ``failed``, and the scores are of the other tiles.
    """
    if batch_size < 1:
        raise XView2EvaluationError(f"--batch-size must be at least 1, got {batch_size}")
    roots = as_roots(root)
    selection = selection or TileSelection()
    selected, description = select_tiles(roots, selection.tiles, selection.chips, selection.fold)
    predictor = Predictor(model)
    loc_model = load_localizer(localizer) if localizer is not None else None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    modes = ["given"] + (["detected"] if loc_model is not None else [])
    trained = {"given": training_tiles(predictor.metadata, "damage model")}
    if loc_model is not None:
        localiser = training_tiles(getattr(loc_model, "metadata", {}), "localiser")
        trained["detected"] = trained["given"].union(localiser)
    counts = {m: XView2Counts() for m in modes}
    totals = {m: {"buildings": 0, "graded": 0} for m in modes}
    held = {m: XView2Counts() for m in modes}  # the tiles no model of the mode trained on
    held_totals = {m: {"buildings": 0, "graded": 0} for m in modes}
    per_tile: list[dict[str, Any]] = []
    failed: list[dict[str, str]] = []
    target_info = {"buildings": 0, "unclassified": 0, "skipped": 0}
    for index, tile in enumerate(
        tqdm(selected, desc="tiles", unit="tile", disable=None if progress else True)
    ):
        try:
            shape = _image_shape(tile.pre)
            targets = xview2_targets(tile.label, shape)
            results = {
                "given": predict_given(
                    predictor, tile, targets.localization, out / "given", batch_size
                )
            }
            if loc_model is not None:
                mask, polygons = detect_buildings(loc_model, tile)
                results["detected"] = predict_detected(
                    predictor, tile, mask, polygons, out / "detected", batch_size
                )
        except (SceneError, ValueError, OSError) as exc:
            failed.append({"tile": tile.name, "reason": str(exc)})
            continue
        row: dict[str, Any] = {"tile": tile.name, "id": f"{index:05d}", "modes": {}}
        for mode, result in results.items():
            tile_counts = XView2Counts()
            tile_counts.add(
                result.loc_pred, result.damage_pred, targets.localization, targets.damage
            )
            counts[mode] += tile_counts
            totals[mode]["buildings"] += result.buildings
            totals[mode]["graded"] += result.graded
            inside = trained[mode].among([tile.name])
            if inside == []:
                held[mode] += tile_counts
                held_totals[mode]["buildings"] += result.buildings
                held_totals[mode]["graded"] += result.graded
            row["modes"][mode] = {
                "buildings": result.buildings,
                "graded": result.graded,
                "localization": tile_counts.loc.tolist(),
                "damage": tile_counts.damage.tolist(),
                "in_training_data": None if inside is None else bool(inside),
            }
            if pngs:
                base = out / "xview2" / f"predictions_{mode}"
                _write_png(base / f"test_localization_{index:05d}_prediction.png", result.loc_pred)
                _write_png(base / f"test_damage_{index:05d}_prediction.png", result.damage_pred)
        if pngs:
            base = out / "xview2" / "targets"
            _write_png(base / f"test_localization_{index:05d}_target.png", targets.localization)
            _write_png(base / f"test_damage_{index:05d}_target.png", targets.damage)
        target_info["buildings"] += targets.buildings
        target_info["unclassified"] += targets.unclassified
        target_info["skipped"] += len(targets.skipped)
        per_tile.append(row)
    if not per_tile:
        reasons = "; ".join(f"{f['tile']}: {f['reason']}" for f in failed[:3])
        raise XView2EvaluationError(f"no tile could be scored ({reasons})")
    scored = [row["tile"] for row in per_tile]
    metrics: dict[str, Any] = {
        "modes": {m: {**counts[m].scores(), **totals[m]} for m in modes},
        "training_data": {m: _overlap(trained[m], scored) for m in modes},
        "held_out": {
            m: {**held[m].scores(), **held_totals[m]}
            for m in modes
            if 0 < held[m].tiles < len(scored)
        },
        "selection": description,
        "tiles": per_tile,
        "failed": failed,
        "targets": {
            **target_info,
            "unclassified_as": "no-damage (1)",
            "rule": "label polygons (post label features.xy), pixel centre inside, later wins",
        },
        "source": {
            "root": [str(r) for r in roots],
            "model": str(model),
            "localizer": None if localizer is None else str(localizer),
            "chips": None if selection.chips is None else str(selection.chips),
            "fold": selection.fold,
            "scorer": "xview2_metrics.py of github.com/DIUx-xView/xView2_scoring",
        },
    }
    write_json(out / METRICS_JSON, metrics)
    return metrics


def _overlap(trained: TrainingTiles, tiles: Sequence[str]) -> dict[str, Any]:
    """The ``training_data`` entry of one mode: what is known of the models' training tiles and
    which of the scored ``tiles`` are among them."""
    return {**trained.to_dict(), "tiles_in_training": trained.among(tiles)}


def _class_f1(i: int) -> Column:
    """The damage F1 of the ``i``-th class of a row's ``damage`` figures."""
    name = ("no", "minor", "major", "destr")[i]
    return Column(name, lambda r: list(r["damage"].values())[i]["f1"], ".3f", width=7)


#: The table's columns, over a mode's figures with its row name; the published rows have the
#: first four only.
_COLUMNS = [
    Column("footprints", "name", align="<", width=52),
    Column("loc F1", "localization_f1", ".3f", width=8),
    Column("dmg F1", "damage_f1", ".3f", width=8),
    Column("overall", "score", ".3f", width=9),
    *(_class_f1(i) for i in range(4)),
]


def format_table(metrics: dict[str, Any], published: bool = True) -> str:
    """The xView2 figures as a plain-text table, one row per mode, and the published rows.

    A row pooled over tiles the models trained on is marked ``*`` (:data:`IN_TRAINING`), with a
    row of the other tiles beneath it when there are some. The published test-set rows are
    printed only when some row is of held-out tiles alone, and the lines under the table say
    which rows they compare with; when the training tiles are unknown, the lines say so.
    """
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    comparable, unknown = False, []
    for mode, m in metrics["modes"].items():
        overlap = (metrics.get("training_data") or {}).get(mode) or {}
        inside = overlap.get("tiles_in_training")
        name = f"{mode} ({m['tiles']} tiles, {m['graded']}/{m['buildings']} graded)"
        if not overlap.get("known", False):
            unknown.append(f"{mode}: {overlap.get('source', 'no record of them')}")
            comparable = True
            rows.append({**m, "name": name})
        elif not inside:
            comparable = True
            rows.append({**m, "name": name})
            notes.append(f"{mode}: none of the {m['tiles']} tiles is {IN_TRAINING}")
        else:
            rows.append({**m, "name": name + " *"})
            notes.append(
                f"* {mode}: {len(inside)} of {m['tiles']} tiles {IN_TRAINING} "
                f"({', '.join(inside[:4])}{', ...' if len(inside) > 4 else ''})"
            )
            h = (metrics.get("held_out") or {}).get(mode)
            if h:
                comparable = True
                rows.append(
                    {
                        **h,
                        "name": f"{mode}, held-out tiles only ({h['tiles']} tiles, "
                        f"{h['graded']}/{h['buildings']} graded)",
                    }
                )
    lines = text_table(_COLUMNS, rows, "")
    if published and comparable:
        lines += text_table(
            _COLUMNS[:4],
            [
                {"name": name, "localization_f1": lf1, "damage_f1": df1, "score": score}
                for name, (lf1, df1, score) in PUBLISHED.items()
            ],
            "",
        )[1:]
    if notes:
        notes.append(
            f"{NOT_COMPARABLE}; "
            + (
                "the published rows compare with the unmarked rows only"
                if published and comparable
                else "published figures left out"
            )
        )
    for text in unknown:
        notes.append(
            f"training tiles unknown ({text}): the comparison with published figures holds only "
            "if the models never trained on these tiles"
        )
    return "\n".join(lines + notes)
