"""Scoring without footprints: the localiser's buildings become the footprints that are graded.

Given no footprint file, :func:`score_scene_detected` and :func:`score_xbd_detected` find the
buildings with a localiser (:mod:`runtime.localizer`), then grade them with
:func:`app.scoring.scene.score_scene` and :func:`app.scoring.xbd.score_xbd` exactly as supplied
footprints are graded; every output feature says where its building came from in a ``source``
column, ``given`` (supplied footprints) or ``detected`` (found by the localiser). A detected
building larger than any building the localiser learnt from (its ``largest_building_px``) is
flagged ``oversized``: a cloud, bare ground or merged roofs are likelier than one building.

- Scene mode: :func:`detect_scene_footprints` reads the pre mosaic one block at a time
  (:func:`runtime.localizer.detect_scene`) and writes the buildings, in the pre grid's CRS, to a
  GeoPackage with a ``uid`` per building (``detected-0``, ``detected-1``, ...).
- xBD mode: :func:`detect_xbd_labels` runs the localiser on the pre image and writes the buildings
  as an xBD label file (``features.xy`` pixel polygons), so they are cut and graded as label
  polygons are.

The web app keeps these files in the assessment's folder (:func:`detect_tile`), so showing a
building's chips, corrections and Adapt work on detected buildings as on uploaded ones.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from app.scoring.common import (
    DETECTED,
    ScoreOptions,
    ScoreReport,
    bounded_gdal_cache,
    image_georef,
)
from app.scoring.grade import Origin
from app.scoring.scene import score_scene
from app.scoring.writer import OutputPaths
from app.scoring.xbd import score_xbd
from data_prep.imagery import ImageError, split_file_message
from data_prep.mosaic import SceneError, open_scene
from data_prep.store import atomic_path
from data_prep.xbd_tiles import read_tile_pair
from runtime.contract import ModelError
from runtime.localizer import detect_scene, load_localizer

#: ``uid`` prefix of detected buildings.
UID_PREFIX = "detected-"


def require_localizer(localizer, what: str):
    """``localizer``, or the default one (:func:`runtime.localizer.load_localizer`) when None.

    Raises:
        SceneError: naming ``what`` (the missing footprints), when no localiser is available or
            the file is not a valid localiser.
    """
    if localizer is not None:
        return localizer
    try:
        return load_localizer()
    except ModelError as exc:
        raise SceneError(what, f"no footprints given: {exc}") from exc


def write_footprints_gpkg(polygons: Iterable, path: str | os.PathLike, crs) -> int:
    """Write polygons (in ``crs``) as a GeoPackage of buildings with a ``uid`` each; returns
    how many were written."""
    import shapely
    from pyogrio.raw import write

    wkb = [shapely.to_wkb(p) for p in polygons]
    path = Path(path)
    if path.exists():
        path.unlink()
    if not wkb:
        return 0
    uids = np.array([f"{UID_PREFIX}{i}" for i in range(len(wkb))], dtype=object)
    write(
        str(path),
        np.array(wkb, dtype=object),
        field_data=[uids],
        fields=["uid"],
        crs=crs.to_wkt() if hasattr(crs, "to_wkt") else str(crs),
        driver="GPKG",
        geometry_type="Polygon",
        layer="buildings",
    )
    return len(wkb)


def write_xbd_labels(polygons: Sequence, path: str | os.PathLike, image_name: str = "") -> int:
    """Write pixel polygons as an xBD label file (``features.xy``, ``uid`` and
    ``feature_type`` per building, ``metadata.source`` ``detected``); returns the count."""
    features = [
        {"properties": {"feature_type": "building", "uid": f"{UID_PREFIX}{i}"}, "wkt": p.wkt}
        for i, p in enumerate(polygons)
    ]
    data = {
        "features": {"lng_lat": [], "xy": features},
        "metadata": {"img_name": image_name, "source": DETECTED},
    }
    with atomic_path(Path(path), suffix=".json") as tmp:
        Path(tmp).write_text(json.dumps(data))
    return len(features)


def _none_found(localizer, item: str) -> SceneError:
    return SceneError(
        item,
        f"the building localiser {localizer.path.name} found no building in the pre imagery "
        f"(threshold {localizer.threshold:g}, smallest blob {localizer.min_area_px} px); "
        "nothing to grade. Give footprints if you have them",
    )


def detect_scene_footprints(
    localizer,
    pre: Sequence[str | os.PathLike],
    post: Sequence[str | os.PathLike],
    path: str | os.PathLike,
    *,
    block_size: int = 1024,
    max_pixels: int | None = None,
    progress: bool = True,
) -> int:
    """Detect the buildings of a georeferenced scene and write them to a GeoPackage.

    The scene is opened as scoring opens it (pre grid, post warped onto it), and the pre mosaic
    is read one ``block_size`` square at a time where pre and post overlap.

    Returns:
        The number of buildings written (in the pre grid's CRS).

    Raises:
        SceneError: unusable imagery, or no building found.
    """
    with bounded_gdal_cache(), open_scene(pre, post, max_pixels) as scene:
        polygons = detect_scene(localizer, scene, block_size=block_size, progress=progress)
        n = write_footprints_gpkg(polygons, path, scene.grid.crs)
    if not n:
        raise _none_found(localizer, ", ".join(str(p) for p in pre))
    return n


def detect_xbd_labels(
    localizer,
    pre: str | os.PathLike,
    post: str | os.PathLike,
    path: str | os.PathLike,
    max_pixels: int | None = None,
) -> int:
    """Detect the buildings of a pixel-aligned pre/post pair's pre image (pixel coordinates) and
    write them as an xBD label file; returns the count. The images are read as scoring reads
    them (one radiometric rule for both).

    Raises:
        SceneError: an unreadable, blank or too large image, or no building found.
    """
    try:
        image, _ = read_tile_pair(pre, post, max_pixels)
    except ImageError as exc:
        item, text = split_file_message(str(exc), (pre, post))
        raise SceneError(item or pre, text) from exc
    n = write_xbd_labels(localizer.detect(image), path, Path(pre).name)
    if not n:
        raise _none_found(localizer, str(pre))
    return n


def with_largest_building(options: ScoreOptions, localizer) -> ScoreOptions:
    """``options`` with the localiser's ``largest_building_px``, so that scoring flags the
    detections larger than any building it learnt from ``oversized`` (unchanged when the
    options already set one or the localiser file does not say)."""
    largest = getattr(localizer, "largest_building_px", None)
    if options.largest_building_px is not None or largest is None:
        return options
    return dataclasses.replace(options, largest_building_px=int(largest))


def scene_name(pre: str | os.PathLike) -> str:
    """A scene name from a pre image: its stem without ``_pre_disaster``."""
    return re.sub(r"_(pre|post)_disaster$", "", Path(pre).stem) or "scene"


@contextmanager
def temporary_folder() -> Iterator[Path]:
    """A temporary folder for detected footprints, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="local-damage-detected-") as tmp:
        yield Path(tmp)


def pixel_pair(pre: Sequence[str | os.PathLike], post: Sequence[str | os.PathLike]) -> bool:
    """Whether a footprint-free ``score`` is an xBD-mode one: a single pre and post image, the
    pre image without georeferencing (a pixel-aligned pair such as xBD's PNGs)."""
    return len(pre) == 1 and len(post) == 1 and image_georef(pre[0])[0] is None


def detect_tile(
    localizer,
    pre: str | os.PathLike,
    post: str | os.PathLike,
    out_dir: str | os.PathLike,
    georeferenced: bool,
    max_pixels: int | None = None,
) -> Path:
    """The web app's footprint-free tile: detect its buildings into the assessment folder.

    Returns:
        ``out_dir/<scene>.gpkg`` (georeferenced tiles, pre CRS) or
        ``out_dir/<scene>_pre_disaster.json`` (an xBD label file of pixel polygons), to be
        assessed as uploaded footprints are.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = scene_name(pre)
    if georeferenced:
        path = out_dir / f"{name}.gpkg"
        detect_scene_footprints(
            localizer, [pre], [post], path, max_pixels=max_pixels, progress=False
        )
    else:
        path = out_dir / f"{name}_pre_disaster.json"
        detect_xbd_labels(localizer, pre, post, path, max_pixels)
    return path


# --------------------------------------------------------------------------- detect, then grade


def score_scene_detected(
    predictor,
    pre: Sequence[str | os.PathLike],
    post: Sequence[str | os.PathLike],
    paths: OutputPaths | str | os.PathLike,
    *,
    localizer=None,
    name: str | None = None,
    options: ScoreOptions | None = None,
) -> ScoreReport:
    """Find the buildings of a georeferenced scene with the localiser, then grade them as
    :func:`app.scoring.scene.score_scene` grades footprints (``source`` ``detected``).

    Args:
        predictor: the loaded damage model (:class:`runtime.predictor.Predictor`).
        pre, post: the scene's pre- and post-disaster GeoTIFF tiles.
        paths: the outputs, as :func:`app.scoring.scene.score_scene` writes them.
        localizer: the :class:`runtime.localizer.Localizer` (default: the bundled one).
        name: scene name (default: the first pre file's stem without ``_pre_disaster``).
        options: as for :func:`app.scoring.scene.score_scene`; the localiser reads the pre
            mosaic in blocks of ``options.block_size``.

    Returns:
        The report, with ``detected`` (buildings found) and ``seconds`` (detection included).

    Raises:
        OutputError: an output path with an unusable suffix (checked before any work).
        SceneError: no localiser available, unusable imagery, or no building found.
    """
    start = time.perf_counter()
    options = options or ScoreOptions()
    paths = OutputPaths.of(paths)
    paths.check()
    localizer = require_localizer(localizer, "--buildings")
    with temporary_folder() as tmp:
        found = detect_scene_footprints(
            localizer,
            pre,
            post,
            tmp / "detected.gpkg",
            block_size=options.block_size,
            max_pixels=options.max_pixels,
            progress=options.progress,
        )
        report = score_scene(
            predictor,
            pre,
            post,
            tmp / "detected.gpkg",
            paths,
            name=name or scene_name(pre[0]),
            options=with_largest_building(options, localizer),
            origin=Origin(DETECTED, f"{', '.join(map(str, pre))}: detected building"),
        )
    report.detected, report.seconds = found, time.perf_counter() - start
    return report


def score_xbd_detected(
    predictor,
    pre: str | os.PathLike,
    post: str | os.PathLike,
    paths: OutputPaths | str | os.PathLike,
    *,
    localizer=None,
    name: str | None = None,
    options: ScoreOptions | None = None,
) -> ScoreReport:
    """Find the buildings of a pixel-aligned pre/post pair's pre image with the localiser, then
    grade them as :func:`app.scoring.xbd.score_xbd` grades label polygons (``source``
    ``detected``).

    Args and Returns: as :func:`score_scene_detected`, for one pre and one post image.

    Raises:
        OutputError: an output path with an unusable suffix (checked before any work).
        SceneError: no localiser available, a GeoJSON output for a pre image without
            georeferencing (checked before any work), an unusable image, or no building found.
    """
    start = time.perf_counter()
    options = options or ScoreOptions()
    paths = OutputPaths.of(paths)
    fmt = paths.check()
    if fmt == "geojson" and image_georef(pre)[0] is None:
        raise SceneError(
            pre,
            "is not georeferenced, so the buildings detected on it cannot be placed in "
            f"longitude/latitude for GeoJSON; write {Path(paths.vector).with_suffix('.gpkg').name} "
            "instead (pixel coordinates)",
        )
    localizer = require_localizer(localizer, "--labels")
    name = name or scene_name(pre)
    with temporary_folder() as tmp:
        path = tmp / f"{name}_pre_disaster.json"
        found = detect_xbd_labels(localizer, pre, post, path, options.max_pixels)
        report = score_xbd(
            predictor,
            pre,
            post,
            path,
            paths,
            name=name,
            options=with_largest_building(options, localizer),
            origin=Origin(DETECTED, f"{pre}: detected building"),
        )
    report.detected, report.seconds = found, time.perf_counter() - start
    return report
