"""Whether a footprint lies on valid imagery: one building (:func:`footprint_valid`), or every
building of one read at once (:func:`footprints_valid`, what cutting a scene uses).

A footprint is covered when every pixel whose centre lies in it is valid (inside the read, and
valid in both pre and post); a footprint too small to hold a pixel centre is judged by the pixel
under its centroid. Pixels are those GDAL's rasteriser burns (``rasterio.features.rasterize``,
pixel centres, not all touched).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def footprint_valid(pixel_geometry, valid: np.ndarray, col_off: int, row_off: int) -> bool:
    """Whether every pixel whose centre lies in the footprint is valid.

    Args:
        pixel_geometry: the footprint in grid pixel coordinates.
        valid: bool [H, W] validity of a block whose top-left pixel is (col_off, row_off).
        col_off, row_off: the block's position in grid pixels.

    Returns:
        True when all those pixels are inside the block and valid. A footprint too small to hold a
        pixel centre is judged by the pixel under its centroid.
    """
    from affine import Affine
    from rasterio.features import rasterize

    height, width = valid.shape
    minx, miny, maxx, maxy = pixel_geometry.bounds
    x0, y0 = math.floor(minx) - col_off, math.floor(miny) - row_off
    x1, y1 = math.ceil(maxx) - col_off, math.ceil(maxy) - row_off
    if x0 < 0 or y0 < 0 or x1 > width or y1 > height:
        return False
    if x1 <= x0 or y1 <= y0:
        mask = np.zeros((0, 0), dtype=bool)
    else:
        mask = rasterize(
            [(pixel_geometry, 1)],
            out_shape=(y1 - y0, x1 - x0),
            transform=Affine.translation(x0 + col_off, y0 + row_off),
            fill=0,
            dtype="uint8",
        ).astype(bool)
    return _decide(pixel_geometry, mask, valid, x0, y0, x1, y1, col_off, row_off)


def _decide(pixel_geometry, mask, valid, x0, y0, x1, y1, col_off, row_off) -> bool:
    if not mask.any():
        height, width = valid.shape
        c = pixel_geometry.centroid
        col, row = int(math.floor(c.x)) - col_off, int(math.floor(c.y)) - row_off
        return 0 <= row < height and 0 <= col < width and bool(valid[row, col])
    return bool(valid[y0:y1, x0:x1][mask].all())


def footprints_valid(
    pixel_geometries: Sequence,
    bounds: np.ndarray,
    valid: np.ndarray,
    col_off: int,
    row_off: int,
) -> np.ndarray:
    """:func:`footprint_valid` of many footprints on one block, with one rasterisation for all.

    The pixels a footprint can burn lie in its pixel box (``floor`` of its lower bounds to
    ``ceil`` of its upper ones). Every footprint whose box meets no other footprint's box is burnt
    into one label image (footprint ``k`` as ``k + 1``), where it owns every pixel of its box, so
    its pixels are exactly those labelled ``k + 1`` there; a footprint whose box meets another's
    is rasterised on its own, as :func:`footprint_valid` does. GDAL burns a pixel by where its
    centre lies in the footprint, which moving the raster's origin by whole pixels does not
    change, so the answer is :func:`footprint_valid`'s for every footprint (the tests compare
    the two on real footprints).

    Args:
        pixel_geometries: [n] footprints in grid pixel coordinates.
        bounds: [n, 4] their bounds (``shapely.bounds``).
        valid: bool [H, W] validity of the block whose top-left pixel is (col_off, row_off).
        col_off, row_off: the block's position in grid pixels.

    Returns:
        bool [n].
    """
    from affine import Affine
    from rasterio.features import rasterize

    n = len(pixel_geometries)
    out = np.zeros(n, dtype=bool)
    if n == 0:
        return out
    height, width = valid.shape
    b = np.asarray(bounds, dtype=float).reshape(n, 4)
    x0 = np.floor(b[:, 0]).astype(np.int64) - col_off
    y0 = np.floor(b[:, 1]).astype(np.int64) - row_off
    x1 = np.ceil(b[:, 2]).astype(np.int64) - col_off
    y1 = np.ceil(b[:, 3]).astype(np.int64) - row_off
    inside = (x0 >= 0) & (y0 >= 0) & (x1 <= width) & (y1 <= height)
    burnt = inside & (x1 > x0) & (y1 > y0)
    alone = burnt & ~_boxes_meet(x0, y0, x1, y1, burnt)
    ks = np.flatnonzero(alone)
    labels, ux0, uy0 = None, 0, 0
    if len(ks):
        ux0, uy0 = int(x0[ks].min()), int(y0[ks].min())
        ux1, uy1 = int(x1[ks].max()), int(y1[ks].max())
        labels = rasterize(
            [(pixel_geometries[k], int(k) + 1) for k in ks],
            out_shape=(uy1 - uy0, ux1 - ux0),
            transform=Affine.translation(col_off + ux0, row_off + uy0),
            fill=0,
            dtype="int32",
        )
    for k in np.flatnonzero(inside):
        geometry = pixel_geometries[k]
        if burnt[k] and not alone[k]:
            out[k] = footprint_valid(geometry, valid, col_off, row_off)
            continue
        r0, r1, c0, c1 = int(y0[k]), int(y1[k]), int(x0[k]), int(x1[k])
        if burnt[k]:
            mask = labels[r0 - uy0 : r1 - uy0, c0 - ux0 : c1 - ux0] == k + 1
        else:
            mask = np.zeros((0, 0), dtype=bool)
        out[k] = _decide(geometry, mask, valid, c0, r0, c1, r1, col_off, row_off)
    return out


def _boxes_meet(x0, y0, x1, y1, use: np.ndarray) -> np.ndarray:
    """bool [n]: which of the pixel boxes ``[x0, x1) x [y0, y1)`` (those where ``use``) share a
    pixel with another of them."""
    import shapely

    meet = np.zeros(len(x0), dtype=bool)
    ks = np.flatnonzero(use)
    if len(ks) < 2:
        return meet
    # shrunk by a quarter pixel: boxes that only touch do not share a pixel
    boxes = shapely.box(x0[ks] + 0.25, y0[ks] + 0.25, x1[ks] - 0.25, y1[ks] - 0.25)
    i, j = shapely.STRtree(boxes).query(boxes, predicate="intersects")
    other = i != j
    meet[ks[i[other]]] = True
    return meet
