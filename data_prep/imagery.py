"""Reading imagery into uint8 RGB arrays with clear errors for what cannot be used."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from data_prep import radiometry
from data_prep.errors import LocalDamageError, not_found
from data_prep.quality import max_pixels as pixel_limit
from data_prep.quality import pixel_limit_problem
from data_prep.radiometry import Scaling


class ImageError(LocalDamageError, ValueError):
    """An image that cannot be used; the message names the file and the problem."""


def split_file_message(message: str, paths) -> tuple[str | None, str]:
    """``(path, problem)`` of an error message ``"<path>: <problem>"`` naming one of ``paths``
    (as :class:`ImageError` messages do); ``(None, message)`` when it names none of them."""
    for path in paths:
        if message.startswith(f"{path}: "):
            return str(path), message[len(f"{path}: ") :]
    return None, message


def to_uint8_rgb(
    array: np.ndarray,
    path: str | os.PathLike,
    nodata: float | None = None,
    scaling: Scaling | None = None,
) -> np.ndarray:
    """Convert a band-first [C, H, W] raster array into uint8 [H, W, 3].

    - 3 bands: used as R, G, B. 4 bands: the 4th is taken as alpha/NIR and dropped.
      Other band counts are refused.
    - Pixel values follow the radiometric rule of :mod:`data_prep.radiometry`: ``scaling`` when
      given, else the rule chosen from this array alone (uint8 as is; x257 uint16 and [0, 1] or
      [0, 255] floats exactly; otherwise a 2-98% stretch over its three bands). Nodata and
      non-finite pixels become 0.
    """
    if array.ndim != 3:
        raise ImageError(f"{path}: expected a [bands, rows, cols] raster, got shape {array.shape}")
    check_bands(array.shape[0], path)
    array = array[:3]
    if array.dtype == np.uint8 and (scaling is None or scaling.rule == radiometry.UINT8):
        return _interleave(array)
    check_dtype(array.dtype, path)
    valid = _valid(array, nodata)
    if scaling is None:
        values = array[:, valid]
        scaling = radiometry.choose_scaling(array.dtype, None, values) or radiometry.joint_stretch(
            [values]
        )
    return _interleave(scaling.apply(array, valid))


def check_bands(count: int, path: str | os.PathLike) -> None:
    """Refuse band counts other than 3 (RGB) or 4 (RGBA, or RGB plus NIR)."""
    if count not in (3, 4):
        raise ImageError(
            f"{path}: has {count} band(s); an RGB image with 3 bands (or RGBA with 4) is required"
        )


def check_dtype(dtype, path: str | os.PathLike) -> None:
    dtype = np.dtype(dtype)
    if not (np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating)):
        raise ImageError(f"{path}: unsupported pixel type {dtype}")


def _valid(array: np.ndarray, nodata: float | None) -> np.ndarray:
    """bool [H, W]: pixels whose bands 1-3 are finite and not all equal to ``nodata``."""
    valid = np.ones(array.shape[1:], dtype=bool)
    if np.issubdtype(array.dtype, np.floating):
        valid &= np.isfinite(array[:3]).all(axis=0)
    if nodata is not None:
        valid &= ~(array[:3] == nodata).all(axis=0)
    return valid


def _interleave(bands: np.ndarray) -> np.ndarray:
    """Band-first uint8 [3, H, W] to a contiguous [H, W, 3] (cv2.merge is ~20x faster than a
    NumPy transpose copy for whole tiles; NumPy beyond OpenCV's 2**31-byte array limit)."""
    if bands[:3].size >= 2**31:
        return np.ascontiguousarray(np.moveaxis(bands[:3], 0, -1))
    import cv2

    return cv2.merge([np.ascontiguousarray(b) for b in bands[:3]])


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_END = b"IEND\xaeB`\x82"


def check_png_complete(path: str | os.PathLike) -> None:
    """Raise ImageError for a PNG that lacks its IEND end chunk (a truncated file).

    GDAL's PNG driver fills the missing rows of a truncated PNG with zeros without reporting an
    error, so truncation is checked here from the last 4 KiB of the file. Non-PNG files pass.
    """
    with open(path, "rb") as fh:
        if fh.read(8) != _PNG_SIGNATURE:
            return
        size = fh.seek(0, os.SEEK_END)
        fh.seek(max(size - 4096, 8))
        tail = fh.read()
    if _PNG_END not in tail:
        raise ImageError(
            f"{path}: truncated PNG (no IEND end chunk); the file is incomplete, copy or download it again"
        )


@dataclass
class Decoded:
    """One image decoded as stored: band-first bands 1-3 and what the radiometric rule needs."""

    path: str
    bands: np.ndarray
    nodata: float | None
    bits: int | None

    @cached_property
    def valid(self) -> np.ndarray:
        """bool [H, W]: pixels that are finite and not nodata (only the rules that rescale need
        it, so a uint8 image never computes it)."""
        return _valid(self.bands, self.nodata)

    def scaling(self) -> Scaling | None:
        """Rules 1-4 of :mod:`data_prep.radiometry`, None when the joint stretch applies."""
        if self.bands.dtype == np.uint8:
            return radiometry.IDENTITY
        return radiometry.choose_scaling(self.bands.dtype, self.bits, self.bands[:, self.valid])


def decode(path: str | os.PathLike, max_pixels: int | None = None) -> Decoded:
    """Decode a whole PNG/JPEG/GeoTIFF with rasterio after checking it can be used.

    Guards, in this order, before any pixel is decoded: the file exists; a PNG has its IEND
    chunk (:func:`check_png_complete`); the header's size is within the pixel limit
    (:func:`data_prep.quality.max_pixels`); 3 or 4 bands of a numeric type. A decode error
    (truncated or corrupt data) becomes an :class:`ImageError` naming the file.
    """
    import warnings

    import rasterio
    from rasterio.errors import NotGeoreferencedWarning, RasterioError

    limit = pixel_limit(max_pixels)
    if not os.path.exists(path):
        raise ImageError(f"{path}: {not_found(path)}")
    check_png_complete(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGeoreferencedWarning)
            with rasterio.open(path) as ds:
                problem = pixel_limit_problem(ds.width, ds.height, limit)
                if problem:
                    raise ImageError(f"{path}: {problem}")
                check_bands(ds.count, path)
                check_dtype(ds.dtypes[0], path)
                bands = ds.read([1, 2, 3])
                nodata = ds.nodata
                bits = radiometry.declared_bits(ds)
    except RasterioError as exc:
        raise ImageError(
            f"{path}: cannot be read as an image; corrupt, truncated or not an image file ({exc})"
        ) from exc
    return Decoded(str(path), bands, nodata, bits)


def read_rgb(path: str | os.PathLike, max_pixels: int | None = None) -> np.ndarray:
    """Read a whole PNG/JPEG/GeoTIFF into uint8 [H, W, 3], decoding it once.

    The radiometric rule is decided from this file alone; use :func:`read_rgb_pair` for a pre/post
    pair, which shares one stretch between the dates when one is needed.
    """
    return read_rgb_pair(path, None, max_pixels)[0]


def read_rgb_pair(
    pre: str | os.PathLike, post: str | os.PathLike | None, max_pixels: int | None = None
) -> tuple[np.ndarray, np.ndarray | None, dict[str, Scaling]]:
    """Read a pre/post pair into uint8 [H, W, 3] arrays under one radiometric rule.

    Each file gets rules 1-4 of :mod:`data_prep.radiometry` on its own; the files that need the
    stretch (rule 5) share one, computed from both of them.

    Returns:
        ``(pre_rgb, post_rgb, scalings)``: ``post_rgb`` is None when ``post`` is; ``scalings``
        maps each path to the :class:`~data_prep.radiometry.Scaling` it got.

    Raises:
        ImageError: naming the file, for anything :func:`decode` refuses.
    """
    images = [decode(p, max_pixels) for p in (pre, post) if p is not None]
    scalings = [d.scaling() for d in images]
    if any(s is None for s in scalings):
        stretch = radiometry.joint_stretch(
            [d.bands[:, d.valid] for d, s in zip(images, scalings, strict=True) if s is None]
        )
        scalings = [stretch if s is None else s for s in scalings]
    rgb = [
        _interleave(d.bands)
        if s.rule == radiometry.UINT8
        else _interleave(s.apply(d.bands, d.valid))
        for d, s in zip(images, scalings, strict=True)
    ]
    return (
        rgb[0],
        rgb[1] if post is not None else None,
        {d.path: s for d, s in zip(images, scalings, strict=True)},
    )
