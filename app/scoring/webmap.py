"""The web map of a scored scene: one self-contained HTML file that opens offline in a browser.

The map is drawn by Leaflet (BSD-2-Clause), whose script, style sheet and images are read from
the ``xstatic-leaflet`` package and written into the file, so it needs no network: the file
holds the library, the pre and post imagery as switchable tile layers (pyramids of
:mod:`app.scoring.map_tiles`), every building coloured by its grade (flagged ones outlined in
magenta, :mod:`runtime.flags`), a legend with the counts, and a panel with a building's grade,
probabilities, confidence, flags, status and source when it is clicked. An OpenStreetMap layer
can be switched on where the browser has a network; it is off when the file opens, so opening
it sends no request anywhere.

Georeferenced scenes are drawn on Web Mercator with the buildings in longitude/latitude; images
without georeferencing on Leaflet's ``CRS.Simple`` in image pixels (no basemap).

A page that holds the map in an ``<iframe>`` (the web app) hears a click on a building as a
``message`` event ``{localDamage: "select", row: <#>}`` and shows building ``#`` on the map by
posting ``{localDamage: "show", row: <#>}`` to the frame. The file is written under a temporary
name and renamed into place (:func:`data_prep.store.atomic_file`).
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.scoring.common import probability_columns, to_crs
from app.scoring.map_tiles import (
    Pyramid,
    array_pyramids,
    lonlat_bounds,
    pixel_pyramids,
    scene_pyramids,
)
from app.scoring.outputs import (
    CLASS_COLOURS,
    FLAGGED_COLOUR,
    FLAGGED_LABEL,
    UNSCORED_COLOUR,
    OutputError,
)
from data_prep.grid import affine_geometries
from data_prep.store import atomic_file

#: Suffixes of the map file.
MAP_SUFFIXES = (".html", ".htm")
#: Digits kept of longitude/latitude (about 1 cm) and of image pixel coordinates.
LONLAT_DIGITS, PIXEL_DIGITS = 7, 2
#: Buildings above which the map draws on one canvas rather than one SVG path each.
CANVAS_ABOVE = 5000
#: The online basemap offered in the layer switcher (off when the file opens).
BASEMAP = {
    "name": "OpenStreetMap (online)",
    "url": "https://tile.openstreetmap.org/{z}/{x}/{y}.png",
    "attribution": "&copy; OpenStreetMap contributors",
    "maxNativeZoom": 19,
}
_ASSETS = Path(__file__).parent  # webmap.css and webmap.js


#: The opening tag of a map file's data block.
_DATA_OPEN = '<script id="ld-data" type="application/json">'


def check_map_path(path: str | os.PathLike) -> None:
    """Refuse a map path that is not ``.html`` / ``.htm`` (before any work).

    Raises:
        OutputError: naming the path and what is accepted.
    """
    if Path(path).suffix.lower() not in MAP_SUFFIXES:
        raise OutputError(f"{path}: the map is written as one HTML file; give a .html path")


@functools.lru_cache(maxsize=1)
def leaflet_assets() -> tuple[str, str, str]:
    """``(script, style, version)`` of Leaflet from the ``xstatic-leaflet`` package, the style's
    images as ``data:`` URIs and the script without its source-map link.

    Raises:
        OutputError: the package is not installed.
    """
    try:
        import xstatic.pkg.leaflet as xleaflet
    except ImportError as exc:
        raise OutputError(
            "the map needs Leaflet from the xstatic-leaflet package: pip install xstatic-leaflet"
        ) from exc
    base = Path(xleaflet.BASE_DIR)
    script = (base / "leaflet.js").read_text(encoding="utf-8")
    script = re.sub(r"//# sourceMappingURL=\S+\s*$", "", script)
    style = (base / "leaflet.css").read_text(encoding="utf-8")

    def inline(match: re.Match) -> str:
        data = base64.b64encode((base / match.group(1)).read_bytes()).decode("ascii")
        return f"url(data:image/png;base64,{data})"

    style = re.sub(r"url\((images/[\w.-]+\.png)\)", inline, style)
    return script, style, str(xleaflet.VERSION)


def _rounded(coords, digits: int, flip: bool):
    """GeoJSON coordinates rounded, with y negated for ``CRS.Simple`` (row down)."""
    if isinstance(coords, (list, tuple)) and coords and isinstance(coords[0], (int, float)):
        x, y = float(coords[0]), float(coords[1])
        return [round(x, digits), round(-y if flip else y, digits)]
    return [_rounded(c, digits, flip) for c in coords]


def building_features(
    geometries: Sequence,
    columns: Mapping[str, np.ndarray],
    masks: Mapping[str, np.ndarray],
    uids: Sequence[str],
    class_names: Sequence[str],
    pixel: bool = False,
) -> list[dict]:
    """GeoJSON features of the buildings with a geometry, each with its row ``n`` (the ``#`` of
    the web app's table and the feature's order in the vector output), ``uid``, ``damage``,
    ``damage_id`` (-1 when not scored), probabilities ``p`` (class order), ``confidence``,
    ``flags``, ``status`` and ``source``.

    Args:
        geometries: [N] shapely geometries in longitude/latitude, or image pixels when ``pixel``.
        columns, masks: the score columns (:meth:`app.scoring.common.Scores.columns`).
        uids: [N] building ids.
        class_names: the model's classes.
        pixel: image pixel coordinates (x = column, y = row).
    """
    import shapely

    digits = PIXEL_DIGITS if pixel else LONLAT_DIGITS
    probs = probability_columns(class_names)
    out = []
    for n, geom in enumerate(geometries):
        if geom is None or geom.is_empty:
            continue
        scored = not bool(masks["damage"][n])
        mapping = shapely.geometry.mapping(geom)
        feature = {
            "type": "Feature",
            "geometry": {
                "type": mapping["type"],
                "coordinates": _rounded(mapping["coordinates"], digits, pixel),
            },
            "properties": {
                "n": n,
                "uid": str(uids[n]),
                "damage": str(columns["damage"][n]) if scored else None,
                "damage_id": int(columns["damage_id"][n]) if scored else -1,
                "p": [round(float(columns[p][n]), 4) for p in probs] if scored else None,
                "confidence": round(float(columns["confidence"][n]), 4) if scored else None,
                "flags": str(columns["flags"][n] or ""),
                "status": str(columns["status"][n]),
                "source": str(columns["source"][n]),
            },
        }
        out.append(feature)
    return out


def _hex(rgb: Sequence[int]) -> str:
    return "#" + "".join(f"{int(v):02x}" for v in rgb)


def map_document(
    title: str,
    features: list[dict],
    class_names: Sequence[str],
    pre: Pyramid,
    post: Pyramid,
    bounds: Sequence[float],
    georeferenced: bool,
    note: str = "",
) -> str:
    """The map's HTML: Leaflet, the map's style and script, and its data as one JSON block.

    Args:
        title: the scene's name (shown as text, never as markup).
        features: :func:`building_features`.
        class_names: the model's classes.
        pre, post: the imagery pyramids.
        bounds: ``(west, south, east, north)``: degrees when ``georeferenced``, else image pixels
            ``(0, height, width, 0)``.
        georeferenced: Web Mercator with a basemap, else ``CRS.Simple`` in image pixels.
        note: a line shown under the title (e.g. what the imagery is).
    """
    script, style, version = leaflet_assets()
    counts = {name: 0 for name in class_names}
    flagged = 0
    for f in features:
        p = f["properties"]
        if p["damage"] is not None:
            counts[p["damage"]] = counts.get(p["damage"], 0) + 1
        flagged += bool(p["flags"])
    data = {
        "title": title,
        "note": note,
        "georeferenced": georeferenced,
        "bounds": [float(b) for b in bounds],
        "classes": list(class_names),
        "colours": [_hex(c) for c in CLASS_COLOURS[: len(class_names)]],
        "unscored": _hex(UNSCORED_COLOUR),
        "flagged": _hex(FLAGGED_COLOUR),
        "flaggedLabel": FLAGGED_LABEL,
        "counts": counts,
        "nFlagged": flagged,
        "nBuildings": len(features),
        "canvas": len(features) > CANVAS_ABOVE,
        "basemap": BASEMAP if georeferenced else None,
        "layers": {"pre": pre.to_dict(), "post": post.to_dict()},
        "buildings": {"type": "FeatureCollection", "features": features},
        "leaflet": version,
    }
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    page_css = (_ASSETS / "webmap.css").read_text(encoding="utf-8")
    page_js = (_ASSETS / "webmap.js").read_text(encoding="utf-8")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>local-damage map: {_escape(title)}</title>\n"
        f"<style>\n{style}\n</style>\n<style>\n{page_css}\n</style>\n</head>\n<body>\n"
        '<div id="map"></div>\n'
        f"<script>\n{script}\n</script>\n"
        f"{_DATA_OPEN}{payload}</script>\n"
        f"<script>\n{page_js}\n</script>\n</body></html>\n"
    )


def _escape(text: str) -> str:
    import html

    return html.escape(str(text), quote=True)


def write_map(path: str | os.PathLike, document: str) -> Path:
    """Write a map file (:func:`map_document`) atomically; returns its path."""
    path = Path(path)
    check_map_path(path)
    with atomic_file(path, suffix=path.suffix, text=True) as fh:
        fh.write(document)
    return path


@dataclass(frozen=True)
class MapBuildings:
    """The graded buildings a map shows.

    Attributes:
        geometries: [N] building geometries (None where a feature has none): in
            longitude/latitude for :func:`scene_map`, in image pixels for :func:`image_map`.
        columns, masks: the score columns (:meth:`app.scoring.common.Scores.columns`).
        uids: [N] building ids.
        class_names: the model's classes.
        title: the scene's name.
    """

    geometries: Sequence
    columns: Mapping[str, np.ndarray]
    masks: Mapping[str, np.ndarray]
    uids: Sequence[str]
    class_names: Sequence[str]
    title: str

    def features(self, geometries: Sequence, pixel: bool = False) -> list[dict]:
        """:func:`building_features` of these buildings placed at ``geometries``."""
        return building_features(
            geometries, self.columns, self.masks, self.uids, self.class_names, pixel=pixel
        )


def scene_map(path: str | os.PathLike, scene, buildings: MapBuildings) -> Path:
    """The map of a scored georeferenced scene: its pre and post mosaics on Web Mercator.

    Args:
        path: the ``.html`` file.
        scene: the open :class:`data_prep.mosaic.Scene` (its post offset as scoring used it).
        buildings: the graded buildings, geometries in longitude/latitude.
    """
    grid = scene.grid
    pre, post = scene_pyramids(scene)
    bounds = lonlat_bounds(grid.crs, grid.transform, grid.width, grid.height)
    features = buildings.features(buildings.geometries)
    page = map_document(buildings.title, features, buildings.class_names, pre, post, bounds, True)
    return write_map(path, page)


def image_map(
    path: str | os.PathLike,
    images: tuple[np.ndarray, np.ndarray],
    crs,
    transform,
    buildings: MapBuildings,
) -> Path:
    """The map of a scored pixel-aligned image pair (xBD mode): on Web Mercator when the pre
    image is georeferenced (``crs`` and ``transform``), else in image pixels.

    Args:
        path: the ``.html`` file.
        images: the pre and (aligned) post uint8 [H, W, 3] images.
        crs, transform: the pre image's georeferencing, or None.
        buildings: the graded buildings, geometries as polygons in image pixels.
    """
    h, w = images[0].shape[:2]
    title, class_names = buildings.title, buildings.class_names
    geoms = np.empty(len(buildings.geometries), dtype=object)
    geoms[:] = list(buildings.geometries)
    if crs is None:
        pre, post = pixel_pyramids(images)
        features = buildings.features(geoms, pixel=True)
        note = "image pixels (not georeferenced)"
        bounds = (0, h, w, 0)
        page = map_document(title, features, class_names, pre, post, bounds, False, note)
        return write_map(path, page)
    present = np.array([g is not None and not g.is_empty for g in geoms], dtype=bool)
    placed = np.empty(len(geoms), dtype=object)
    if present.any():
        placed[present] = to_crs(affine_geometries(geoms[present], transform), crs, "OGC:CRS84")
    pre, post = array_pyramids(images, crs, transform)
    bounds = lonlat_bounds(crs, transform, w, h)
    features = buildings.features(placed)
    return write_map(path, map_document(title, features, class_names, pre, post, bounds, True))


def with_corrections(document: str, corrections: Mapping[int, tuple[str, str]]) -> str:
    """A map document (the text of a map file) with the analysts' grades: ``corrections`` maps
    a building's row to ``(grade, analyst)``; those buildings show that grade's colour with a
    dashed outline and "corrected ... (by ...)" in their details."""
    start = document.index(_DATA_OPEN) + len(_DATA_OPEN)
    end = document.index("</script>", start)
    data = json.loads(document[start:end])
    for f in data["buildings"]["features"]:
        p = f["properties"]
        p["corrected"], p["corrected_by"] = corrections.get(int(p["n"]), (None, None))
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    return document[:start] + payload + document[end:]


def read_map_data(path: str | os.PathLike) -> dict:
    """The data block of a map file (title, bounds, classes, counts, imagery layers, buildings).

    Raises:
        OutputError: the file holds no local-damage map data.
    """
    text = Path(path).read_text(encoding="utf-8")
    match = re.search(re.escape(_DATA_OPEN) + r"(.*?)</script>", text, re.S)
    if match is None:
        raise OutputError(f"{path}: not a local-damage map (no map data block)")
    return json.loads(match.group(1))
