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
  correlation at least :data:`CONTEXT_MIN_NCC`; otherwise there is no measurement. Scoring
  measures the buildings of one read together (:class:`ReadContext`), each first at a quarter of
  the resolution (:data:`COARSE_FACTOR`) and again in full wherever it may be flagged.
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

import numpy as np

from data_prep.registration import (
    CONTEXT_MIN_NCC,
    ChipShift,
    check_pair,
    context_blur,
    context_shift,
    gray,
    grey_context_shift,
    match_template,
    reduce,
    reduced_context_shift,
)
from data_prep.windows import ChipWindow, crop_boundless, window_overlap

#: Side in source pixels of the window around a building in which its shift is measured.
CONTEXT_SIDE = 512

#: ``misaligned`` when the residual shift measured on the imagery around a building exceeds this
#: many source pixels (``runtime.flags.MISALIGNED_CONTEXT_PX``, docs/flags.md); a
#: :class:`ReadContext` measures at full precision wherever a value could fall on either side.
CONTEXT_LIMIT_PX = 6.0

#: :class:`ReadContext` first matches a building's windows at this averaging factor (a quarter
#: of :data:`data_prep.registration.CONTEXT_FACTOR`'s pixels: about a quarter of the cost). Its
#: value stands when it settles that the building is not misaligned: a peak inside the search
#: range with correlation at least :data:`COARSE_MIN_NCC`, at least :data:`COARSE_MARGIN_PX` under
#: the limit; any other window (one that may be flagged, or whose coarse match is unclear) is
#: matched again as :func:`context_residual` does. Chosen on every labelled xBD tile (58 tiles,
#: 2,856 windows, each also with its post image moved by 4 to 26 px in a random direction): 78%
#: of the windows of the tiles as they are settle on the coarse match, and no window settled so is
#: over the limit in the full measurement (the largest: 5.7 px); the coarse and full values differ
#: by 0.29 px in the median, 1.1 px at the 99th percentile. Values over the limit always come
#: from the full match: a coarse match of low correlation can put its peak far off (17 px on a
#: Joplin building whose full measurement is 1.5 px).
COARSE_FACTOR = 4
#: Least peak correlation of the coarse match for its value to stand.
COARSE_MIN_NCC = 0.25
#: Least distance in source pixels of a coarse value under the limit for it to stand.
COARSE_MARGIN_PX = 2.0

#: Search range of a chip pair's shift, as a fraction of the chip side (16 px on 128 px chips).
CHIP_SEARCH = 0.125
#: Gaussian blur (pixels) of chip grey images before matching.
CHIP_BLUR = 1.0


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
    check_pair(a, b, "chips")
    if CHIP_BLUR > 0:
        a = cv2.GaussianBlur(a, (0, 0), CHIP_BLUR)
        b = cv2.GaussianBlur(b, (0, 0), CHIP_BLUR)
    r = max(1, int(round(search * min(a.shape))))
    found = match_template(a, b, r)
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
    w = context_window(centre, max(CONTEXT_SIDE, int(side)), pre_img.shape[:2])
    if valid is not None:
        mask = crop_boundless(valid, w)  # False past the edges
    else:
        mask = np.zeros((w.size, w.size), dtype=bool)
        _, _, dst_r, dst_c = window_overlap(w, *pre_img.shape[:2])
        mask[dst_r, dst_c] = True
    return context_residual(crop_boundless(pre_img, w), crop_boundless(post_img, w), mask)


class ReadContext:
    """:func:`image_context_residual` of many buildings of one read, sharing the work.

    The buildings of one read (a block of the scene, :func:`data_prep.scene.cut_reads`) are
    measured on windows of the same two images: their grey images are converted once for the
    whole read, a window that lies entirely in valid imagery is cut from them as it is, one with
    pixels outside ``valid`` gets its fill (the mean colour of its valid pixels, as
    :func:`context_residual`) in grey, and buildings whose windows coincide share one match.

    Each window is first matched at :data:`COARSE_FACTOR` (a window inside valid imagery is cut
    from grey images averaged down once for the whole read, snapped to the nearest multiple of the
    factor); where that match settles that the shift is clearly under ``limit`` (see
    :data:`COARSE_FACTOR`) its value is returned, otherwise
    the value of :func:`image_context_residual` of the same arguments, bit for bit (the same
    window, fill and grey pixels go into the same match). So every value over ``limit`` minus
    :data:`COARSE_MARGIN_PX`, and every NaN, is :func:`image_context_residual`'s, and a value
    under it stands for one that is not over ``limit``; the tests hold it to that on real tiles.

    Args:
        pre_img, post_img: uint8 ``[H, W, 3]`` pre image and corrected post image of one grid.
        valid: bool ``[H, W]``, where both hold data (None: everywhere inside the images).
        limit: the ``misaligned`` limit in source pixels the values are exact around (None:
            every value measured in full, as :func:`image_context_residual`).
    """

    def __init__(
        self,
        pre_img: np.ndarray,
        post_img: np.ndarray,
        valid: np.ndarray | None = None,
        limit: float | None = CONTEXT_LIMIT_PX,
    ):
        import cv2

        if pre_img.shape != post_img.shape or pre_img.ndim != 3 or pre_img.shape[2] != 3:
            raise ValueError(
                f"pre and post images must be one [H, W, 3] shape, got {pre_img.shape}, "
                f"{post_img.shape}"
            )
        self.pre_img, self.post_img = pre_img, post_img
        self.shape = pre_img.shape[:2]
        # a read valid throughout (the common case) needs no look at each window's pixels
        self.valid = None if valid is not None and valid.all() else valid
        self.limit = limit
        self.pre_grey = cv2.cvtColor(np.ascontiguousarray(pre_img), cv2.COLOR_RGB2GRAY)
        self.post_grey = cv2.cvtColor(np.ascontiguousarray(post_img), cv2.COLOR_RGB2GRAY)
        self._done: dict[tuple[int, int, int], float] = {}
        self._fills: dict[tuple[int, int, int, int], tuple[int, int]] = {}
        self._bufs: tuple[np.ndarray, np.ndarray] | None = None
        self._coarse: tuple[np.ndarray, np.ndarray] | None = None

    def residual(self, centre: tuple[float, float], side: int = 0) -> float:
        """:func:`image_context_residual` ``(pre_img, post_img, centre, side, valid)``."""
        w = context_window(centre, max(CONTEXT_SIDE, int(side)), self.shape)
        key = (w.col_off, w.row_off, w.size)
        if key not in self._done:
            self._done[key] = self._measure(w)
        return self._done[key]

    def _measure(self, w: ChipWindow) -> float:
        height, width = self.shape
        c, r, n = w.col_off, w.row_off, w.size
        if c >= 0 and r >= 0 and c + n <= width and r + n <= height:
            inside = (slice(r, r + n), slice(c, c + n))
            if self.valid is None or self.valid[inside].all():  # no fill: the pixels as they are
                coarse = self._coarse_shift(c, r, n)
                if coarse is not None:
                    return coarse
                a, b = self._buffers(n)
                np.copyto(a, self.pre_grey[inside], casting="unsafe")
                np.copyto(b, self.post_grey[inside], casting="unsafe")
                return self._shift(a, b, n, coarse=False)
        # the window with its fill: cut from the overlap with the images, no padded copies
        src_r, src_c, dst_r, dst_c = window_overlap(w, height, width)
        src, dst = (src_r, src_c), (dst_r, dst_c)
        inner = None if self.valid is None else self.valid[src]
        if src_r.stop <= src_r.start or (inner is not None and not inner.any()):
            return math.nan
        # windows that meet the images in the same pixels share their fill (on a read smaller
        # than the window, every window meets all of it)
        key = (src_r.start, src_r.stop, src_c.start, src_c.stop)
        fills = self._fills.get(key)
        if fills is None:
            mask = inner
            if mask is None:
                mask = np.ones((src_r.stop - src_r.start, src_c.stop - src_c.start), bool)
            fills = self._fills[key] = (
                _fill_grey(self.pre_img[src], mask),
                _fill_grey(self.post_img[src], mask),
            )
        a, b = self._buffers(n)
        _filled(a, fills[0], self.pre_grey, src, dst, inner)
        _filled(b, fills[1], self.post_grey, src, dst, inner)
        return self._shift(a, b, n)

    def _buffers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Two float32 ``[n, n]`` windows, reused from building to building (a fresh megabyte
        per window costs more in page faults than the copy into it)."""
        if self._bufs is None or self._bufs[0].shape[0] != n:
            self._bufs = (np.empty((n, n), np.float32), np.empty((n, n), np.float32))
        return self._bufs

    def _coarse_shift(self, c: int, r: int, n: int) -> float | None:
        """The coarse match of the window at ``(c, r)`` of side ``n`` where it settles the
        building (see :meth:`_shift`), cut from the grey images averaged down and blurred once
        for the whole read: the window snapped to the nearest multiple of :data:`COARSE_FACTOR`
        pixels (at most 2 px away), whose averaged pixels are those of the window averaged on
        its own (the blur near its edges sees the imagery beyond them, not a reflection). None
        where it does not settle, or without a limit."""
        if self.limit is None:
            return None
        f = COARSE_FACTOR
        if self._coarse is None:
            height, width = (v - v % f for v in self.shape)
            self._coarse = tuple(
                context_blur(reduce(grey[:height, :width].astype(np.float32), f))
                for grey in (self.pre_grey, self.post_grey)
            )
        qc, qr, qn = int(round(c / f)), int(round(r / f)), n // f
        q_pre, q_post = self._coarse
        if qc + qn > q_pre.shape[1] or qr + qn > q_pre.shape[0]:
            return None
        cut = (slice(qr, qr + qn), slice(qc, qc + qn))
        s = reduced_context_shift(q_pre[cut], q_post[cut], factor=f, shape=(n, n), blurred=True)
        return s.length if self._settles(s) else None

    def _settles(self, s: ChipShift) -> bool:
        """Whether a coarse match settles that the building is not misaligned."""
        return s.inside and s.ncc >= COARSE_MIN_NCC and s.length <= self.limit - COARSE_MARGIN_PX

    def _shift(self, a: np.ndarray, b: np.ndarray, side: int, coarse: bool = True) -> float:
        if self.limit is not None and coarse:
            s = grey_context_shift(a, b, factor=COARSE_FACTOR, shape=(side, side))
            if self._settles(s):
                return s.length
        s = grey_context_shift(a, b, shape=(side, side))
        return s.length if s.inside and s.ncc >= CONTEXT_MIN_NCC else math.nan


def _fill_grey(window: np.ndarray, valid: np.ndarray) -> int:
    """The grey level of the fill :func:`_fill_mean` gives a uint8 RGB window's invalid pixels."""
    import cv2

    mean = cv2.mean(window, mask=valid.view(np.uint8))[:3]  # bool as 0/1 bytes, no copy
    colour = np.round(mean).astype(window.dtype).reshape(1, 1, 3)
    return int(cv2.cvtColor(colour, cv2.COLOR_RGB2GRAY)[0, 0])


def _filled(
    out: np.ndarray,
    fill: int,
    grey: np.ndarray,
    src: tuple[slice, slice],
    dst: tuple[slice, slice],
    inner: np.ndarray | None,
) -> np.ndarray:
    """Write into float32 ``out`` (``[n, n]``) the grey window whose pixels ``grey[src]`` land
    at ``dst``, every pixel past the image's edges or outside ``inner`` (the valid pixels of
    ``src``; None: all of them) set to ``fill`` (:func:`_fill_grey` of the valid colour pixels):
    the values of the window cut boundless and filled as :func:`image_context_residual` does,
    without cutting the colour and validity windows out of the images."""
    out.fill(fill)
    if inner is None:
        out[dst] = grey[src]
    else:
        np.copyto(out[dst], grey[src], casting="unsafe", where=inner)
    return out
