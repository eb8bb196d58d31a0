"""A warp source without the nodata value for a tile that declares one but holds no pixel of it.

GDAL warps a source with a nodata value through its general kernel, which weighs every source
pixel by its validity: on the synthetic scene's post tiles (another CRS, 11% finer pixels) that
is about twice the time of the same warp from a source without one (docs/benchmarks.md). Where no pixel of the
tile equals its nodata value every validity weight is one, and the warp from the same pixels with
no nodata value gives the same array, bit for bit (``tests/data_prep/test_nodata_free.py``): such
a tile is warped from a VRT of its bands 1-3 that leaves the nodata value out (:func:`plain_vrt`).

Which tiles: uint8 files read as they are (no scaling VRT, no alpha band), whose only mask is a
nodata value of 0 (the black collar of most products; with another value the warp that honours it
writes that value into the pixels it leaves without data, where the plain warp leaves 0), and of
at most :data:`MAX_SCAN_PIXELS` pixels, scanned once, in strips, up to the first pixel of the
nodata value (:func:`holds_nodata`: a tile with a collar is told by one strip, one without the
value costs one read of the tile).
"""

from __future__ import annotations

import os

#: Largest tile scanned for its nodata value (a 4096 px square); larger tiles warp as they are.
MAX_SCAN_PIXELS = 4096 * 4096
#: Pixels per strip of the scan.
STRIP_PIXELS = 1 << 20


def scannable(dataset, alpha: int = 0) -> bool:
    """Whether ``dataset`` is a tile :func:`plain_vrt` may stand in for once scanned: uint8
    bands 1-3 whose only mask is a declared nodata value of 0, no alpha band, at most
    :data:`MAX_SCAN_PIXELS` pixels."""
    from rasterio.enums import MaskFlags

    if alpha or dataset.nodata != 0 or dataset.count < 3:
        return False
    if dataset.width * dataset.height > MAX_SCAN_PIXELS:
        return False
    if any(dt != "uint8" for dt in dataset.dtypes[:3]):
        return False
    return all(list(f) == [MaskFlags.nodata] for f in dataset.mask_flag_enums[:3])


def holds_nodata(dataset) -> bool:
    """Whether any pixel of bands 1-3 of ``dataset`` equals its nodata value (in any band: GDAL
    may treat the bands' nodata apart), read in strips of about :data:`STRIP_PIXELS` pixels, the
    last strip first, and stopped at the first such pixel."""
    from rasterio.windows import Window

    value = dataset.nodata
    if value is None:
        return False
    rows = max(1, STRIP_PIXELS // max(dataset.width, 1))
    starts = list(range(0, dataset.height, rows))
    # the last strip, then the first: a collar along any edge is found in one strip
    for row in dict.fromkeys([starts[-1], *starts]):
        height = min(rows, dataset.height - row)
        strip = dataset.read([1, 2, 3], window=Window(0, row, dataset.width, height))
        if (strip == value).any():
            return True
    return False


def plain_vrt(dataset) -> str:
    """A GDAL VRT (XML text) of bands 1-3 of ``dataset`` with its CRS, geotransform and size
    (:func:`data_prep.radiometry.vrt_root`) and no nodata value."""
    import xml.etree.ElementTree as ET

    from data_prep.radiometry import vrt_root

    root = vrt_root(dataset)
    path = os.path.abspath(dataset.name)
    for b, colour in zip((1, 2, 3), ("Red", "Green", "Blue"), strict=True):
        band = ET.SubElement(root, "VRTRasterBand", dataType="Byte", band=str(b))
        ET.SubElement(band, "ColorInterp").text = colour
        src = ET.SubElement(band, "SimpleSource")
        ET.SubElement(src, "SourceFilename", relativeToVRT="0").text = path
        ET.SubElement(src, "SourceBand").text = str(b)
    return ET.tostring(root, encoding="unicode")


def open_nodata_free(dataset, alpha: int = 0):
    """The VRT of :func:`plain_vrt` opened, for a tile that :func:`scannable` admits and that
    holds no pixel of its nodata value; None for any other (or when the VRT cannot be opened)."""
    import rasterio
    from rasterio.errors import RasterioError

    if not scannable(dataset, alpha):
        return None
    try:
        return None if holds_nodata(dataset) else rasterio.open(plain_vrt(dataset))
    except RasterioError:  # the tile's own read will say what is wrong with it
        return None
