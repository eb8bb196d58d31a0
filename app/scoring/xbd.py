"""Scoring in xBD mode: one xBD pre/post image pair and its label JSON, without torch.

:func:`score_xbd` grades every ``features.xy`` polygon of an xBD label file on a pixel-aligned
pre/post pair (PNG or TIFF), with the shared scoring machinery of :mod:`app.scoring.common`
(chips cut by ``data_prep``, the ONNX model through :class:`runtime.predictor.Predictor`, the
same output columns and files as scene mode). Without a label file, the localiser's buildings
are graded instead (:func:`app.scoring.detect.score_xbd_detected`).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from app.scoring import webmap
from app.scoring.common import (
    NOT_COVERED,
    SKIPPED,
    ScoreOptions,
    ScoreReport,
    bounded_gdal_cache,
    image_georef,
    to_crs,
)
from app.scoring.grade import Building, Grading, Origin, new_report
from app.scoring.writer import OutputPaths, SceneLayout, write_outputs
from data_prep.alignment import align_images
from data_prep.errors import not_found
from data_prep.grid import Grid
from data_prep.imagery import ImageError, split_file_message
from data_prep.mosaic import SceneError
from data_prep.quality import blank_reason
from data_prep.report import PrepareReport
from data_prep.residual import image_context_residual
from data_prep.windows import cut_building
from data_prep.xbd_tiles import parse_buildings, read_tile_pair

if TYPE_CHECKING:
    from runtime.predictor import Predictor


def _xbd_features(labels: Path) -> tuple[list[dict], dict[str, str]]:
    """The building features of an xBD label file and the lng_lat WKT by uid."""
    with open(labels, "rb") as fh:
        data = json.loads(fh.read())
    features = data["features"]
    lonlat = {}
    for f in features.get("lng_lat") or []:
        props = (f.get("properties") or {}) if isinstance(f, dict) else {}
        if "uid" in props and isinstance(f.get("wkt"), str):
            lonlat.setdefault(str(props["uid"]), f["wkt"])
    out = []
    for i, feature in enumerate(features["xy"]):
        props = (feature.get("properties") if isinstance(feature, dict) else None) or {}
        if props.get("feature_type", "building") != "building":
            continue
        wkt = feature.get("wkt") if isinstance(feature, dict) else None
        out.append(
            {
                "uid": str(props.get("uid") or f"#{i}"),
                "properties": props,
                "wkt": wkt if isinstance(wkt, str) else None,
            }
        )
    return out, lonlat


def score_xbd(
    predictor: Predictor,
    pre: str | os.PathLike,
    post: str | os.PathLike,
    labels: str | os.PathLike,
    paths: OutputPaths | str | os.PathLike,
    *,
    name: str | None = None,
    options: ScoreOptions | None = None,
    origin: Origin | None = None,
) -> ScoreReport:
    """Grade every building of an xBD label file on its pixel-aligned pre/post image pair.

    The post image's shift against the pre image is measured and, when confident and longer
    than a pixel, corrected before chips are cut (:func:`data_prep.alignment.align_images`).
    After grading, the order of pre and post is checked as in scene mode
    (:func:`app.scoring.order.check_order`).

    Buildings come from the label's ``features.xy`` pixel polygons (parsed by
    :func:`data_prep.xbd_tiles.parse_buildings`; damage subtypes, if any, are ignored and carried over
    as attributes). Chips are cut as ``prepare xbd`` cuts them
    (:func:`data_prep.windows.cut_building`: :func:`~data_prep.windows.chip_window`, boundless
    crop, :func:`~data_prep.windows.resize_chip`).

    Geometries: GeoJSON gets each building's ``features.lng_lat`` polygon (or, when missing and
    the pre image is georeferenced, the pixel polygon through the image's transform; otherwise a
    null geometry). A GeoPackage gets pixel polygons, in the image's CRS when it is georeferenced
    and as plain pixel coordinates (x = column, y = row, no CRS) otherwise; so does the raster.

    Args:
        predictor: the loaded ONNX model.
        pre, post: the pre- and post-disaster images (same size).
        labels: xBD label JSON (post or pre; only the polygons are used); without one,
            :func:`app.scoring.detect.score_xbd_detected` finds the buildings.
        paths: the outputs (:class:`~app.scoring.writer.OutputPaths`; a bare path: only the
            vector file): ``.geojson`` or ``.gpkg``, an optional ``.tif`` class raster on the
            image's pixel grid, ``.png`` overlay and ``.html`` web map
            (:mod:`app.scoring.webmap`: on Web Mercator when the pre image is georeferenced,
            else in image pixels).
        name: scene name (default: the label file's stem without ``_post_disaster``).
        options: batch size, pixel limit per image (checked before decoding), alignment and
            progress bar (default :class:`~app.scoring.common.ScoreOptions`; the block size is
            a scene-mode option).
        origin: the buildings' ``source`` and how the report names them (default: given,
            ``<labels> building``); detection names the pre image, not its temporary label file.

    Returns:
        The report.

    Raises:
        SceneError: an unreadable, truncated, blank or too large image, an unreadable label
            file, images of different sizes, or a GeoJSON output for a label file without
            ``lng_lat`` polygons and without georeferenced images. A label file without a
            building is no error: its outputs are written empty and the report says so.
        OutputError: an output path with an unusable suffix.
    """
    start = time.perf_counter()
    options = options or ScoreOptions()
    origin = origin or Origin()
    paths = OutputPaths.of(paths)
    paths.check()
    labels = Path(labels)
    report = new_report(
        name or re.sub(r"_(pre|post)_disaster$", "", labels.stem), predictor, options
    )
    if not labels.is_file():
        raise SceneError(labels, not_found(labels, "label file not found"))
    parsed = PrepareReport()
    try:
        _, buildings = parse_buildings(labels, parsed, ignore_labels=True)
    except (OSError, ValueError) as exc:
        raise SceneError(labels, str(exc)) from exc
    features, lonlat_wkt = _xbd_features(labels)
    if not features:  # real xBD tiles without a building: an empty result, said plainly
        report.notes.append(f"no buildings in the label file {labels}: nothing to grade")
    try:
        pre_img, post_img = read_tile_pair(pre, post, options.max_pixels)
    except ImageError as exc:
        item, text = split_file_message(str(exc), (pre, post))
        raise SceneError(item or pre, text) from exc
    if pre_img.shape != post_img.shape:
        raise SceneError(
            post,
            f"is {post_img.shape[1]}x{post_img.shape[0]} px but the pre image {pre} is "
            f"{pre_img.shape[1]}x{pre_img.shape[0]} px; xBD mode needs pixel-aligned pairs "
            "(use --buildings with georeferenced GeoTIFFs to have post warped onto pre)",
        )
    crs, transform = image_georef(pre)

    post_img, shift = align_images(
        pre_img,
        post_img,
        options.align,
        res=abs(transform.a) if crs is not None else 1.0,
        units=(crs.linear_units or "units") if crs is not None else "pixel",
    )
    report.alignment, report.alignment_text = shift.to_dict(), shift.summary()

    named = origin.item or f"{labels} building"
    reasons = {s.item.replace(f"{labels} building", named, 1): s.reason for s in parsed.skipped}
    grading = Grading(predictor, report, len(features), options, origin.source)
    images = (pre_img, post_img)
    grading.run(
        _buildings(
            features,
            {b.uid: b for b in buildings},
            reasons,
            named,
            images,
            predictor.spec,
            progress=options.progress,
        )
    )
    scores = grading.finish(lambda: _pixel_areas(features), [pre], [post])

    with bounded_gdal_cache():
        layout = _layout(features, lonlat_wkt, scores, report, images, (crs, transform), labels)
        write_outputs(paths, layout, scores, report, predictor)
    report.seconds = time.perf_counter() - start
    return report


def _buildings(
    features: list[dict],
    by_uid: dict,
    reasons: dict[str, str],
    named: str,
    images: tuple[np.ndarray, np.ndarray],
    spec,
    progress: bool,
) -> Iterator[Building]:
    """Every feature of the label file as the grade step takes it: its chips cut from the
    pair (:func:`data_prep.windows.cut_building`), or why not."""
    pre_img, post_img = images
    used: set[str] = set()
    for row, feat in enumerate(
        tqdm(features, desc="buildings", unit="bldg", disable=None if progress else True)
    ):
        uid = feat["uid"]
        item = f"{named} {uid}"
        b = by_uid.get(uid)
        if b is None or uid in used:
            reason = (
                "uid repeated within the label file; only the first is scored"
                if uid in used
                else reasons.get(item, "no usable polygon")
            )
            yield Building(row, item, SKIPPED, reason)
            continue
        used.add(uid)
        chips = cut_building(pre_img, post_img, b, spec)
        if chips is None:
            yield Building(row, item, NOT_COVERED)
            continue
        window, pre_chip, post_chip = chips
        blank = blank_reason(pre_chip, post_chip)
        if blank:
            yield Building(row, item, SKIPPED, blank)
            continue
        shift = image_context_residual(pre_img, post_img, b.centroid, window.size)
        yield Building(row, item, pre=pre_chip, post=post_chip, context_px=shift)


def _layout(features, lonlat_wkt, scores, report, images, georef, labels) -> SceneLayout:
    """Where the label file's buildings lie on the image's pixel grid, for :func:`write_outputs`
    (buildings left out have no pixel footprint)."""
    (pre_img, post_img), (crs, transform) = images, georef
    height, width = pre_img.shape[:2]
    pixel = np.empty(len(features), dtype=object)
    pixel[:] = [
        None if f["wkt"] is None or scores.status[i].startswith(SKIPPED) else _safe_wkt(f["wkt"])
        for i, f in enumerate(features)
    ]
    grid = None if crs is None else Grid(crs=crs, transform=transform, width=width, height=height)
    uids = [f["uid"] for f in features]
    attributes, masks = _xbd_attributes(features)
    return SceneLayout(
        pixel=pixel,
        width=width,
        height=height,
        crs=crs,
        transform=transform,
        attributes=attributes,
        masks=masks,
        preview=lambda w, h: _resized(post_img, w, h),
        draw_map=lambda path, columns, masks: webmap.image_map(
            path,
            images,
            crs,
            transform,
            webmap.MapBuildings(pixel, columns, masks, uids, report.class_names, report.scene),
        ),
        placed=lambda fmt: _placed(fmt, features, lonlat_wkt, pixel, grid, labels),
    )


def _resized(image: np.ndarray, w: int, h: int) -> np.ndarray:
    """``image`` at ``w`` x ``h`` pixels (area averaging), itself when already that size."""
    import cv2

    if image.shape[1] == w and image.shape[0] == h:
        return image
    return cv2.resize(image, (w, h), interpolation=cv2.INTER_AREA)


def _placed(fmt: str, features, lonlat_wkt, pixel: np.ndarray, grid: Grid | None, labels):
    """The vector output's geometries and CRS: ``lng_lat`` polygons (or georeferenced pixel
    ones) in CRS84 for GeoJSON; pixel polygons in the image's CRS, or without one, otherwise.

    Raises:
        SceneError: GeoJSON for buildings that cannot be placed in longitude/latitude.
    """
    n = len(features)
    present = np.array([p is not None for p in pixel], dtype=bool)
    if fmt != "geojson":
        if grid is None:
            return pixel, None
        geometries = np.empty(n, dtype=object)
        geometries[present] = grid.from_pixels(pixel[present])
        return geometries, grid.crs
    geometries = np.empty(n, dtype=object)
    geometries[:] = [_safe_wkt(lonlat_wkt.get(f["uid"])) for f in features]
    missing = np.array([g is None for g in geometries], dtype=bool) & present
    if missing.any() and grid is not None:
        geometries[missing] = to_crs(grid.from_pixels(pixel[missing]), grid.crs, "OGC:CRS84")
    if all(g is None for g in geometries) and n:
        raise SceneError(
            labels,
            "has no features.lng_lat polygons and the images are not georeferenced, so "
            "buildings cannot be placed in longitude/latitude for GeoJSON; write a .gpkg "
            "instead (pixel coordinates)",
        )
    return geometries, "OGC:CRS84"


def _safe_wkt(wkt: str | None):
    import shapely
    from shapely.errors import ShapelyError

    if not wkt:
        return None
    try:
        geom = shapely.from_wkt(wkt)
    except ShapelyError:
        return None
    return None if geom is None or geom.is_empty else geom


def _xbd_attributes(features: list[dict]) -> tuple[dict, dict]:
    """Text attributes from the features' properties (every key seen, null where absent)."""
    keys: list[str] = []
    for f in features:
        for k in f["properties"]:
            if k not in keys:
                keys.append(str(k))
    attrs, masks = {}, {}
    for k in keys:
        values = [f["properties"].get(k) for f in features]
        attrs[k] = np.array(
            [None if v is None else (v if isinstance(v, str) else json.dumps(v)) for v in values],
            dtype=object,
        )
        masks[k] = np.array([v is None for v in values], dtype=bool)
    return attrs, masks


def _pixel_areas(features: list[dict]) -> np.ndarray:
    """float [n]: the pixels each feature's ``wkt`` polygon covers (NaN without a usable one)."""
    geoms = [_safe_wkt(f["wkt"]) for f in features]
    return np.array([np.nan if g is None else g.area for g in geoms], dtype=np.float64)
