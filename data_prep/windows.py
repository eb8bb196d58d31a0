"""Window arithmetic for chips: pure functions on pixel coordinates, no I/O."""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import numpy as np

from data_prep.spec import ChipSpec


class ChipWindow(NamedTuple):
    """An integer square window in pixel coordinates (may extend beyond the image)."""

    col_off: int
    row_off: int
    size: int


class Footprint(Protocol):
    """What :func:`building_window` needs of a building (e.g. the xBD
    :class:`~data_prep.xbd_tiles.Building`): its centroid and bounds in pixel coordinates."""

    @property
    def centroid(self) -> tuple[float, float]:
        """(x, y) footprint centroid (x = column, y = row)."""
        ...

    @property
    def bbox(self) -> tuple[float, float, float, float]:
        """(minx, miny, maxx, maxy) footprint bounds."""
        ...


class BuildingCut(NamedTuple):
    """One building's window and its pre and post chips, as cut by :func:`cut_building`."""

    window: ChipWindow
    pre: np.ndarray
    post: np.ndarray


def chip_window(
    centroid: tuple[float, float], bbox: tuple[float, float, float, float], spec: ChipSpec
) -> ChipWindow:
    """The square window for one building.

    Args:
        centroid: (x, y) footprint centroid in pixel coordinates (x = column, y = row).
        bbox: (minx, miny, maxx, maxy) footprint bounds in pixel coordinates.
        spec: the chip specification.

    Returns:
        A window of side ``ceil(max(min_size, context * longest side))`` whose centre is within
        half a pixel of the centroid.
    """
    minx, miny, maxx, maxy = bbox
    longest = max(maxx - minx, maxy - miny, 0.0)
    size = max(int(spec.min_size), int(math.ceil(spec.context * longest)), 1)
    cx, cy = centroid
    col_off = int(math.floor(cx - size / 2.0 + 0.5))
    row_off = int(math.floor(cy - size / 2.0 + 0.5))
    return ChipWindow(col_off, row_off, size)


def window_overlap(
    window: ChipWindow, height: int, width: int
) -> tuple[slice, slice, slice, slice]:
    """Where a window meets an image of ``height`` x ``width``.

    Returns ``(src_rows, src_cols, dst_rows, dst_cols)`` slices: ``image[src_rows, src_cols]``
    goes to ``chip[dst_rows, dst_cols]`` of a ``size`` x ``size`` chip. The slices are empty when
    the window misses the image.
    """
    r0 = max(window.row_off, 0)
    c0 = max(window.col_off, 0)
    r1 = min(window.row_off + window.size, height)
    c1 = min(window.col_off + window.size, width)
    if r1 <= r0 or c1 <= c0:
        empty = slice(0, 0)
        return empty, empty, empty, empty
    return (
        slice(r0, r1),
        slice(c0, c1),
        slice(r0 - window.row_off, r1 - window.row_off),
        slice(c0 - window.col_off, c1 - window.col_off),
    )


def crop_boundless(image: np.ndarray, window: ChipWindow, fill: int = 0) -> np.ndarray:
    """Cut ``window`` from an [H, W, C] image, filling with ``fill`` beyond its edges."""
    height, width = image.shape[:2]
    out = np.full((window.size, window.size, *image.shape[2:]), fill, dtype=image.dtype)
    src_r, src_c, dst_r, dst_c = window_overlap(window, height, width)
    out[dst_r, dst_c] = image[src_r, src_c]
    return out


def resize_chip(chip: np.ndarray, chip_size: int, out: np.ndarray | None = None) -> np.ndarray:
    """Resample an [S, S, C] uint8 chip to ``chip_size`` x ``chip_size``, without aliasing.

    - Enlarging, or shrinking by less than 2x: bilinear (below 2x every source pixel still
      contributes to the output).
    - Shrinking by 2x or more: bilinear to the nearest smaller integer multiple ``k * chip_size``
      (a ratio below 2), then area averaging by the integer factor ``k``. This matches plain area
      resampling to within a few grey levels at a fraction of its cost: OpenCV's area resampling
      at a non-integer ratio is about 5x slower than either step.

    ``out``: a C-contiguous uint8 [chip_size, chip_size, C] array to write the result into (and
    return) instead of a new one, e.g. one row of a batch of chips.
    """
    import cv2

    size = chip.shape[0]
    if size == chip_size and chip.shape[1] == chip_size:
        if out is None:
            return np.ascontiguousarray(chip)
        out[...] = chip
        return out
    factor = size // chip_size
    if factor < 2:
        return cv2.resize(chip, (chip_size, chip_size), dst=out, interpolation=cv2.INTER_LINEAR)
    if size != factor * chip_size:
        side = factor * chip_size
        chip = cv2.resize(chip, (side, side), interpolation=cv2.INTER_LINEAR)
    return cv2.resize(chip, (chip_size, chip_size), dst=out, interpolation=cv2.INTER_AREA)


def cut_chip(
    image: np.ndarray, window: ChipWindow, chip_size: int, out: np.ndarray | None = None
) -> np.ndarray:
    """One chip of the chip contract: ``window`` cut from an [H, W, 3] image, zero past its
    edges (:func:`crop_boundless`; a view when the window lies inside), resampled to
    ``chip_size`` by :func:`resize_chip` (into ``out`` when given)."""
    height, width = image.shape[:2]
    c0, r0, size = window
    if c0 >= 0 and r0 >= 0 and c0 + size <= width and r0 + size <= height:
        crop = image[r0 : r0 + size, c0 : c0 + size]
    else:
        crop = crop_boundless(image, window)
    return resize_chip(crop, chip_size, out=out)


def cut_pair(
    pre: np.ndarray,
    post: np.ndarray,
    window: ChipWindow,
    chip_size: int,
    out: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The pre and post chips of one building: the same ``window`` from both images, cut and
    resampled by :func:`cut_chip` (into the two arrays of ``out`` when given). Training,
    evaluation and every scoring path cut chips with this function, so what a model sees in
    service is what it saw in training."""
    pre_out, post_out = out if out is not None else (None, None)
    return cut_chip(pre, window, chip_size, out=pre_out), cut_chip(
        post, window, chip_size, out=post_out
    )


def outside_image(bbox: tuple[float, float, float, float], height: int, width: int) -> bool:
    """Whether footprint bounds ``(minx, miny, maxx, maxy)`` lie entirely outside an image of
    ``height`` x ``width`` pixels (touching its edge from outside counts as outside)."""
    minx, miny, maxx, maxy = bbox
    return maxx <= 0 or maxy <= 0 or minx >= width or miny >= height


def building_window(
    building: Footprint, spec: ChipSpec, height: int, width: int
) -> ChipWindow | None:
    """The chip window of one building of an image of ``height`` x ``width`` pixels.

    Returns:
        :func:`chip_window` of the building's centroid and bounds, or None when its bounds lie
        entirely outside the image (:func:`outside_image`): a building the image does not cover.
    """
    if outside_image(building.bbox, height, width):
        return None
    return chip_window(building.centroid, building.bbox, spec)


def cut_building(
    pre: np.ndarray,
    post: np.ndarray,
    building: Footprint,
    spec: ChipSpec,
    out: tuple[np.ndarray, np.ndarray] | None = None,
    *,
    keep_outside: bool = False,
) -> BuildingCut | None:
    """Cut one building's chips from an aligned pre/post image pair: the building to a window
    (:func:`building_window`), then the same window from both images (:func:`cut_pair`). Every
    path that cuts the buildings of an xBD-style tile does it with this function.

    Args:
        pre, post: [H, W, 3] uint8 images of the same size.
        building: anything with pixel ``centroid`` and ``bbox``, e.g. an xBD ``Building``.
        spec: the chip specification.
        out: two C-contiguous uint8 [chip_size, chip_size, 3] arrays to write the pre and post
            chips into (e.g. rows of preallocated batches) instead of new ones.
        keep_outside: cut the window even when the building lies entirely outside the images
            (the chips are then mostly or wholly zero fill) instead of returning None.

    Returns:
        ``(window, pre_chip, post_chip)``, or None when the building lies entirely outside the
        images and ``keep_outside`` is false.
    """
    if keep_outside:
        window: ChipWindow | None = chip_window(building.centroid, building.bbox, spec)
    else:
        window = building_window(building, spec, *pre.shape[:2])
    if window is None:
        return None
    pre_chip, post_chip = cut_pair(pre, post, window, spec.chip_size, out=out)
    return BuildingCut(window, pre_chip, post_chip)


def covered_fraction(window: ChipWindow, height: int, width: int) -> float:
    """Fraction of the window's area that lies inside an image of ``height`` x ``width``."""
    src_r, src_c, _, _ = window_overlap(window, height, width)
    inside = (src_r.stop - src_r.start) * (src_c.stop - src_c.start)
    return inside / float(window.size * window.size)
