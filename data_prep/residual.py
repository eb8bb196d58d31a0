"""A building's own pre/post shift, left after the scene's shift is corrected (no torch).

The scene correction (:mod:`data_prep.alignment`) moves the whole post image; what it leaves is
measured building by building, by template matching (OpenCV ``matchTemplate``,
``TM_CCOEFF_NORMED``, grey images) of the centre of a pre window over the post window of the
same place, sub-pixel by a parabola through the peak. Two windows are measured:

- **Context** (:func:`context_shift`, what scoring uses): a :data:`CONTEXT_SIDE` px square of the
  source imagery centred on the building, matched at half resolution within
  :data:`CONTEXT_SEARCH` px. The ground, roads and neighbours around a building line up or not
  whatever happened to the building itself, so this tells a misregistered post image from a
  changed building. The shift counts when its peak is inside the search range and its
  correlation at least :data:`CONTEXT_MIN_NCC`; otherwise there is no measurement.
- **Chip** (:func:`chip_shift`, :func:`residual_shift`): the chip pair alone, for callers that
  have no imagery around it (the app's chip mode). The centre of the pre chip is matched over
  the post chip within :data:`CHIP_SEARCH` of its side, and the shift counts only when the match
  is good (peak correlation at least :data:`CHIP_MIN_NCC`), beats no shift clearly (by
  :data:`CHIP_MIN_GAIN`) and is not on the edge of the search range. A chip is mostly the
  building, whose parallax and damage move it anyway, so this catches only large, unambiguous
  shifts.

``runtime.flags`` flags ``misaligned`` above ``runtime.flags.MISALIGNED_CONTEXT_PX`` (context) or
``runtime.flags.MISALIGNED_PX`` (chip). Both limits were chosen on real xBD tiles and measured on
held-out ones (``local-damage bench alignment``, docs/flags.md). Sign convention as in
:mod:`data_prep.alignment`: the post image shows at ``(x + dx, y + dy)`` what the pre image shows
at ``(x, y)``. (google-research/skai likewise template-matches each building's pre image inside
a larger post image.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from data_prep.alignment import gray
from data_prep.windows import ChipWindow

#: Side in source pixels of the window around a building in which its shift is measured.
CONTEXT_SIDE = 512
#: Largest shift looked for in that window (source pixels).
CONTEXT_SEARCH = 24
#: The window is matched after area averaging by this factor.
CONTEXT_FACTOR = 2
#: Gaussian blur (pixels, after averaging) of the window before matching.
CONTEXT_BLUR = 0.5
#: Least peak correlation for the shift of a building's context to be measured: above 95% of
#: the peaks of windows from two unrelated xBD tiles (median 0.05, 95th percentile 0.16, 99th
#: 0.23), while 98% of the real pairs of folds 0, 2, 3 and 4 are measured (docs/flags.md).
CONTEXT_MIN_NCC = 0.2

#: Search range of a chip pair's shift, as a fraction of the chip side (16 px on 128 px chips).
CHIP_SEARCH = 0.125
#: Gaussian blur (pixels) of chip grey images before matching.
CHIP_BLUR = 1.0
#: Least peak correlation for a chip pair's shift to be measured.
CHIP_MIN_NCC = 0.3
#: Least gain in correlation of the best shift over no shift for it to be measured.
CHIP_MIN_GAIN = 0.2


@dataclass(frozen=True)
class ChipShift:
    """A pair's shift (pixels, post relative to pre) and the match behind it.

    Attributes:
        dx, dy: the best shift within the search range.
        ncc: normalised cross-correlation at that shift (-1..1).
        ncc_zero: normalised cross-correlation at no shift.
        search_px: the search range; a peak on its edge is not a measurement.
    """

    dx: float
    dy: float
    ncc: float
    ncc_zero: float
    search_px: float = math.inf

    @property
    def length(self) -> float:
        return float(math.hypot(self.dx, self.dy))

    @property
    def inside(self) -> bool:
        """Whether the peak lies inside the search range (not on its edge)."""
        return max(abs(self.dx), abs(self.dy)) < self.search_px - 0.5

    @property
    def measurable(self) -> bool:
        """Whether a chip match is good, clearly better than no shift, and not on the edge of
        the search range (see the module docstring)."""
        return (
            self.inside and self.ncc >= CHIP_MIN_NCC and self.ncc - self.ncc_zero >= CHIP_MIN_GAIN
        )


def _parabola(m: np.ndarray, x: int, y: int) -> tuple[float, float]:
    def vertex(a: float, b: float, c: float) -> float:
        d = a - 2 * b + c
        return 0.0 if d >= 0 else float(np.clip(0.5 * (a - c) / d, -0.5, 0.5))

    h, w = m.shape
    ox = vertex(m[y, x - 1], m[y, x], m[y, x + 1]) if 0 < x < w - 1 else 0.0
    oy = vertex(m[y - 1, x], m[y, x], m[y + 1, x]) if 0 < y < h - 1 else 0.0
    return x + ox, y + oy


def _match(a: np.ndarray, b: np.ndarray, r: int) -> tuple[float, float, float, float] | None:
    """Best ``(dx, dy, ncc, ncc_zero)`` of the centre of ``a`` (less ``r`` on every edge) over
    ``b``, in pixels of these images; None when either is flat."""
    import cv2

    h, w = a.shape
    template = a[r : h - r, r : w - r]
    if float(template.std()) < 1e-3 or float(b.std()) < 1e-3:
        return None
    m = cv2.matchTemplate(b, template, cv2.TM_CCOEFF_NORMED)
    m = np.nan_to_num(m, nan=-1.0, posinf=-1.0, neginf=-1.0)
    _, peak, _, (x, y) = cv2.minMaxLoc(m)
    fx, fy = _parabola(m, x, y)
    return fx - r, fy - r, float(peak), float(m[r, r])


def _check_pair(a: np.ndarray, b: np.ndarray, what: str) -> None:
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"pre and post {what} must have one 2-D shape, got {a.shape}, {b.shape}")


def _luma(image: np.ndarray) -> np.ndarray:
    """float32 ``[H, W]`` Rec. 601 luma of a uint8 RGB image by OpenCV (rounded to whole grey
    levels, about 20 times faster than :func:`data_prep.alignment.gray` on a 512 px window), or
    :func:`data_prep.alignment.gray` of anything else."""
    import cv2

    if image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3:
        return cv2.cvtColor(image, cv2.COLOR_RGB2GRAY).astype(np.float32)
    return gray(image)


def chip_shift(pre: np.ndarray, post: np.ndarray, search: float = CHIP_SEARCH) -> ChipShift:
    """The shift of a post chip relative to its pre chip, by template matching.

    The pre chip's centre (the chip less ``search * side`` on every edge) is matched over the
    whole post chip with ``TM_CCOEFF_NORMED`` on blurred grey images.

    Args:
        pre, post: uint8 ``[S, S, 3]`` chips (or grey ``[S, S]``) of one size.
        search: the largest shift looked for, as a fraction of the chip side.

    Returns:
        The :class:`ChipShift` in chip pixels; flat chips give a zero shift with correlation 0.
    """
    import cv2

    a, b = gray(pre), gray(post)
    _check_pair(a, b, "chips")
    if CHIP_BLUR > 0:
        a = cv2.GaussianBlur(a, (0, 0), CHIP_BLUR)
        b = cv2.GaussianBlur(b, (0, 0), CHIP_BLUR)
    r = max(1, int(round(search * min(a.shape))))
    found = _match(a, b, r)
    if found is None:
        return ChipShift(0.0, 0.0, 0.0, 0.0)
    dx, dy, peak, zero = found
    return ChipShift(float(dx), float(dy), peak, zero, float(r))


def residual_shift(pre: np.ndarray, post: np.ndarray) -> float | None:
    """Length in chip pixels of a chip pair's own pre/post shift, or None when it cannot be
    measured with confidence (:attr:`ChipShift.measurable`). The chip-only ``misaligned``
    measurement of ``runtime.flags``."""
    s = chip_shift(pre, post)
    return s.length if s.measurable else None


def context_window(
    centre: tuple[float, float], side: int = CONTEXT_SIDE, within: tuple[int, int] | None = None
) -> ChipWindow:
    """The ``side`` px square of source pixels centred on ``centre`` (column, row), moved to
    lie inside an image of ``within`` = ``(height, width)`` pixels where it fits (zero fill in
    a window would pull the match towards no shift)."""
    side = int(side)
    col = int(math.floor(centre[0] - side / 2))
    row = int(math.floor(centre[1] - side / 2))
    if within is not None:
        height, width = within
        if width >= side:
            col = min(max(col, 0), width - side)
        if height >= side:
            row = min(max(row, 0), height - side)
    return ChipWindow(col, row, side)


def context_shift(
    pre: np.ndarray,
    post: np.ndarray,
    search: int = CONTEXT_SEARCH,
    factor: int = CONTEXT_FACTOR,
) -> ChipShift:
    """The shift of a post window relative to the pre window of the same place.

    Both are averaged down by ``factor``, blurred, and the pre window less ``search`` px on every
    edge is matched over the post window.

    Args:
        pre, post: uint8 ``[S, S, 3]`` (or grey) windows of one size, cut from the pre image and
            the corrected post image (pixels without data are best set to the window's mean
            first, as :func:`context_residual` does).
        search: the largest shift looked for, in source pixels.
        factor: the averaging factor (1: full resolution).

    Returns:
        The :class:`ChipShift` in source pixels (``search_px`` = ``search``); flat windows give
        a zero shift with correlation 0.
    """
    import cv2

    a, b = _luma(pre), _luma(post)
    _check_pair(a, b, "windows")
    factor = max(int(factor), 1)
    if factor > 1:
        size = (a.shape[1] // factor, a.shape[0] // factor)
        a = cv2.resize(a, size, interpolation=cv2.INTER_AREA)
        b = cv2.resize(b, size, interpolation=cv2.INTER_AREA)
    if CONTEXT_BLUR > 0:
        a = cv2.GaussianBlur(a, (0, 0), CONTEXT_BLUR)
        b = cv2.GaussianBlur(b, (0, 0), CONTEXT_BLUR)
    r = max(1, int(search) // factor)
    if min(a.shape) <= 2 * r + 4:
        raise ValueError(f"windows of {pre.shape[:2]} px are too small for a {search} px search")
    found = _match(a, b, r)
    if found is None:
        return ChipShift(0.0, 0.0, 0.0, 0.0, float(search))
    dx, dy, peak, zero = found
    return ChipShift(float(dx * factor), float(dy * factor), peak, zero, float(r * factor))


def _fill_mean(window: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """A copy of a uint8 window with its pixels outside ``valid`` set to the mean of the others."""
    import cv2

    mask = valid.astype(np.uint8)
    mean = cv2.mean(window, mask=mask)[: window.shape[2] if window.ndim == 3 else 1]
    out = np.empty_like(window)
    out[...] = np.round(mean).astype(window.dtype) if window.ndim == 3 else round(mean[0])
    cv2.copyTo(window, mask, out)
    return out


def context_residual(pre: np.ndarray, post: np.ndarray, valid: np.ndarray | None = None) -> float:
    """Length in source pixels of the shift of a building's context windows
    (:func:`context_shift`), NaN when its peak is on the edge of the search range or its
    correlation is under :data:`CONTEXT_MIN_NCC` (no measurement: the windows do not match at
    any shift). The ``misaligned`` measurement of scoring.

    ``valid``: bool ``[S, S]``, where both windows hold imagery; elsewhere each window is filled
    with the mean of its valid pixels before matching, which adds nothing to the correlation, so
    that neither the edge of one image's coverage nor a fill common to both is taken for (or
    against) a shift. A window with no valid pixel is no measurement.
    """
    if valid is not None and not valid.all():
        if not valid.any():
            return math.nan
        pre, post = _fill_mean(pre, valid), _fill_mean(post, valid)
    s = context_shift(pre, post)
    return s.length if s.inside and s.ncc >= CONTEXT_MIN_NCC else math.nan


def image_context_residual(
    pre_img: np.ndarray,
    post_img: np.ndarray,
    centre: tuple[float, float],
    side: int = 0,
    valid: np.ndarray | None = None,
) -> float:
    """:func:`context_residual` of the windows around ``centre`` (column, row) of a pre image
    and its corrected post image of one grid (:func:`context_window`: kept inside the images
    where they are large enough); the windows are :data:`CONTEXT_SIDE` px, or ``side`` (a large
    building's chip window) when larger. What lies past the images' edges, or outside ``valid``
    (bool ``[H, W]``: where both images hold data), is left out of the match."""
    from data_prep.windows import crop_boundless, window_overlap

    w = context_window(centre, max(CONTEXT_SIDE, int(side)), pre_img.shape[:2])
    if valid is not None:
        mask = crop_boundless(valid, w)  # False past the edges
    else:
        mask = np.zeros((w.size, w.size), dtype=bool)
        _, _, dst_r, dst_c = window_overlap(w, *pre_img.shape[:2])
        mask[dst_r, dst_c] = True
    return context_residual(crop_boundless(pre_img, w), crop_boundless(post_img, w), mask)
