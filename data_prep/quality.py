"""Checks that decide whether imagery can be decoded and graded at all.

- Pixel limit: a raster (or one window of a windowed read) with more pixels than the limit is
  refused from its header, before anything is decoded, so a small file that declares a huge
  image (a decompression bomb) cannot exhaust memory. The limit is :data:`MAX_PIXELS` unless the
  environment variable :data:`MAX_PIXELS_ENV` or a ``--max-pixels`` option says otherwise.
- Blank imagery: a chip whose pixels are nearly all one value (black fill, a zero or nodata
  raster, a constant fill) holds nothing to grade; :func:`is_blank` says so.
"""

from __future__ import annotations

import os

import numpy as np

#: Default pixel limit per decoded raster or per window: 16384 x 16384 (268 Mpx, 805 MB as RGB
#: uint8), several times a large satellite tile; windowed scene reads stay far below it.
MAX_PIXELS = 16384 * 16384
#: Environment variable that overrides :data:`MAX_PIXELS`.
MAX_PIXELS_ENV = "LOCAL_DAMAGE_MAX_PIXELS"
#: A chip is blank when at least this fraction of its pixels share one value.
BLANK_FRACTION = 0.95
#: The reason recorded for a building whose chip is blank (``status`` ``skipped: blank imagery``).
BLANK = "blank imagery"


def max_pixels(value: int | None = None) -> int:
    """The pixel limit: ``value`` when given, else ``$LOCAL_DAMAGE_MAX_PIXELS``, else the default.

    Raises:
        ValueError: a limit that is not a positive integer (naming where it came from).
    """
    where = "max_pixels"
    if value is None:
        text = os.environ.get(MAX_PIXELS_ENV, "").strip()
        if not text:
            return MAX_PIXELS
        where = f"environment variable {MAX_PIXELS_ENV}"
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise ValueError(f"{where}: {text!r} is not a whole number of pixels") from None
    if int(value) < 1:
        raise ValueError(f"{where}: the pixel limit must be positive, got {value}")
    return int(value)


def pixel_limit_problem(width: int, height: int, limit: int, what: str = "image") -> str | None:
    """Why a ``width`` x ``height`` read is refused under ``limit`` pixels, or None if it is not.

    The message says how to raise the limit; callers prefix the file name.
    """
    if int(width) * int(height) <= limit:
        return None
    return (
        f"{what} of {width}x{height} px ({int(width) * int(height):,} pixels) exceeds the limit "
        f"of {limit:,} pixels; refused before decoding (raise it with --max-pixels or "
        f"{MAX_PIXELS_ENV} if the file is genuine)"
    )


#: Stride of the sample :func:`is_constant` looks at first (prime: no alignment with rows or bands).
_CONSTANT_STRIDE = 4099


def is_constant(image: np.ndarray) -> bool:
    """Whether every value of an array is the same (an all-zero, nodata or constant-fill image).

    A strided sample that holds two values settles almost every real image without reading the
    rest of it; only an image whose sample is constant is compared in full.
    """
    flat = np.asarray(image).reshape(-1)
    if flat.size == 0:
        return True
    first = flat[0]
    if (flat[::_CONSTANT_STRIDE] != first).any():
        return False
    return not (flat != first).any()


def dominant_fraction(chip: np.ndarray) -> float:
    """Fraction of the pixels of a uint8 [H, W, C] (or [H, W]) chip equal to its most common
    pixel value (all channels compared together)."""
    chip = np.asarray(chip)
    if chip.size == 0:
        return 1.0
    return _dominant_fraction(chip)


def _dominant_fraction(chip: np.ndarray) -> float:
    if chip.ndim == 2:
        flat = chip.ravel().astype(np.uint32)
    else:
        flat = np.zeros(chip.shape[0] * chip.shape[1], dtype=np.uint32)
        for c in range(min(chip.shape[2], 4)):
            flat = (flat << 8) | chip[..., c].ravel().astype(np.uint32)
    counts = np.unique(flat, return_counts=True)[1]
    return float(counts.max()) / flat.size


def is_blank(chip: np.ndarray, threshold: float = BLANK_FRACTION) -> bool:
    """Whether a chip holds no imagery to grade: at least ``threshold`` of its pixels share one
    value (zero or nodata fill, a constant raster). Zero fill past the raster edge of a building
    near the edge stays well below the threshold."""
    chip = np.asarray(chip)
    if chip.size == 0:
        return True
    # the commonest value of one channel bounds that of whole pixels: most chips stop here
    first = chip if chip.ndim == 2 else chip[..., 0]
    if _ruled_out(first[None], threshold)[0]:
        return False
    if np.bincount(first.ravel(), minlength=256).max() < threshold * first.size:
        return False
    return _dominant_fraction(chip) >= threshold


#: Stride of the sample :func:`is_blank` looks at first (one pixel in ``stride**2``).
_SAMPLE_STRIDE = 4


def _ruled_out(channels: np.ndarray, threshold: float) -> np.ndarray:
    """bool [n]: which of ``n`` uint8 [H, W] channels a strided sample proves not blank (exact).

    If a value filled at least ``threshold`` of all ``N`` pixels, at most ``(1 - threshold) N``
    of them differ from it, so in any sample of ``m`` pixels it fills at least
    ``m - (1 - threshold) N``. A sample whose commonest value falls below that bound rules the
    channel out without looking at its other pixels; the others are decided in full. All
    channels' samples are counted in one ``bincount`` (value + 256 x index).
    """
    count = len(channels)
    sample = channels[:, ::_SAMPLE_STRIDE, ::_SAMPLE_STRIDE]
    m, total = sample[0].size if count else 0, channels[0].size if count else 0
    need = m - (1.0 - threshold) * total
    if not count or m == 0 or need <= 0 or channels.dtype != np.uint8:
        return np.zeros(count, dtype=bool)
    keys = sample.reshape(count, -1).astype(np.intp)
    keys += (np.arange(count, dtype=np.intp) * 256)[:, None]
    peaks = np.bincount(keys.ravel(), minlength=256 * count).reshape(count, 256).max(axis=1)
    return peaks < need


def blank_reasons(pre: np.ndarray, post: np.ndarray) -> list[str | None]:
    """:func:`blank_reason` of every pair of two uint8 [n, H, W, C] chip batches, at once."""
    if len(pre) != len(post):
        raise ValueError(f"{len(pre)} pre chips but {len(post)} post chips")
    clear_pre = _ruled_out(pre[..., 0], BLANK_FRACTION)
    clear_post = _ruled_out(post[..., 0], BLANK_FRACTION)
    return [
        None if clear_pre[i] and clear_post[i] else blank_reason(pre[i], post[i])
        for i in range(len(pre))
    ]


def blank_reason(pre: np.ndarray, post: np.ndarray) -> str | None:
    """``"blank imagery (...)"`` naming the blank chip(s) of a pair, or None when both hold imagery."""
    blank = [name for name, chip in (("pre", pre), ("post", post)) if is_blank(chip)]
    if not blank:
        return None
    return f"{BLANK} (the {' and '.join(blank)} chip {'is' if len(blank) == 1 else 'are'} one flat value)"
