"""Scoring: a damage grade and class probabilities for every building of a scene, without torch.

Chips are cut by the same ``data_prep`` code that made the training chips, with the chip spec
stored in the model, and graded by an ONNX model through :class:`runtime.predictor.Predictor`:

- :func:`score_scene`: georeferenced pre/post GeoTIFF tiles (any CRS and resolution, mosaicked
  virtually on the pre grid, post warped onto it) and a footprint file (GeoJSON, GeoPackage or
  Shapefile, any CRS). Buildings are read one block of the grid at a time
  (:func:`data_prep.scene.iter_building_chips`), so memory does not grow with the scene's size.
- :func:`app.scoring.xbd.score_xbd`: one xBD pre/post image pair (PNG or TIFF, pixel aligned) and
  an xBD label JSON whose ``features.xy`` polygons are the buildings (its own module).

Both are sources of one pipeline: each yields its buildings and their chips to the one grade
step (:class:`app.scoring.grade.Grading`) and hands the scores to the one writer
(:func:`app.scoring.writer.write_outputs`).

Without footprints: :mod:`app.scoring.detect`. Many scenes at once: :mod:`app.scoring.batch`.

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

import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from app.scoring import outputs, webmap
from app.scoring.common import (
    NOT_COVERED,
    SKIPPED,
    ScoreOptions,
    ScoreReport,
    bounded_gdal_cache,
    to_crs,
)
from app.scoring.grade import Building, Grading, Origin, new_report
from app.scoring.writer import OutputPaths, SceneLayout, write_outputs
from data_prep.alignment import align_scene
from data_prep.footprints import load_footprints, read_footprint_file
from data_prep.mosaic import open_scene
from data_prep.scene import NOT_COVERED as CUT_NOT_COVERED
from data_prep.scene import SKIPPED as CUT_SKIPPED
from data_prep.scene import (
    check_overlap,
    iter_building_chips,
    pixel_centroids,
    plan_reads,
    single_read,
)
from data_prep.timing import StageTimes

if TYPE_CHECKING:
    from runtime.predictor import Predictor


@dataclass
class _FeatureTable:
    """All features of a footprint file: source geometries, attributes, ids and CRS."""

    geometries: np.ndarray  # [N] shapely or None, in the file's CRS
    attributes: dict[str, np.ndarray]
    masks: dict[str, np.ndarray]
    uids: list[str]
    crs: str


def _read_features(raw: tuple) -> _FeatureTable:
    """Every feature of a footprint file from its read (:func:`read_footprint_file`, the read
    load_footprints takes its buildings from)."""
    import shapely

    meta, fids, wkb, values = raw
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


def score_scene(
    predictor: Predictor,
    pre: Sequence[str | os.PathLike],
    post: Sequence[str | os.PathLike],
    buildings: str | os.PathLike,
    paths: OutputPaths | str | os.PathLike,
    *,
    name: str | None = None,
    options: ScoreOptions | None = None,
    origin: Origin | None = None,
) -> ScoreReport:
    """Grade every building of a georeferenced scene and write the outputs.

    Before any chip is cut, the post-to-pre shift of the scene is measured and, when it is
    confident and longer than a pixel, corrected (:func:`data_prep.alignment.align_scene`); the
    report and the output metadata (GeoPackage layer metadata / GeoJSON collection member
    ``local_damage_alignment``) record it. After grading, the order of pre and post is checked
    (:func:`app.scoring.order.check_order`); when they look exchanged the report warns and the
    output metadata (``local_damage_order``) records it, and the grades stay as given.

    Args:
        predictor: the loaded ONNX model (its chip spec decides how chips are cut).
        pre: pre-disaster GeoTIFF tiles (any CRS and resolution; earlier wins on overlaps).
        post: post-disaster GeoTIFF tiles.
        buildings: footprint file (GeoJSON, GeoPackage or Shapefile, any CRS); without one,
            :func:`app.scoring.detect.score_scene_detected` finds the buildings.
        paths: the outputs (:class:`~app.scoring.writer.OutputPaths`; a bare path: only the
            vector file): ``.geojson`` (RFC 7946, EPSG:4326) or ``.gpkg`` (pre-grid CRS)
            per-building output; optional ``.tif`` Cloud-Optimised GeoTIFF of class ids on the
            pre grid, ``.png`` post image with footprints in class colours and a legend, and
            ``.html`` web map of the scene (:mod:`app.scoring.webmap`).
        name: scene name (default: the footprint file's stem); the GeoPackage layer name.
        options: batch size, block size (memory grows with its square, not with the scene),
            pixel limit per internal block and read window, alignment and progress bar
            (default :class:`~app.scoring.common.ScoreOptions`).
        origin: the buildings' ``source`` (``given``, or ``detected`` for a footprint file the
            localiser wrote) and how the report names them (default ``<buildings> feature``);
            detection names the imagery, not its temporary file.

    Returns:
        The report (per-class counts, not covered, skipped, outputs, time, alignment).

    Raises:
        SceneError: no usable pre or post tile, pre and post without overlap, an unreadable or
            empty footprint file, or footprints outside the imagery (nothing is written).
        OutputError: an output path with an unusable suffix (checked before any work).
    """
    start = time.perf_counter()
    options = options or ScoreOptions()
    origin = origin or Origin()
    paths = OutputPaths.of(paths)
    paths.check()
    report = new_report(name or Path(buildings).stem, predictor, options)
    timer = StageTimes()
    with bounded_gdal_cache(), open_scene(pre, post, options.max_pixels) as scene:
        raw = read_footprint_file(buildings)
        footprints = load_footprints(buildings, scene.grid.crs, raw=raw)
        check_overlap(footprints, scene)
        timer.add("open", time.perf_counter() - start)
        with timer.stage("plan"):
            plan = plan_reads(scene, footprints, predictor.spec, options.block_size)
        window = single_read(scene, plan)
        if window is not None:
            # a scene read at once: read here, kept for the alignment blocks and the chips
            with timer.stage("read"):
                scene.read_pair(*window, keep=True)
        with timer.stage("align"):
            shift = align_scene(
                scene, pixel_centroids(scene.grid, footprints), options.align, read=window
            )
        report.alignment, report.alignment_text = shift.to_dict(), shift.summary()
        with timer.stage("open"):
            table = _read_features(raw)
        n = len(table.geometries)
        grading = Grading(predictor, report, n, options, origin.source, timer)
        chips = iter_building_chips(
            scene,
            footprints,
            predictor.spec,
            block_size=options.block_size,
            progress=options.progress,
            context=True,
            timer=timer,
            plan=None if shift.applied else plan,  # a shift moves the post coverage
        )
        named = origin.item or f"{footprints.path} feature"
        grading.run(_buildings(table, footprints, named, chips))
        report.skipped.extend(scene.all_skipped())
        scores = grading.finish(
            lambda: _pixel_areas(footprints, scene.grid, n), pre, post, scene.open_files()
        )

        with timer.stage("outputs"):
            layout = _layout(scene, footprints, table, report, options.block_size)
            write_outputs(paths, layout, scores, report, predictor)
    report.seconds = time.perf_counter() - start
    if options.profile:
        report.stages = timer.as_dict()
    return report


def _buildings(table: _FeatureTable, footprints, named: str, chips: Iterable) -> Iterator[Building]:
    """Every feature of the footprint file as the grade step takes it: first those
    load_footprints left out (with their reason), then each building's chips from ``chips``
    (:func:`data_prep.scene.iter_building_chips`), or why they were not cut."""
    reasons = {s.item: s.reason for s in footprints.skipped}
    kept = np.zeros(len(table.geometries), dtype=bool)
    kept[footprints.rows] = True
    for row in np.flatnonzero(~kept):
        uid = table.uids[row]
        reason = reasons.get(f"{footprints.path} feature {uid}", "not a usable building polygon")
        yield Building(int(row), f"{named} {uid}", SKIPPED, reason)
    for b in chips:
        row, item = int(footprints.rows[b.index]), f"{named} {b.uid}"
        if b.status == CUT_NOT_COVERED:
            yield Building(row, item, NOT_COVERED)
        elif b.status == CUT_SKIPPED:
            yield Building(row, item, SKIPPED, b.reason)
        else:
            yield Building(row, item, pre=b.pre, post=b.post, context_px=b.context_px)


def _pixel_areas(footprints, grid, n: int) -> np.ndarray:
    """float [n]: the grid pixels each footprint covers (NaN for features left out)."""
    import shapely

    areas = np.full(n, np.nan)
    areas[footprints.rows] = shapely.area(footprints.geometries) / abs(grid.transform.determinant)
    return areas


def _layout(scene, footprints, table: _FeatureTable, report: ScoreReport, block_size: int):
    """Where the scene's features lie on the pre grid, for :func:`write_outputs`."""
    grid = scene.grid
    pixel = np.empty(len(table.geometries), dtype=object)
    pixel[footprints.rows] = grid.to_pixels(footprints.geometries)
    return SceneLayout(
        pixel=pixel,
        width=grid.width,
        height=grid.height,
        crs=grid.crs,
        transform=grid.transform,
        attributes=table.attributes,
        masks=table.masks,
        preview=lambda w, h: outputs.mosaic_preview(scene.post, grid, w, h),
        draw_map=lambda path, columns, masks: webmap.scene_map(
            path,
            scene,
            webmap.MapBuildings(
                to_crs(table.geometries, table.crs, "OGC:CRS84"),
                columns,
                masks,
                table.uids,
                report.class_names,
                report.scene,
            ),
        ),
        placed=lambda fmt: _placed(table, grid.crs, fmt),
        raster_block=max(block_size, 256),
    )


def _placed(table: _FeatureTable, grid_crs, fmt: str) -> tuple[np.ndarray, object]:
    """The vector output's geometries and CRS: CRS84 for GeoJSON, the pre grid's otherwise."""
    crs = "OGC:CRS84" if fmt == "geojson" else grid_crs
    return to_crs(table.geometries, table.crs, crs), crs
