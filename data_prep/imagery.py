"""Reading imagery into uint8 RGB arrays with clear errors for what cannot be used."""

from __future__ import annotations

import os

import numpy as np


class ImageError(ValueError):
    """An image that cannot be used; the message names the file and the problem."""


def to_uint8_rgb(
    array: np.ndarray, path: str | os.PathLike, nodata: float | None = None
) -> np.ndarray:
    """Convert a band-first [C, H, W] raster array into uint8 [H, W, 3].

    - 3 bands: used as R, G, B. 4 bands: the 4th is taken as alpha/NIR and dropped.
      Other band counts are refused.
    - uint8 is used as is. Other integer or float types are scaled to 0-255 with a per-band
      2nd-98th percentile stretch over valid pixels (the usual display stretch for 11/16-bit
      satellite products); all-constant bands map to 0.
    """
    if array.ndim != 3:
        raise ImageError(f"{path}: expected a [bands, rows, cols] raster, got shape {array.shape}")
    bands = array.shape[0]
    if bands == 4:
        array = array[:3]
    elif bands != 3:
        raise ImageError(
            f"{path}: has {bands} band(s); an RGB image with 3 bands (or RGBA with 4) is required"
        )
    if array.dtype == np.uint8:
        return _interleave(array)
    if not (np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)):
        raise ImageError(f"{path}: unsupported pixel type {array.dtype}")
    data = array.astype(np.float32)
    out = np.zeros(data.shape, dtype=np.uint8)
    for b in range(3):
        band = data[b]
        valid = np.isfinite(band)
        if nodata is not None:
            valid &= band != nodata
        if not valid.any():
            continue
        lo, hi = np.percentile(band[valid], [2, 98])
        if hi <= lo:
            continue
        scaled = np.clip((band - lo) / (hi - lo) * 255.0, 0, 255)
        scaled[~valid] = 0
        out[b] = scaled.astype(np.uint8)
    return _interleave(out)


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


def read_rgb(path: str | os.PathLike) -> np.ndarray:
    """Read a whole PNG/JPEG/GeoTIFF into uint8 [H, W, 3] with rasterio, decoding it once."""
    import warnings

    import rasterio
    from rasterio.errors import NotGeoreferencedWarning, RasterioIOError

    if not os.path.exists(path):
        raise ImageError(f"{path}: file not found")
    check_png_complete(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGeoreferencedWarning)
            with rasterio.open(path) as ds:
                array = ds.read()
                nodata = ds.nodata
    except RasterioIOError as exc:
        raise ImageError(
            f"{path}: cannot be read as an image; corrupt, truncated or not an image file ({exc})"
        ) from exc
    return to_uint8_rgb(array, path, nodata)
