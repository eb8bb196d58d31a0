"""One writer of a scored scene's outputs, for scene mode, xBD mode and so every entry point.

:func:`app.scoring.scene.score_scene` and :func:`app.scoring.xbd.score_xbd` (and through them
the footprint-free variants of :mod:`app.scoring.detect`, batches and the web app) grade their
buildings with :class:`app.scoring.grade.Grading`, describe where they lie in a
:class:`SceneLayout` and hand it, with the requested :class:`OutputPaths`, to
:func:`write_outputs`. It writes the class raster, the overlay and the
web map, then the vector file last, so the vector's presence means the scene is finished; when
any of them fails, those already written are removed (:func:`app.scoring.common.all_or_nothing`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from app.scoring import outputs, webmap
from app.scoring.common import ScoreReport, Scores, all_or_nothing, check_outputs, write_features

if TYPE_CHECKING:
    from runtime.predictor import Predictor

PathLike = str | os.PathLike


@dataclass(frozen=True)
class OutputPaths:
    """Where a scored scene's outputs go.

    Attributes:
        vector: ``.geojson`` or ``.gpkg`` per-building output (always written).
        raster: optional ``.tif`` class raster (Cloud-Optimised GeoTIFF).
        overlay: optional ``.png`` overlay of the post image.
        web_map: optional ``.html`` web map (:mod:`app.scoring.webmap`).
    """

    vector: PathLike
    raster: PathLike | None = None
    overlay: PathLike | None = None
    web_map: PathLike | None = None

    @classmethod
    def of(cls, paths: OutputPaths | PathLike) -> OutputPaths:
        """``paths`` itself, or a bare vector path as the outputs of only that file."""
        return paths if isinstance(paths, OutputPaths) else cls(paths)

    def check(self) -> str:
        """Validate every path before any work; returns the vector format.

        Raises:
            OutputError: a path with a suffix its output cannot have.
        """
        fmt = check_outputs(self.vector, self.raster, self.overlay)
        if self.web_map is not None:
            webmap.check_map_path(self.web_map)
        return fmt


@dataclass(frozen=True)
class SceneLayout:
    """Where a scene's buildings lie and how its pictures are drawn, for :func:`write_outputs`.

    Attributes:
        pixel: [N] footprints in pixels of the grid (None where a feature has none).
        width, height: the grid's size in pixels.
        crs, transform: the grid's georeferencing (None: plain pixel grid).
        attributes, masks: the input attributes of every feature and where each is null.
        preview: ``preview(w, h)``: the post image as uint8 [h, w, 3], the overlay's background.
        draw_map: ``draw_map(path, columns, masks)``: writes the web map with these score columns.
        placed: ``placed(fmt)``: ``(geometries, crs)`` of the vector output in format ``fmt``.
        raster_block: side in pixels of the blocks the class raster is rasterised in.
    """

    pixel: np.ndarray
    width: int
    height: int
    crs: Any
    transform: Any
    attributes: Mapping[str, np.ndarray]
    masks: Mapping[str, np.ndarray]
    preview: Callable[[int, int], np.ndarray]
    draw_map: Callable[[PathLike, dict, dict], None]
    placed: Callable[[str], tuple[np.ndarray, Any]]
    raster_block: int = 1024


def write_outputs(
    paths: OutputPaths,
    layout: SceneLayout,
    scores: Scores,
    report: ScoreReport,
    predictor: Predictor,
) -> None:
    """Write every requested output of a scored scene, all or nothing, and record each written
    path in ``report.outputs``: the raster, the overlay, the map and then the vector file."""
    fmt = outputs.vector_format(paths.vector)
    with all_or_nothing(report):
        if paths.raster is not None:
            _write_raster(paths.raster, layout, scores, report)
        if paths.overlay is not None:
            _write_overlay(paths.overlay, layout, scores, report)
        if paths.web_map is not None:
            columns, masks = scores.columns(report.class_names)
            layout.draw_map(paths.web_map, columns, masks)
            report.outputs["map"] = str(paths.web_map)
        geometries, crs = layout.placed(fmt)
        write_features(
            paths.vector,
            geometries,
            crs,
            layout.attributes,
            layout.masks,
            scores,
            report,
            predictor,
        )


def _write_raster(path: PathLike, layout: SceneLayout, scores: Scores, report: ScoreReport):
    """The class raster of the scored buildings on the layout's grid."""
    outputs.write_class_raster(
        path,
        layout.pixel,
        scores.class_id,
        outputs.RasterGrid(layout.width, layout.height, layout.crs, layout.transform),
        class_names=report.class_names,
        block_size=layout.raster_block,
    )
    report.outputs["raster"] = str(path)


def _write_overlay(path: PathLike, layout: SceneLayout, scores: Scores, report: ScoreReport):
    """The overlay: footprints in class colours over the downsampled post image."""
    w, h = outputs.overlay_size(layout.width, layout.height)
    outputs.write_overlay(
        path,
        layout.preview(w, h),
        layout.pixel,
        scores.class_id,
        (w / layout.width, h / layout.height),
        report.class_names,
        flagged=scores.flags != "",
    )
    report.outputs["overlay"] = str(path)
