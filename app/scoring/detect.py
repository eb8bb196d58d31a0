"""Scoring without footprints: the localiser's buildings become the footprints that are graded.

Given no footprint file, :func:`app.scoring.scene.score_scene` and :func:`app.scoring.xbd.score_xbd` find the
buildings with a localiser (:mod:`runtime.localizer`) and grade them exactly as supplied footprints
are graded; every output feature says where its building came from in a ``source`` column,
``given`` (supplied footprints) or ``detected`` (found by the localiser).

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

import functools
import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

#: ``source`` of a building whose footprint was supplied.
GIVEN = "given"
#: ``source`` of a building found by the localiser.
DETECTED = "detected"
#: ``uid`` prefix of detected buildings.
UID_PREFIX = "detected-"


def require_localizer(localizer, what: str):
    """``localizer``, or the default one (:func:`runtime.localizer.load_localizer`) when None.

    Raises:
        SceneError: naming ``what`` (the missing footprints), when no localiser is available or
            the file is not a valid localiser.
    """
    from data_prep.mosaic import SceneError
    from runtime.contract import ModelError

    if localizer is not None:
        return localizer
    from runtime.localizer import load_localizer

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
    from data_prep.store import atomic_path

    with atomic_path(Path(path), suffix=".json") as tmp:
        Path(tmp).write_text(json.dumps(data))
    return len(features)


def _none_found(localizer, item: str):
    from data_prep.mosaic import SceneError

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
    from app.scoring.scene import bounded_gdal_cache
    from data_prep.mosaic import open_scene
    from runtime.localizer import detect_scene

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
    from data_prep.imagery import ImageError, split_file_message
    from data_prep.mosaic import SceneError
    from data_prep.xbd import read_tile_pair

    try:
        image, _ = read_tile_pair(pre, post, max_pixels)
    except ImageError as exc:
        item, text = split_file_message(str(exc), (pre, post))
        raise SceneError(item or pre, text) from exc
    n = write_xbd_labels(localizer.detect(image), path, Path(pre).name)
    if not n:
        raise _none_found(localizer, str(pre))
    return n


def scene_name(pre: str | os.PathLike) -> str:
    """A scene name from a pre image: its stem without ``_pre_disaster``."""
    return re.sub(r"_(pre|post)_disaster$", "", Path(pre).stem) or "scene"


@contextmanager
def temporary_folder() -> Iterator[Path]:
    """A temporary folder for detected footprints, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="local-damage-detected-") as tmp:
        yield Path(tmp)


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


# --------------------------------------------------------------------------- command line


def localizer_argument(parser) -> None:
    """Add ``--localizer PATH`` to a subcommand's parser."""
    parser.add_argument(
        "--localizer",
        metavar="ONNX",
        help="building localiser used when no footprints are given (default: models/"
        "localizer.onnx when present; see docs/localize.md)",
    )


def cli_localizer(path: str | None):
    """The localiser for a command (``--localizer``, else the default), or None after printing
    why there is none."""
    import sys

    from runtime.contract import ModelError
    from runtime.localizer import load_localizer

    try:
        return load_localizer(path)
    except ModelError as exc:
        print(f"error: no footprints given: {exc}", file=sys.stderr)
        return None


def pixel_pair(pre: Sequence[str | os.PathLike], post: Sequence[str | os.PathLike]) -> bool:
    """Whether a footprint-free ``score`` is an xBD-mode one: a single pre and post image, the
    pre image without georeferencing (a pixel-aligned pair such as xBD's PNGs)."""
    from app.scoring.xbd import _image_georef

    return len(pre) == 1 and len(post) == 1 and _image_georef(pre[0])[0] is None


# --------------------------------------------------------------------------- web app


@functools.lru_cache(maxsize=8)
def _app_localizer(path: str):
    from runtime.localizer import Localizer

    return Localizer(path)


def app_localizer(models_dir: str | os.PathLike | None = None):
    """The web app's localiser: ``localizer.onnx`` of the app's models folder, else the default
    one (:func:`runtime.registry.default_localizer`); loaded once.

    Raises:
        AppError: none available (saying how to get one), or not a valid localiser.
    """
    from app.web.sessions import AppError
    from runtime.contract import ModelError
    from runtime.registry import LOCALIZER_NAME, default_localizer

    path = None
    if models_dir is not None and (Path(models_dir) / LOCALIZER_NAME).is_file():
        path = Path(models_dir) / LOCALIZER_NAME
    path = path or default_localizer()
    if path is None:
        raise AppError(
            "no footprints uploaded and no building localiser model available to detect the "
            f"buildings: upload footprints, or put a localiser at models/{LOCALIZER_NAME} "
            "(see docs/localize.md) and restart the app"
        )
    try:
        return _app_localizer(str(Path(path).resolve()))
    except ModelError as exc:
        raise AppError(f"localiser {Path(path).name}: {exc}") from exc


def app_detect(localizer, pre: Path, post: Path, out_dir: Path, max_pixels: int | None) -> Path:
    """:func:`detect_tile` for the web app: the footprint file written under
    ``out_dir/detected``; unusable input as :class:`app.web.sessions.AppError`."""
    from app.scoring.xbd import _image_georef
    from app.web.assess import _short
    from app.web.sessions import AppError
    from data_prep.imagery import ImageError
    from data_prep.mosaic import SceneError

    if localizer is None:
        raise AppError("no footprints uploaded and no building localiser to detect buildings")
    georeferenced = all(_image_georef(p)[0] is not None for p in (pre, post))
    try:
        return detect_tile(
            localizer, pre, post, Path(out_dir) / "detected", georeferenced, max_pixels
        )
    except (SceneError, ImageError) as exc:
        raise AppError(_short(str(exc))) from exc


def cli_batch_localizer(path: str | None, scenes) -> tuple[bool, object]:
    """``(ok, localizer)`` for ``score-batch``: the localiser when some scene has no footprints
    and one is given or bundled (None otherwise: those scenes then fail with a message saying
    how to get one, and the rest are scored); ``ok`` False when a given file is not usable."""
    from runtime.registry import default_localizer

    if not any(s.buildings is None for s in scenes) or not (path or default_localizer()):
        return True, None
    localizer = cli_localizer(path)
    return localizer is not None, localizer
