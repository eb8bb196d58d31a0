"""How far one image is shifted from another: the primitives the scene alignment
(:mod:`data_prep.alignment`) and a building's residual shift (:mod:`data_prep.residual`) share.

Grey conversion, and template matching (OpenCV ``matchTemplate``, ``TM_CCOEFF_NORMED``) of the
centre of a pre window over the post window of the same place, sub-pixel by a parabola through
the peak (:func:`context_shift`). Sign convention: the post image shows at ``(x + dx, y + dy)``
what the pre image shows at ``(x, y)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def gray(rgb: np.ndarray) -> np.ndarray:
    """float32 ``[H, W]`` Rec. 601 luma (0-255) of a uint8 ``[H, W, 3]`` RGB image (or a grey
    ``[H, W]`` image as float32)."""
    a = np.asarray(rgb, dtype=np.float32)
    if a.ndim == 2:
        return a
    return 0.299 * a[..., 0] + 0.587 * a[..., 1] + 0.114 * a[..., 2]


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
        # min and max on the scalars: np.clip's value, at a tenth of its cost
        return 0.0 if d >= 0 else float(max(-0.5, min(0.5, 0.5 * (a - c) / d)))

    h, w = m.shape
    ox = vertex(m[y, x - 1], m[y, x], m[y, x + 1]) if 0 < x < w - 1 else 0.0
    oy = vertex(m[y - 1, x], m[y, x], m[y + 1, x]) if 0 < y < h - 1 else 0.0
    return x + ox, y + oy


#: Standard deviation under which an image counts as flat (nothing to match).
FLAT_STD = 1e-3
#: Largest image whose flatness its value range can settle (see :func:`_flat`).
_RANGE_PIXELS = 250_000


def _flat(image: np.ndarray) -> bool:
    """Whether an image's standard deviation is under :data:`FLAT_STD`.

    The standard deviation of ``n`` values spanning ``s`` is at least ``s / sqrt(2 n)``, over
    ``1.4 * FLAT_STD`` when they span more than one grey level and ``n`` is under
    :data:`_RANGE_PIXELS`: such an image is not flat, and its range is far cheaper to find than
    its standard deviation. The others get the standard deviation itself."""
    import cv2

    if image.size < _RANGE_PIXELS and image.ndim == 2:
        lo, hi, _, _ = cv2.minMaxLoc(image)
        if hi - lo > 1.0:
            return False
    return float(image.std()) < FLAT_STD


def match_template(
    a: np.ndarray, b: np.ndarray, r: int
) -> tuple[float, float, float, float] | None:
    """Best ``(dx, dy, ncc, ncc_zero)`` of the centre of ``a`` (less ``r`` on every edge) over
    ``b``, in pixels of these images; None when either is flat."""
    import cv2

    h, w = a.shape
    template = a[r : h - r, r : w - r]
    if _flat(template) or _flat(b):
        return None
    m = cv2.matchTemplate(b, template, cv2.TM_CCOEFF_NORMED)
    if not np.isfinite(m).all():  # rare (flat stretches): a check costs a tenth of the fix
        m = np.nan_to_num(m, nan=-1.0, posinf=-1.0, neginf=-1.0)
    _, peak, _, (x, y) = cv2.minMaxLoc(m)
    fx, fy = _parabola(m, x, y)
    return fx - r, fy - r, float(peak), float(m[r, r])


def check_pair(a: np.ndarray, b: np.ndarray, what: str) -> None:
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"pre and post {what} must have one 2-D shape, got {a.shape}, {b.shape}")


def luma(image: np.ndarray) -> np.ndarray:
    """float32 ``[H, W]`` Rec. 601 luma of a uint8 RGB image by OpenCV (rounded to whole grey
    levels, about 20 times faster than :func:`data_prep.registration.gray` on a 512 px window), or
    :func:`data_prep.registration.gray` of anything else."""
    import cv2

    if image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3:
        return cv2.cvtColor(image, cv2.COLOR_RGB2GRAY).astype(np.float32)
    return gray(image)


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
    return grey_context_shift(luma(pre), luma(post), search, factor, pre.shape[:2])


def grey_context_shift(
    a: np.ndarray,
    b: np.ndarray,
    search: int = CONTEXT_SEARCH,
    factor: int = CONTEXT_FACTOR,
    shape: tuple[int, ...] | None = None,
) -> ChipShift:
    """:func:`context_shift` of float32 grey windows ``[S, S]`` (:func:`luma` of the RGB ones,
    which a caller measuring many windows of one image converts once); ``shape`` names the
    windows' size in its message when they are too small."""
    check_pair(a, b, "windows")
    shape = a.shape if shape is None else shape
    factor = max(int(factor), 1)
    return reduced_context_shift(reduce(a, factor), reduce(b, factor), search, factor, shape)


def reduce(image: np.ndarray, factor: int) -> np.ndarray:
    """A float32 grey image averaged down by ``factor`` (OpenCV's area average): in halvings
    where the factor is a power of two (two cost a third of one average by 4, the same mean)."""
    import cv2

    left = max(int(factor), 1)
    while left > 1:
        step = 2 if left % 2 == 0 else left
        size = (image.shape[1] // step, image.shape[0] // step)
        image = cv2.resize(image, size, interpolation=cv2.INTER_AREA)
        left //= step
    return image


def context_blur(image: np.ndarray) -> np.ndarray:
    """The Gaussian blur (sigma :data:`CONTEXT_BLUR`) matching applies to averaged windows."""
    import cv2

    return cv2.GaussianBlur(image, (0, 0), CONTEXT_BLUR) if CONTEXT_BLUR > 0 else image


def reduced_context_shift(
    a: np.ndarray,
    b: np.ndarray,
    search: int = CONTEXT_SEARCH,
    factor: int = CONTEXT_FACTOR,
    shape: tuple[int, ...] | None = None,
    blurred: bool = False,
) -> ChipShift:
    """:func:`grey_context_shift` of windows already averaged down by ``factor`` (cut from an
    image :func:`reduce` averaged once for many windows), and already blurred by
    :func:`context_blur` where ``blurred``; shifts in pixels before the average."""
    shape = a.shape if shape is None else shape
    factor = max(int(factor), 1)
    if not blurred:
        a, b = context_blur(a), context_blur(b)
    r = max(1, int(search) // factor)
    if min(a.shape) <= 2 * r + 4:
        raise ValueError(f"windows of {shape} px are too small for a {search} px search")
    found = match_template(a, b, r)
    if found is None:
        return ChipShift(0.0, 0.0, 0.0, 0.0, float(search))
    dx, dy, peak, zero = found
    return ChipShift(float(dx * factor), float(dy * factor), peak, zero, float(r * factor))
