"""Building polygons from a building mask or probability map (the localiser's output).

:func:`mask_to_polygons` turns a per-pixel building probability (or a 0/1 mask) into one shapely
polygon per building:

The rules below are set by :class:`PolygonOptions`:

1. pixels ``>= threshold`` are building; blobs (4-connected) of fewer than ``min_area_px`` pixels
   are dropped and holes smaller than ``hole_area_px`` are filled;
2. touching buildings are separated (``separate=True``): inside each blob, the distance to the
   background is computed (``cv2.distanceTransform``), its domes at least
   ``max(split_px, split_ratio * peak)`` high (the h-maxima of the distance) become markers, grown
   back over the blob level by level from the highest distance down (a watershed), so a blob made of two buildings joined by a
   narrower neck is cut at the neck. A blob with one dome stays whole, and a piece smaller than
   ``min_area_px`` is given back to its neighbour. Deterministic: no randomness, and ties are
   broken by label order;
3. each piece is traced along pixel edges (``rasterio.features.shapes``), so its area equals
   its pixel count, simplified by ``simplify_px`` pixels (topology preserved) and, when a
   ``transform`` is given, placed in map coordinates.

Pure numpy / OpenCV / rasterio / shapely: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Default depth, in pixels of distance, of a dome of the distance map that marks a building.
SPLIT_PX = 2.0
#: Default depth of such a dome relative to the blob's highest distance.
SPLIT_RATIO = 0.2


def binary_mask(probability_or_mask: np.ndarray, threshold: float = 0.5) -> np.ndarray:
    """Bool ``[H, W]``: a bool mask as it is, otherwise the pixels ``>= threshold``."""
    a = np.asarray(probability_or_mask)
    if a.ndim != 2:
        raise ValueError(f"expected a [H, W] mask or probability map, got shape {a.shape}")
    if a.dtype == bool:
        return a
    return a >= threshold


@dataclass(frozen=True)
class PolygonOptions:
    """How :func:`mask_to_polygons` turns a mask into building outlines (module docstring).

    Attributes:
        threshold: probability at or above which a pixel is building (ignored for bool masks).
        min_area_px: blobs (and separated pieces) of fewer pixels are dropped (pieces merged back).
        simplify_px: Douglas-Peucker tolerance in pixels (topology preserved); 0 keeps the
            pixel-edge outline.
        separate: split blobs made of several touching buildings.
        hole_area_px: holes of fewer pixels are filled (None: ``max(min_area_px, 4)``).
        split_px: a dome of the distance map marks a building when it rises at least
            ``max(split_px, split_ratio * peak)`` pixels above where it joins another.
        split_ratio: see ``split_px``.
    """

    threshold: float = 0.5
    min_area_px: int = 0
    simplify_px: float = 1.0
    separate: bool = True
    hole_area_px: int | None = None
    split_px: float = SPLIT_PX
    split_ratio: float = SPLIT_RATIO


def mask_to_polygons(
    probability_or_mask: np.ndarray,
    options: PolygonOptions | None = None,
    *,
    transform=None,
) -> list:
    """One polygon per building of a mask.

    Args:
        probability_or_mask: float ``[H, W]`` building probability, or a bool / 0-1 mask.
        options: the threshold and the rules of the outlines (default ``PolygonOptions()``).
        transform: ``affine.Affine`` from pixel (col, row) to map coordinates; None keeps pixel
            coordinates (x = column, y = row, the top-left corner of the top-left pixel at 0, 0).

    Returns:
        Shapely polygons, in raster order of their first pixel.
    """
    import cv2

    o = options or PolygonOptions()
    min_area_px, hole_area_px = o.min_area_px, o.hole_area_px
    binary = binary_mask(probability_or_mask, o.threshold)
    height, width = binary.shape
    if not binary.any():
        return []
    holes = max(int(min_area_px), 4) if hole_area_px is None else int(hole_area_px)
    count, labels, stats, _ = cv2.connectedComponentsWithStats(
        binary.astype(np.uint8), connectivity=4, ltype=cv2.CV_32S
    )
    pieces = np.zeros((height, width), np.int32)
    next_id = 1
    for k in range(1, count):
        x, y, w, h, area = (int(v) for v in stats[k])
        if area < max(int(min_area_px), 1):
            continue
        blob = labels[y : y + h, x : x + w] == k
        blob = _fill_holes(blob, holes)
        parts = (
            _split(blob, o.split_px, o.split_ratio, min_area_px)
            if o.separate
            else blob.astype(np.int32)
        )
        n = int(parts.max())
        target = pieces[y : y + h, x : x + w]
        inside = parts > 0
        target[inside] = parts[inside] + (next_id - 1)
        next_id += n
    return _trace(pieces, transform, o.simplify_px)


def _fill_holes(blob: np.ndarray, max_area: int) -> np.ndarray:
    """``blob`` with its enclosed background regions of fewer than ``max_area`` pixels filled."""
    if max_area <= 0:
        return blob
    import cv2

    padded = np.pad(~blob, 1, constant_values=True).astype(np.uint8)
    count, labels, stats, _ = cv2.connectedComponentsWithStats(padded, connectivity=4)
    outside = labels[0, 0]
    small = (stats[:, cv2.CC_STAT_AREA] < max_area) & (np.arange(count) != outside)
    small[0] = False  # label 0 is the blob itself
    if not small.any():
        return blob
    return blob | small[labels[1:-1, 1:-1]]


def _reconstruct(marker: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Morphological reconstruction by dilation of ``marker`` under ``mask`` (float32)."""
    import cv2

    kernel = np.ones((3, 3), np.uint8)
    current = np.minimum(marker, mask)
    while True:
        grown = np.minimum(cv2.dilate(current, kernel), mask)
        if np.array_equal(grown, current):
            return current
        current = grown


def _split(blob: np.ndarray, split_px: float, split_ratio: float, min_area: int) -> np.ndarray:
    """Label image (int32, 0 = background, pieces 1..n) of one blob cut into buildings."""
    import cv2

    padded = np.pad(blob, 1).astype(np.uint8)
    dist = cv2.distanceTransform(padded, cv2.DIST_L2, cv2.DIST_MASK_PRECISE)
    peak = float(dist.max())
    depth = max(float(split_px), float(split_ratio) * peak)
    single = blob.astype(np.int32)
    if peak <= depth:  # too thin to hold two domes of that depth
        return single
    low = np.float32(-1e6)
    inside = padded.astype(bool)
    top = np.where(inside, dist, low).astype(np.float32)
    # h-maxima: the regional maxima of the reconstruction of (distance - depth) under distance
    rec = _reconstruct(np.where(inside, dist - depth, low).astype(np.float32), top)
    eps = np.float32(0.01)
    below = _reconstruct(np.where(inside, rec - eps, low).astype(np.float32), rec)
    domes = inside & (rec - below >= eps / 2)
    n_markers, markers = cv2.connectedComponents(domes.astype(np.uint8), connectivity=8)
    if n_markers <= 2:  # background plus a single dome
        return single
    parts = _flood(markers.astype(np.int32), dist, inside)
    parts = _fill_unassigned(parts, inside)
    parts = _merge_small(parts, int(min_area))
    return parts[1:-1, 1:-1]


def _flood(markers: np.ndarray, dist: np.ndarray, inside: np.ndarray) -> np.ndarray:
    """Grow the markers over the blob from the highest distance down (a watershed by levels):
    at each one-pixel level, every marker spreads into the unlabelled pixels at or above the
    level that it reaches; where two meet, the higher label takes the tie."""
    import cv2

    kernel = np.ones((3, 3), np.uint8)
    parts = np.where(inside, markers, 0).astype(np.int32)
    for level in np.arange(np.floor(float(dist.max())), -1.0, -1.0):
        allowed = inside & (dist >= level)
        while True:
            todo = allowed & (parts == 0)
            if not todo.any():
                break
            grown = cv2.dilate(parts.astype(np.float32), kernel).astype(np.int32)
            new = todo & (grown > 0)
            if not new.any():
                break
            parts[new] = grown[new]
    return parts


def _fill_unassigned(parts: np.ndarray, inside: np.ndarray) -> np.ndarray:
    """Give every blob pixel that the watershed left on a boundary the largest neighbouring label."""
    import cv2

    kernel = np.ones((3, 3), np.uint8)
    for _ in range(max(parts.shape)):
        todo = inside & (parts == 0)
        if not todo.any():
            break
        grown = cv2.dilate(parts.astype(np.float32), kernel).astype(np.int32)
        parts = np.where(todo, grown, parts)
    return parts


def _merge_small(parts: np.ndarray, min_area: int) -> np.ndarray:
    """Relabel pieces under ``min_area`` pixels as their most common neighbour; then 1..n."""
    import cv2

    kernel = np.ones((3, 3), np.uint8)
    changed = True
    while changed:
        changed = False
        ids, areas = np.unique(parts[parts > 0], return_counts=True)
        if len(ids) <= 1:
            break
        for i, area in sorted(zip(ids.tolist(), areas.tolist(), strict=True), key=lambda t: t[1]):
            if area >= max(min_area, 1):
                break
            piece = parts == i
            ring = cv2.dilate(piece.astype(np.uint8), kernel).astype(bool) & ~piece & (parts > 0)
            if not ring.any():
                continue
            neighbours = np.bincount(parts[ring])
            parts[piece] = int(neighbours.argmax())
            changed = True
            break
    ids = np.unique(parts[parts > 0])
    lookup = np.zeros(int(parts.max()) + 1, np.int32)
    lookup[ids] = np.arange(1, len(ids) + 1, dtype=np.int32)
    return lookup[parts]


def _trace(pieces: np.ndarray, transform, simplify_px: float) -> list:
    """One polygon per label of ``pieces`` (pixel-edge outlines), simplified and transformed."""
    import shapely
    from rasterio.features import shapes
    from shapely import affinity
    from shapely.geometry import shape

    if not pieces.any():
        return []
    found: dict[int, list] = {}
    for geom, value in shapes(pieces, mask=pieces > 0, connectivity=4):
        found.setdefault(int(value), []).append(shape(geom))
    polygons = []
    for value in sorted(found):
        parts = found[value]
        poly = parts[0] if len(parts) == 1 else shapely.union_all(parts)
        if poly.geom_type == "MultiPolygon":  # pieces joined only at a corner: keep the largest
            poly = max(poly.geoms, key=lambda g: g.area)
        if simplify_px > 0:
            poly = poly.simplify(float(simplify_px), preserve_topology=True)
        if poly.is_empty:
            continue
        polygons.append(poly)
    if transform is not None:
        t = transform
        matrix = [t.a, t.b, t.d, t.e, t.c, t.f]
        polygons = [affinity.affine_transform(p, matrix) for p in polygons]
    return polygons
