"""Pixel grids and geometry: the grid a scene is read on, and moving shapely geometries between
CRS and grid pixels (no file reading).

:func:`pre_grid` gives a scene's target grid, the *pre grid*, from its pre tiles:

- CRS: the CRS shared by most pre tiles (the first given tile breaks ties).
- Pixel size: square, the finest pre resolution measured in that CRS.
- Origin: aligned to the finest pre tile in that CRS, so its pixels are read without resampling;
  the grid covers the union of the pre tiles.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from affine import Affine
    from rasterio.crs import CRS


@dataclass(frozen=True)
class Grid:
    """A north-up pixel grid: CRS, affine transform (pixel corner -> CRS units) and size.

    Pixel coordinates are (col, row) = (x, y) with (0, 0) the top-left corner of the top-left pixel.
    """

    crs: CRS
    transform: Affine
    width: int
    height: int

    @property
    def res(self) -> float:
        """Pixel side in CRS units (metres for projected CRS)."""
        return float(abs(self.transform.a))

    @property
    def bounds(self) -> tuple[float, float, float, float]:
        """(minx, miny, maxx, maxy) in CRS units."""
        t = self.transform
        x0, y0 = t.c, t.f
        x1, y1 = t @ (self.width, self.height)
        return min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1)

    def window_transform(self, col_off: int, row_off: int) -> Affine:
        """The transform of a window whose top-left pixel is (col_off, row_off)."""
        from affine import Affine

        return self.transform @ Affine.translation(col_off, row_off)

    def to_pixels(self, geometries: np.ndarray) -> np.ndarray:
        """Shapely geometries in the grid CRS -> the same geometries in pixel coordinates."""
        return affine_geometries(geometries, ~self.transform)

    def from_pixels(self, geometries: np.ndarray) -> np.ndarray:
        """Shapely geometries in pixel coordinates -> the same geometries in the grid CRS."""
        return affine_geometries(geometries, self.transform)

    def to_dict(self) -> dict:
        return {
            "crs": self.crs.to_string(),
            "transform": list(self.transform)[:6],
            "width": self.width,
            "height": self.height,
        }


def affine_geometries(geometries, t) -> np.ndarray:
    """Shapely geometries with the affine transform ``t`` applied to every coordinate."""
    import shapely

    def apply(xy: np.ndarray) -> np.ndarray:
        x, y = xy[:, 0], xy[:, 1]
        return np.column_stack([t.a * x + t.b * y + t.c, t.d * x + t.e * y + t.f])

    return shapely.transform(np.asarray(geometries, dtype=object), apply)


def reproject_geometries(geometries, src_crs, dst_crs) -> np.ndarray:
    """Shapely geometries from ``src_crs`` to ``dst_crs`` (x = easting/longitude first).

    Coordinates that cannot be transformed become infinite; callers check ``shapely.bounds``.
    """
    import shapely

    geometries = np.asarray(geometries, dtype=object)
    transformer = _transformer(_crs_text(src_crs), _crs_text(dst_crs))
    if transformer is None:
        return geometries

    def apply(xy: np.ndarray) -> np.ndarray:
        x, y = transformer.transform(xy[:, 0], xy[:, 1])
        return np.column_stack([x, y])

    return shapely.transform(geometries, apply)


#: Transformers between CRS pairs most recently used, per thread (pyproj's are not shared
#: between threads): building one costs milliseconds, a scene asks for the same pairs often.
_TRANSFORMERS = threading.local()
#: Pairs kept per thread.
TRANSFORMER_CACHE = 16


def _transformer(src: str, dst: str):
    """The pyproj transformer from ``src`` to ``dst`` (CRS text), x first; None when the two
    are the same CRS. Kept for the next call with the same pair (same thread)."""
    cache = getattr(_TRANSFORMERS, "pairs", None)
    if cache is None:
        cache = _TRANSFORMERS.pairs = {}
    key = (src, dst)
    if key in cache:
        return cache[key]
    from pyproj import CRS as ProjCRS
    from pyproj import Transformer

    a, b = ProjCRS.from_user_input(src), ProjCRS.from_user_input(dst)
    made = None if a == b else Transformer.from_crs(a, b, always_xy=True)
    if len(cache) >= TRANSFORMER_CACHE:
        cache.pop(next(iter(cache)))
    cache[key] = made
    return made


def _crs_text(crs) -> str:
    return crs if isinstance(crs, str) else crs.to_wkt()


def _resolution_in(tile, crs) -> float:
    """The pixel side of a :class:`data_prep.mosaic.Tile` (smallest of x and y) expressed in
    ``crs`` units."""
    from rasterio.warp import calculate_default_transform

    ds = tile.dataset
    if ds.crs == crs:
        t = ds.transform
        return float(min(np.hypot(t.a, t.d), np.hypot(t.b, t.e)))
    t, _, _ = calculate_default_transform(ds.crs, crs, ds.width, ds.height, *ds.bounds)
    return float(min(abs(t.a), abs(t.e)))


def pre_grid(tiles: Sequence) -> Grid:
    """The target grid of a scene from its pre tiles, open :class:`data_prep.mosaic.Tile` (see the
    module docstring)."""
    import shapely
    from affine import Affine

    counts = Counter(t.crs.to_wkt() for t in tiles)
    best = max(counts.values())
    crs = next(t.crs for t in tiles if counts[t.crs.to_wkt()] == best)
    resolutions = [_resolution_in(t, crs) for t in tiles]
    res = min(resolutions)
    footprints = []
    for tile in tiles:
        footprints.append(
            reproject_geometries(np.array([tile.source_footprint()], dtype=object), tile.crs, crs)[
                0
            ]
        )
    minx, miny, maxx, maxy = shapely.union_all(footprints).bounds
    anchor_x, anchor_y = minx, maxy
    for tile, r in zip(tiles, resolutions, strict=True):
        t = tile.dataset.transform
        if tile.crs == crs and t.b == 0 and t.d == 0 and np.isclose(r, res, rtol=1e-9):
            anchor_x, anchor_y = t.c, t.f if t.e < 0 else t.f + t.e * tile.dataset.height
            break

    def steps(value: float, origin: float) -> float:
        return round((value - origin) / res, 6)

    left = anchor_x + np.floor(steps(minx, anchor_x)) * res
    right = anchor_x + np.ceil(steps(maxx, anchor_x)) * res
    top = anchor_y + np.ceil(steps(maxy, anchor_y)) * res
    bottom = anchor_y + np.floor(steps(miny, anchor_y)) * res
    width = max(1, int(round((right - left) / res)))
    height = max(1, int(round((top - bottom) / res)))
    return Grid(
        crs=crs,
        transform=Affine(res, 0.0, float(left), 0.0, -res, float(top)),
        width=width,
        height=height,
    )
