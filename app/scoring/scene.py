"""Scoring: a damage grade and class probabilities for every building of a scene, without torch.

Chips are cut by the same ``data_prep`` code that made the training chips, with the chip spec
stored in the model, and graded by an ONNX model through :class:`runtime.predictor.Predictor`:

- :func:`score_scene`: georeferenced pre/post GeoTIFF tiles (any CRS and resolution, mosaicked
  virtually on the pre grid, post warped onto it) and a footprint file (GeoJSON, GeoPackage or
  Shapefile, any CRS). Buildings are read one block of the grid at a time
  (:func:`data_prep.scene.iter_building_chips`), so memory does not grow with the scene's size.
- :func:`app.scoring.xbd.score_xbd`: one xBD pre/post image pair (PNG or TIFF, pixel aligned) and
  an xBD label JSON whose ``features.xy`` polygons are the buildings (its own module, on the
  shared machinery here).

Many scenes at once: :mod:`app.scoring.batch`.

Each input feature gives one output feature: its geometry and attributes (an input attribute
whose name an output column takes is renamed ``input_<name>``), then ``damage`` (class name),
``damage_id`` (0-3), one ``p_<class>`` probability per class (``-`` becomes ``_``),
``confidence`` (the largest probability), ``flags`` (why the grade should be checked, ``;``-joined
names from :mod:`runtime.flags`, empty when none) and ``status``: ``scored``, ``not_covered`` (not
entirely inside valid pre and post imagery) or ``skipped: <reason>`` (e.g. ``skipped: blank
imagery (...)`` for a building whose chip is one flat value, flagged ``blank``); the score columns
are null for buildings that were not scored. Pixel values follow the radiometric rule of
:mod:`data_prep.radiometry`, and every image or window is held to the pixel limit of
:mod:`data_prep.quality` before it is decoded. Outputs are written under temporary names and renamed into
place; the vector file is written last, so its presence means the scene is finished.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from app.scoring.outputs import (
    OutputError,
    overlay_size,
    vector_format,
)
from data_prep.report import Skipped

if TYPE_CHECKING:
    from runtime.predictor import Predictor

#: ``status`` of a building that was graded.
SCORED = "scored"
#: ``status`` of a building not entirely inside valid pre and post imagery.
NOT_COVERED = "not_covered"
#: ``status`` prefix of a building left out, followed by the reason.
SKIPPED = "skipped"
#: GeoTIFF suffixes of input imagery and of the class raster output.
RASTER_SUFFIXES = (".tif", ".tiff")
#: Default side, in grid pixels, of the blocks whose buildings share one read.
BLOCK_SIZE = 1024
#: GDAL raster block cache while scoring, in MiB, unless GDAL_CACHEMAX is set in the environment.
#: GDAL's own default (5% of RAM) lets the cache of decoded blocks grow with the scene.
GDAL_CACHE_MB = 16


@contextmanager
def bounded_gdal_cache():
    """A rasterio environment whose GDAL block cache is :data:`GDAL_CACHE_MB` MiB (or, when
    the environment variable is set, ``GDAL_CACHEMAX``)."""
    import rasterio

    if os.environ.get("GDAL_CACHEMAX"):
        with rasterio.Env():
            yield
        return
    with rasterio.Env(GDAL_CACHEMAX=GDAL_CACHE_MB * 2**20):
        yield


@dataclass
class ScoreReport:
    """What scoring one scene produced.

    Attributes:
        scene: scene name.
        class_names: the model's classes.
        buildings: features in the input (one output feature each).
        per_class: scored buildings per predicted class name.
        not_covered: buildings not entirely inside valid pre and post imagery.
        skipped: buildings and tiles left out, with the reason.
        outputs: kind (``vector``, ``raster``, ``overlay``) -> path written.
        seconds: wall time of the whole scene (chips, inference and writing).
        alignment: the post-to-pre shift measured and whether it was corrected
            (:meth:`data_prep.alignment.SceneShift.to_dict`).
        detected: buildings found by the localiser when no footprints were given (None when
            footprints were given; :mod:`app.scoring.detect`).
    """

    scene: str
    class_names: tuple[str, ...]
    buildings: int = 0
    per_class: Counter = field(default_factory=Counter)
    not_covered: int = 0
    skipped: list[Skipped] = field(default_factory=list)
    outputs: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    alignment: dict | None = None
    alignment_text: str = ""
    detected: int | None = None

    @property
    def scored(self) -> int:
        return int(sum(self.per_class.values()))

    @property
    def buildings_per_second(self) -> float:
        return self.buildings / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "scene": self.scene,
            "buildings": self.buildings,
            "scored": self.scored,
            "per_class": {name: self.per_class.get(name, 0) for name in self.class_names},
            "not_covered": self.not_covered,
            "skipped": [{"item": s.item, "reason": s.reason} for s in self.skipped],
            "outputs": dict(self.outputs),
            "seconds": round(self.seconds, 3),
            "buildings_per_second": round(self.buildings_per_second, 2),
            "scored_per_second": round(self.scored / self.seconds if self.seconds > 0 else 0.0, 2),
            "alignment": self.alignment,
            "detected": self.detected,
        }

    def summary(self) -> str:
        lines = [
            f"scene {self.scene}: {self.buildings} building(s), {self.scored} scored in "
            f"{self.seconds:.1f} s ({self.buildings_per_second:.1f} buildings/s, "
            f"{self.scored / self.seconds if self.seconds > 0 else 0.0:.1f} scored/s)",
            "per class: " + ", ".join(f"{n} {self.per_class.get(n, 0)}" for n in self.class_names),
        ]
        if self.detected is not None:
            lines.insert(0, f"no footprints given: {self.detected} building(s) detected")
        if self.alignment_text:
            lines.append(self.alignment_text)
        if self.not_covered:
            lines.append(f"not covered by both pre and post imagery: {self.not_covered}")
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} item(s):")
            lines.extend(f"  - {s}" for s in self.skipped)
        lines.extend(f"wrote {path}" for path in self.outputs.values())
        return "\n".join(lines)


def probability_columns(class_names: Sequence[str]) -> list[str]:
    """Output column of each class probability: ``p_`` + the name with ``-`` as ``_``."""
    return ["p_" + name.replace("-", "_").replace(" ", "_") for name in class_names]


def check_outputs(
    out: str | os.PathLike,
    raster: str | os.PathLike | None = None,
    overlay: str | os.PathLike | None = None,
) -> str:
    """Validate output paths before any work; returns the vector format.

    Raises:
        OutputError: an unknown vector suffix, a raster that is not ``.tif``/``.tiff`` or an
            overlay that is not ``.png``.
    """
    fmt = vector_format(out)
    if raster is not None and Path(raster).suffix.lower() not in RASTER_SUFFIXES:
        raise OutputError(f"{raster}: the class raster is a GeoTIFF; give a .tif path")
    if overlay is not None and Path(overlay).suffix.lower() != ".png":
        raise OutputError(f"{overlay}: the overlay is written as PNG; give a .png path")
    return fmt


class _Scores:
    """Per-feature results: status text, class id (-1 unscored), probabilities (NaN) and
    flags (``;``-joined, empty when none)."""

    def __init__(self, n: int, k: int):
        self.status = np.full(n, NOT_COVERED, dtype=object)
        self.class_id = np.full(n, -1, dtype=np.int64)
        self.probs = np.full((n, k), np.nan, dtype=np.float64)
        self.flags = np.full(n, "", dtype=object)
        self.source = (
            "given"  # where the buildings came from: given or detected (app.scoring.detect)
        )

    def skip(self, row: int, reason: str) -> None:
        """Mark a building not scored for ``reason``; a blank chip is also flagged ``blank``."""
        from data_prep.quality import BLANK
        from runtime.flags import BLANK as BLANK_FLAG

        self.status[row] = f"{SKIPPED}: {reason}"
        if reason.startswith(BLANK):
            self.flags[row] = BLANK_FLAG

    def columns(self, class_names: Sequence[str]) -> tuple[dict, dict]:
        unscored = self.class_id < 0
        names = np.array(list(class_names), dtype=object)
        damage = np.where(unscored, None, names[np.clip(self.class_id, 0, len(names) - 1)])
        cols: dict[str, np.ndarray] = {
            "damage": damage.astype(object),
            "damage_id": np.where(unscored, 0, self.class_id).astype(np.int32),
        }
        masks: dict[str, np.ndarray] = {"damage": unscored, "damage_id": unscored}
        for j, col in enumerate(probability_columns(class_names)):
            cols[col] = np.where(unscored, 0.0, np.round(self.probs[:, j], 6))
            masks[col] = unscored
        cols["confidence"] = np.where(
            unscored, 0.0, np.round(np.nan_to_num(self.probs).max(axis=1), 6)
        )
        masks["confidence"] = unscored
        cols["flags"] = self.flags.astype(object)
        cols["status"] = self.status.astype(object)
        cols["source"] = np.full(len(self.status), self.source, dtype=object)
        return cols, masks


class _Batcher:
    """Collects chip pairs, grades them ``batch_size`` at a time and flags them."""

    def __init__(self, predictor: Predictor, scores: _Scores, batch_size: int):
        from runtime.flags import Flagger

        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.predictor, self.scores, self.batch_size = predictor, scores, batch_size
        self.flagger = Flagger(predictor.metadata)
        self.rows: list[int] = []
        self.pre: list[np.ndarray] = []
        self.post: list[np.ndarray] = []
        self.context: list[float | None] = []

    def add(
        self, row: int, pre: np.ndarray, post: np.ndarray, context_px: float | None = None
    ) -> None:
        """Queue a chip pair; ``context_px`` is its residual shift measured on the imagery
        around the building (:func:`data_prep.residual.context_residual`), None when there is
        none (the chips alone are measured)."""
        self.rows.append(row)
        self.pre.append(pre)
        self.post.append(post)
        self.context.append(context_px)
        if len(self.rows) >= self.batch_size:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        from runtime.flags import flags_text

        pre, post = np.stack(self.pre), np.stack(self.post)
        pred = self.predictor.predict(pre, post, batch_size=self.batch_size)
        probs = np.asarray(pred.probabilities, dtype=np.float64)
        rows = np.asarray(self.rows)
        self.scores.probs[rows] = probs
        self.scores.class_id[rows] = probs.argmax(axis=1)
        self.scores.status[rows] = SCORED
        flags = self.flagger.batch(pre, post, pred.embedding, context_px=self.context)
        for row, names in zip(rows, flags, strict=True):
            self.scores.flags[row] = flags_text(names)
        self.rows, self.pre, self.post, self.context = [], [], [], []


def _merge_attributes(
    attributes: Mapping[str, np.ndarray], score_columns: Mapping[str, np.ndarray]
) -> tuple[dict, dict[str, str]]:
    """Input attributes first, renamed ``input_<name>`` where an output column takes the name."""
    taken = {c.lower() for c in score_columns}
    merged: dict[str, np.ndarray] = {}
    renamed: dict[str, str] = {}
    for name, values in attributes.items():
        new = name
        while new.lower() in taken or new.lower() in {m.lower() for m in merged}:
            new = f"input_{new}"
        if new != name:
            renamed[name] = new
        merged[new] = values
    return merged, renamed


def _report_counts(report: ScoreReport, scores: _Scores) -> None:
    for cid in scores.class_id[scores.class_id >= 0]:
        report.per_class[report.class_names[int(cid)]] += 1
    report.not_covered = int(np.sum(scores.status == NOT_COVERED))


@contextmanager
def _all_or_nothing(report: ScoreReport):
    """Remove the outputs already written for a scene when a later step fails."""
    try:
        yield
    except BaseException:
        for path in report.outputs.values():
            Path(path).unlink(missing_ok=True)
        report.outputs.clear()
        raise


#: Output metadata key (GeoPackage layer metadata, GeoJSON collection member) of the alignment.
ALIGNMENT_KEY = "local_damage_alignment"


def _model_metadata(predictor: Predictor, report: ScoreReport | None = None) -> dict[str, str]:
    try:
        card = predictor.card()
    except Exception:  # the card is informative only
        card = {}
    out = {"local_damage_model": json.dumps(card, default=str, sort_keys=True)}
    if report is not None and report.alignment is not None:
        out[ALIGNMENT_KEY] = json.dumps(report.alignment, sort_keys=True)
    return out


# --------------------------------------------------------------------------- scene mode


@dataclass
class _FeatureTable:
    """All features of a footprint file: source geometries, attributes, ids and CRS."""

    geometries: np.ndarray  # [N] shapely or None, in the file's CRS
    attributes: dict[str, np.ndarray]
    masks: dict[str, np.ndarray]
    uids: list[str]
    crs: str


def _read_features(path: str | os.PathLike, layer=None) -> _FeatureTable:
    """Every feature of a footprint file, as OGR reads it (the same read as load_footprints)."""
    import shapely
    from pyogrio.raw import read

    meta, fids, wkb, values = read(str(path), layer=layer, force_2d=True, return_fids=True)
    n = 0 if wkb is None else len(wkb)
    geoms = np.empty(n, dtype=object)
    geoms[:] = [None if g is None else shapely.from_wkb(g) for g in (wkb if n else [])]
    attributes: dict[str, np.ndarray] = {}
    masks: dict[str, np.ndarray] = {}
    for name, arr in zip(meta["fields"], values, strict=True):
        arr = np.asarray(arr)
        if arr.dtype == object:
            masks[str(name)] = np.array([v is None for v in arr], dtype=bool)
        elif np.issubdtype(arr.dtype, np.floating):
            masks[str(name)] = ~np.isfinite(arr)
        attributes[str(name)] = arr
    fids = np.arange(n) if fids is None else np.asarray(fids)
    uid = attributes.get("uid")
    texts = None if uid is None else ["" if v is None else str(v) for v in uid]
    if texts is not None and all(texts) and len(set(texts)) == len(texts):
        uids = texts
    else:
        uids = [str(int(f)) for f in fids]
    return _FeatureTable(geoms, attributes, masks, uids, meta.get("crs") or "")


def _to_crs(geometries: np.ndarray, src, dst) -> np.ndarray:
    """Reproject geometries (None kept); those that cannot be transformed become None."""
    import shapely

    from data_prep.mosaic import reproject_geometries

    out = np.empty(len(geometries), dtype=object)
    present = np.array([g is not None for g in geometries], dtype=bool)
    if present.any():
        moved = reproject_geometries(geometries[present], src, dst)
        finite = np.isfinite(shapely.bounds(moved)).all(axis=1)
        out[np.flatnonzero(present)] = np.where(finite, moved, None)
    return out


def score_scene(
    predictor: Predictor,
    pre: Sequence[str | os.PathLike],
    post: Sequence[str | os.PathLike],
    buildings: str | os.PathLike | None,
    out: str | os.PathLike,
    *,
    raster: str | os.PathLike | None = None,
    overlay: str | os.PathLike | None = None,
    batch_size: int = 32,
    block_size: int = BLOCK_SIZE,
    name: str | None = None,
    progress: bool = True,
    max_pixels: int | None = None,
    align: str = "auto",
    localizer=None,
    source: str = "given",
) -> ScoreReport:
    """Grade every building of a georeferenced scene and write the outputs.

    Before any chip is cut, the post-to-pre shift of the scene is measured and, when it is
    confident and longer than a pixel, corrected (:func:`data_prep.alignment.align_scene`); the
    report and the output metadata (GeoPackage layer metadata / GeoJSON collection member
    ``local_damage_alignment``) record it.

    Args:
        predictor: the loaded ONNX model (its chip spec decides how chips are cut).
        pre: pre-disaster GeoTIFF tiles (any CRS and resolution; earlier wins on overlaps).
        post: post-disaster GeoTIFF tiles.
        buildings: footprint file (GeoJSON, GeoPackage or Shapefile, any CRS); None to detect
            the buildings with ``localizer`` (:mod:`app.scoring.detect`).
        out: ``.geojson`` (RFC 7946, EPSG:4326) or ``.gpkg`` (pre-grid CRS) per-building output.
        raster: optional ``.tif``: Cloud-Optimised GeoTIFF of class ids on the pre grid.
        overlay: optional ``.png``: post image with footprints in class colours and a legend.
        batch_size: chips per inference batch.
        block_size: side in grid pixels of the blocks whose buildings share one read; memory
            grows with its square, not with the scene.
        name: scene name (default: the footprint file's stem); the GeoPackage layer name.
        progress: show a progress bar over buildings.
        max_pixels: pixel limit per internal block and per read window (default
            :func:`data_prep.quality.max_pixels`).
        align: ``auto`` (measure the post-to-pre shift, correct it when confident) or ``off``.
        localizer: the :class:`runtime.localizer.Localizer` that finds the buildings when
            ``buildings`` is None (default: the bundled one, when present).
        source: the output ``source`` of every building: ``given``, or ``detected`` for a
            footprint file the localiser wrote.

    Returns:
        The report (per-class counts, not covered, skipped, outputs, time, alignment, buildings
        detected).

    Raises:
        SceneError: no usable pre or post tile, pre and post without overlap, an unreadable or
            empty footprint file, or footprints outside the imagery (nothing is written).
        OutputError: an output path with an unusable suffix (checked before any work).
    """
    from data_prep.alignment import align_scene
    from data_prep.footprints import load_footprints
    from data_prep.mosaic import open_scene
    from data_prep.scene import NOT_COVERED as CUT_NOT_COVERED
    from data_prep.scene import SKIPPED as CUT_SKIPPED
    from data_prep.scene import check_overlap, iter_building_chips, pixel_centroids

    start = time.perf_counter()
    fmt = check_outputs(out, raster, overlay)
    if buildings is None:
        from app.scoring import detect

        localizer = detect.require_localizer(localizer, "--buildings")
        with detect.temporary_folder() as tmp:
            found = detect.detect_scene_footprints(
                localizer,
                pre,
                post,
                tmp / "detected.gpkg",
                block_size=block_size,
                max_pixels=max_pixels,
                progress=progress,
            )
            report = score_scene(
                predictor,
                pre,
                post,
                tmp / "detected.gpkg",
                out,
                raster=raster,
                overlay=overlay,
                batch_size=batch_size,
                block_size=block_size,
                progress=progress,
                align=align,
                name=name or detect.scene_name(pre[0]),
                max_pixels=max_pixels,
                source=detect.DETECTED,
            )
        report.detected, report.seconds = found, time.perf_counter() - start
        return report
    name = name or Path(buildings).stem
    class_names = tuple(predictor.class_names)
    report = ScoreReport(scene=name, class_names=class_names)
    with bounded_gdal_cache(), open_scene(pre, post, max_pixels) as scene:
        footprints = load_footprints(buildings, scene.grid.crs)
        check_overlap(footprints, scene)
        shift = align_scene(scene, pixel_centroids(scene.grid, footprints), align)
        report.alignment, report.alignment_text = shift.to_dict(), shift.summary()
        table = _read_features(buildings)
        n = len(table.geometries)
        report.buildings = n
        scores = _Scores(n, len(class_names))
        scores.source = source
        # features load_footprints left out keep their reason
        reasons = {s.item: s.reason for s in footprints.skipped}
        kept = np.zeros(n, dtype=bool)
        kept[footprints.rows] = True
        for row in np.flatnonzero(~kept):
            item = f"{footprints.path} feature {table.uids[row]}"
            reason = reasons.get(item, "not a usable building polygon")
            scores.status[row] = f"{SKIPPED}: {reason}"
            report.skipped.append(Skipped(item, reason))

        batcher = _Batcher(predictor, scores, batch_size)
        for b in iter_building_chips(
            scene,
            footprints,
            predictor.spec,
            block_size=block_size,
            progress=progress,
            context=True,
        ):
            row = int(footprints.rows[b.index])
            if b.status == CUT_NOT_COVERED:
                scores.status[row] = NOT_COVERED
            elif b.status == CUT_SKIPPED:
                scores.skip(row, b.reason)
                report.skipped.append(Skipped(f"{footprints.path} feature {b.uid}", b.reason))
            else:
                batcher.add(row, b.pre, b.post, b.context_px)
        batcher.flush()
        report.skipped.extend(scene.all_skipped())
        _report_counts(report, scores)

        with _all_or_nothing(report):
            _scene_outputs(
                predictor,
                scene,
                footprints,
                table,
                scores,
                report,
                fmt,
                out,
                raster,
                overlay,
                block_size,
            )
    report.seconds = time.perf_counter() - start
    return report


def _scene_outputs(
    predictor, scene, footprints, table, scores, report, fmt, out, raster, overlay, block_size
) -> None:
    """Write the raster, the overlay and then the vector file of a scored scene."""
    n, class_names, name = len(table.geometries), report.class_names, report.scene
    grid = scene.grid
    pixel = np.empty(n, dtype=object)
    pixel[footprints.rows] = grid.to_pixels(footprints.geometries)
    if raster is not None:
        from app.scoring.outputs import write_class_raster

        write_class_raster(
            raster,
            pixel,
            scores.class_id,
            grid.width,
            grid.height,
            crs=grid.crs,
            transform=grid.transform,
            class_names=class_names,
            block_size=max(block_size, 256),
        )
        report.outputs["raster"] = str(raster)
    if overlay is not None:
        from app.scoring.outputs import mosaic_preview, write_overlay

        w, h = overlay_size(grid.width, grid.height)
        image = mosaic_preview(scene.post, grid, w, h)
        write_overlay(
            overlay,
            image,
            pixel,
            scores.class_id,
            (w / grid.width, h / grid.height),
            class_names,
            flagged=scores.flags != "",
        )
        report.outputs["overlay"] = str(overlay)

    if fmt == "geojson":
        geometries, crs = _to_crs(table.geometries, table.crs, "OGC:CRS84"), "OGC:CRS84"
    else:
        geometries, crs = _to_crs(table.geometries, table.crs, grid.crs), grid.crs
    _write_features(
        out, geometries, crs, table.attributes, table.masks, scores, report, name, predictor
    )


def _write_features(out, geometries, crs, attributes, attr_masks, scores, report, name, predictor):
    from app.scoring.outputs import write_vector

    score_cols, score_masks = scores.columns(report.class_names)
    attrs, renamed = _merge_attributes(attributes, score_cols)
    masks = {renamed.get(k, k): v for k, v in attr_masks.items()}
    masks.update(score_masks)
    write_vector(
        out,
        geometries,
        crs,
        {**attrs, **score_cols},
        masks,
        layer=name,
        metadata=_model_metadata(predictor, report),
        collection_members=(
            {ALIGNMENT_KEY: report.alignment} if report.alignment is not None else None
        ),
    )
    report.outputs["vector"] = str(out)
