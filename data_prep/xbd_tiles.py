"""The xBD release on disk: finding its tiles, reading their label JSON and their images.

xBD as distributed holds ``ROOT/images/<event>_<id>_{pre,post}_disaster.{png,tif}`` with
``ROOT/labels/<same>.json``, or the same under the split folders
``ROOT/{train,tier3,test,hold}/``. Building polygons come from the post label's ``features.xy``
(pixel WKT) and their damage class from ``properties.subtype``; ``features.lng_lat`` gives the
geographic centroid. Cutting the tiles into a chip store is :mod:`data_prep.xbd`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep import quality
from data_prep.errors import LocalDamageError
from data_prep.imagery import ImageError, read_rgb, read_rgb_pair
from data_prep.quality import BLANK
from data_prep.report import PrepareReport
from data_prep.spec import UNCLASSIFIED, UNLABELLED, parse_label

#: Split folders of the distributed xBD release, searched below each root.
SPLITS: tuple[str, ...] = ("train", "tier3", "test", "hold")


_IMAGE_NAME = re.compile(
    r"^(?P<tile>.+)_(?P<phase>pre|post)_disaster\.(?P<ext>png|tiff?)$", re.IGNORECASE
)


_LABEL_NAME = re.compile(r"^(?P<tile>.+)_post_disaster\.json$", re.IGNORECASE)


class XbdRootError(LocalDamageError, ValueError):
    """An xBD root that does not exist or holds no xBD tiles; the message names the folder."""


@dataclass(frozen=True)
class XbdTile:
    """The files of one xBD tile; a path is None when the file is missing.

    Attributes:
        name: file stem without ``_post_disaster`` (e.g. ``guatemala-volcano_00000003``).
        pre: pre-disaster image.
        post: post-disaster image.
        label: post-disaster label JSON (the expected path when it is missing).
        label_exists: whether ``label`` was found.
        images_dir: the folder the images are (or would be) in.
    """

    name: str
    pre: Path | None
    post: Path | None
    label: Path
    label_exists: bool
    images_dir: Path

    @property
    def event(self) -> str:
        """Event from the file-name prefix (the label's ``metadata.disaster`` takes precedence)."""
        return self.name.rsplit("_", 1)[0] if "_" in self.name else self.name


@dataclass
class Building:
    """One building of a post label: pixel geometry summary, class and geographic centroid."""

    uid: str
    label: int
    centroid: tuple[float, float]  # (x, y) pixels
    bbox: tuple[float, float, float, float]  # (minx, miny, maxx, maxy) pixels
    lonlat: tuple[float, float] | None


def _image_dirs(root: Path) -> list[Path]:
    dirs = [root / "images"] + [root / split / "images" for split in SPLITS]
    extra = sorted(p for p in root.glob("*/images") if p.parent.name not in SPLITS)
    return [d for d in dirs + extra if d.is_dir()]


def as_roots(root: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """One xBD root or several, as a list of paths."""
    return [Path(root)] if isinstance(root, (str, os.PathLike)) else [Path(r) for r in root]


def roots_label(root: str | os.PathLike | Sequence[str | os.PathLike]) -> str:
    """The roots for a message: ``a`` or ``a, b``."""
    return ", ".join(map(str, as_roots(root)))


def find_tiles(
    roots: Sequence[str | os.PathLike] | str | os.PathLike,
) -> tuple[list[XbdTile], list[tuple[str, str]]]:
    """Find the xBD tiles below one or more roots.

    Looks in ``ROOT/images`` + ``ROOT/labels`` and in ``ROOT/<split>/images`` + ``labels`` for
    every split folder (``train``, ``tier3``, ``test``, ``hold`` or any other folder holding an
    ``images`` folder). A tile is known from any of its pre image, post image or post label.

    Args:
        roots: one root folder or several.

    Returns:
        ``(tiles, duplicates)``: tiles sorted by name, and ``(file, reason)`` for tiles whose name
        was already found under an earlier root (they are left out).

    Raises:
        XbdRootError: a root does not exist, is not a folder or holds no xBD tiles.
    """
    found: dict[str, XbdTile] = {}
    duplicates: list[tuple[str, str]] = []
    for root in as_roots(roots):
        if not root.exists():
            raise XbdRootError(f"{root}: xBD root folder does not exist")
        if not root.is_dir():
            raise XbdRootError(f"{root}: xBD root is not a folder")
        here: dict[str, dict] = {}
        seen_any = False
        for images_dir in _image_dirs(root):
            labels_dir = images_dir.parent / "labels"
            entries: dict[str, dict] = {}
            for path in sorted(images_dir.iterdir()):
                m = _IMAGE_NAME.match(path.name)
                if m and path.is_file():
                    slot = entries.setdefault(m["tile"], {})
                    phase = m["phase"].lower()
                    # prefer PNG over TIFF when both are present (sorted: .png before .tif)
                    slot.setdefault(phase, path)
            if labels_dir.is_dir():
                for path in sorted(labels_dir.iterdir()):
                    m = _LABEL_NAME.match(path.name)
                    if m:
                        entries.setdefault(m["tile"], {})["label"] = path
            seen_any = seen_any or bool(entries)
            for name, slot in entries.items():
                if name in here or name in found:
                    first = here.get(name, {}).get("dir") or found[name].images_dir
                    duplicates.append(
                        (
                            str(images_dir / name),
                            f"tile name already found in {first}; this copy is left out",
                        )
                    )
                    continue
                slot["dir"] = images_dir
                slot["labels_dir"] = labels_dir
                here[name] = slot
        if not seen_any:
            raise XbdRootError(
                f"{root}: no xBD tiles found; expected images/<event>_<id>_pre_disaster.png (or .tif) "
                f"with labels/<event>_<id>_post_disaster.json, directly or under {'/, '.join(SPLITS)}/"
            )
        for name, slot in here.items():
            label = slot.get("label") or slot["labels_dir"] / f"{name}_post_disaster.json"
            found[name] = XbdTile(
                name, slot.get("pre"), slot.get("post"), label, "label" in slot, slot["dir"]
            )
    return sorted(found.values(), key=lambda t: t.name), duplicates


def _load_json(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            data = json.loads(fh.read())
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"not valid JSON (not UTF-8 text: {exc.reason})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("features"), dict):
        raise ValueError("not an xBD label file (no 'features' object)")
    return data


def _point_xy(points: np.ndarray) -> np.ndarray:
    """[N, 2] (x, y) of an array of shapely points, NaN where a point is missing or empty."""
    import shapely

    out = np.full((len(points), 2), np.nan)
    coords, index = shapely.get_coordinates(points, return_index=True)
    out[index] = coords
    return out


def parse_buildings(
    path: Path,
    report: PrepareReport,
    include_unclassified: bool = False,
    ignore_labels: bool = False,
) -> tuple[str | None, list[Building]]:
    """Read the buildings of one post-disaster label file.

    Buildings with invalid WKT, an empty polygon, an unknown subtype or a repeated uid are
    skipped into ``report``; un-classified ones are counted as excluded unless
    ``include_unclassified`` (then they get label -1).

    Args:
        path: the ``*_post_disaster.json`` label file.
        report: where skipped and excluded buildings are recorded.
        include_unclassified: keep un-classified buildings as unlabelled.
        ignore_labels: read footprints only: every building gets label -1 whatever its subtype
            (also when it has none, as in pre-disaster label files), and none is excluded or
            skipped for its subtype (used when scoring).

    Returns:
        ``(event, buildings)``: the label's ``metadata.disaster`` (None when absent) and the
        buildings in file order.

    Raises:
        ValueError: the file is not JSON or not an xBD label file (message without the path).
    """
    import shapely
    from shapely.errors import ShapelyError

    data = _load_json(path)
    features = data["features"]
    xy = features.get("xy")
    if not isinstance(xy, list):
        raise ValueError("not an xBD label file (no 'features.xy' list)")
    meta = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    event = meta.get("disaster") or None

    lonlat_wkt: dict[str, str] = {}
    for f in features.get("lng_lat") or []:
        props = (f.get("properties") or {}) if isinstance(f, dict) else {}
        if "uid" in props and isinstance(f.get("wkt"), str):
            lonlat_wkt[str(props["uid"])] = f["wkt"]

    # validate properties first, then parse all WKT of the file in one vectorised call
    candidates: list[tuple[str, int, object]] = []
    seen: set[str] = set()
    for i, feature in enumerate(xy):
        props = (feature.get("properties") if isinstance(feature, dict) else None) or {}
        uid = str(props.get("uid") or f"#{i}")
        if props.get("feature_type", "building") != "building":
            continue
        subtype = props.get("subtype")
        if ignore_labels:
            label = UNLABELLED
        elif str(subtype).strip().lower() == UNCLASSIFIED:
            if not include_unclassified:
                report.excluded_unclassified += 1
                continue
            label = UNLABELLED
        else:
            try:
                label = parse_label(subtype)
            except ValueError as exc:
                report.skip(f"{path} building {uid}", str(exc))
                continue
            if label is None:
                report.skip(f"{path} building {uid}", "no damage subtype in the post label")
                continue
        if uid in seen:
            report.skip(
                f"{path} building {uid}",
                "uid repeated within the label file; only the first is used",
            )
            continue
        seen.add(uid)
        wkt = feature.get("wkt") if isinstance(feature, dict) else None
        candidates.append((uid, label, wkt if isinstance(wkt, str) else None))
    if not candidates:
        return event, []

    wkts = np.array([c[2] for c in candidates], dtype=object)
    geoms = shapely.from_wkt(wkts, on_invalid="ignore")
    bounds = shapely.bounds(geoms)
    centroids = shapely.centroid(geoms)
    cxy = _point_xy(centroids)
    geo_wkts = np.array([lonlat_wkt.get(c[0]) for c in candidates], dtype=object)
    geo_centroids = shapely.centroid(shapely.from_wkt(geo_wkts, on_invalid="ignore"))
    lonlats = _point_xy(geo_centroids)

    has_geom = (~shapely.is_missing(geoms)).tolist()
    has_bounds = np.isfinite(bounds).all(axis=1).tolist()
    has_centroid = np.isfinite(cxy).all(axis=1).tolist()
    has_lonlat = np.isfinite(lonlats).all(axis=1).tolist()
    bounds_l, cxy_l, lonlats_l = bounds.tolist(), cxy.tolist(), lonlats.tolist()
    buildings: list[Building] = []
    for k, (uid, label, wkt) in enumerate(candidates):
        if not has_geom[k] and wkt is not None:
            try:
                shapely.from_wkt(wkt)
                reason = "invalid WKT"
            except ShapelyError as exc:
                reason = f"invalid WKT ({exc})"
            report.skip(f"{path} building {uid}", reason)
            continue
        if not has_geom[k] or not has_bounds[k]:
            report.skip(f"{path} building {uid}", "empty or missing polygon WKT")
            continue
        minx, miny, maxx, maxy = bounds_l[k]
        if has_centroid[k]:
            centroid = (cxy_l[k][0], cxy_l[k][1])
        else:  # degenerate polygon without a centroid: use the bbox centre
            centroid = ((minx + maxx) / 2, (miny + maxy) / 2)
        lonlat = (lonlats_l[k][0], lonlats_l[k][1]) if has_lonlat[k] else None
        buildings.append(Building(uid, label, centroid, (minx, miny, maxx, maxy), lonlat))
    return event, buildings


def read_tile_image(path: str | os.PathLike, max_pixels: int | None = None) -> np.ndarray:
    """Decode one tile image into uint8 [H, W, 3] (the reader used by `prepare xbd` and its bench).

    rasterio/GDAL decodes xBD PNGs faster than OpenCV or PIL (see docs/benchmarks.md) and also
    reads GeoTIFFs, so it is used for every format.
    """
    return read_rgb(path, max_pixels)


def read_tile_pair(
    pre: str | os.PathLike, post: str | os.PathLike, max_pixels: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Decode a tile's pre and post images into uint8 [H, W, 3] under one radiometric rule
    (:func:`data_prep.imagery.read_rgb_pair`), refusing a blank image (every pixel one value).

    Raises:
        ImageError: naming the file at fault.
    """
    pre_rgb, post_rgb, _ = read_rgb_pair(pre, post, max_pixels)
    for path, image in ((pre, pre_rgb), (post, post_rgb)):
        if image.size and quality.is_constant(image):
            raise ImageError(
                f"{path}: {BLANK}: every pixel is {int(image.flat[0])} (an all-zero, nodata or "
                "constant-fill image holds nothing to grade)"
            )
    return pre_rgb, post_rgb
