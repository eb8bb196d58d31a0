"""One radiometric rule: how the pixel values of any raster become the uint8 the model sees.

Every path that decodes imagery (``prepare xbd``, ``prepare scene``, ``score``, ``score-batch``,
the app, and so training, which reads the chips ``prepare`` made) maps pixel values to uint8 with
the rule below, decided per file from its pixel type, its declared bit depth and its values:

1. ``uint8``: used as is.
2. Unsigned integers with a declared bit depth ``n`` (GDAL ``NBITS`` in the ``IMAGE_STRUCTURE``
   metadata, e.g. 11 or 12 for many satellite products, 16): ``v * 255 / (2**n - 1)``.
3. ``uint16`` without a declaration whose valid values are all multiples of 257 (an 8-bit image
   stored as 16 bits, ``v8 * 257``): ``v / 257``.
4. Floating point whose valid values lie in [0, 1]: ``v * 255``; in [0, 255]: ``v``.
5. Anything else (11/12-bit data in ``uint16`` without a declaration, signed integers, floats
   outside [0, 255]): a linear stretch from the 2nd to the 98th percentile of the valid values,
   computed ONCE over the three bands of every such file of the input (pre and post together),
   so both dates and all bands get the same mapping and a brightness change between the dates
   survives it.

Every mapping is linear, ``v * ratio + offset``, rounded to the nearest integer (halves up) and
clipped to 0-255; nodata, masked and non-finite pixels become 0. So a ``x257`` uint16 copy and a
``/255`` float32 copy of an 8-bit image give exactly the 8-bit pixels back (rules 3 and 4), and
the grade of a building does not depend on how the file was stored.

Whole images (:func:`data_prep.imagery.read_rgb_pair`) are scaled in NumPy; mosaicked tiles are
wrapped in a GDAL VRT that applies the same mapping to the source pixels (:func:`scaled_vrt`),
before any resampling, so a scaled tile warps exactly as its 8-bit original would.

Which rule a file got is recorded in the chip store's ``store.json`` (``radiometry``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

#: ``Scaling.rule`` of each case of the module docstring.
UINT8, DECLARED_BITS, MULTIPLE_OF_257, FLOAT_UNIT, FLOAT_255, STRETCH = (
    "uint8",
    "declared-bits",
    "multiple-of-257",
    "float-0-1",
    "float-0-255",
    "stretch",
)
#: Percentiles of the joint stretch (rule 5).
STRETCH_PERCENTILES = (2.0, 98.0)
#: Side of the full-resolution windows read to test rule 3 on a mosaicked tile, and how many per
#: side of a grid over the tile.
PROBE_PX, PROBE_GRID = 64, 4
#: Longest side, in pixels, of the decimated read used to choose a non-uint8 tile's scaling.
SAMPLE_PX = 512
#: Most values per tile kept for the stretch percentiles.
SAMPLE_VALUES = 3 * 65536
#: Rasters up to this many pixels without overviews are sampled by one decimated read; larger
#: ones by a grid of SAMPLE_GRID x SAMPLE_GRID windows of PROBE_PX.
SAMPLE_FULL_PX, SAMPLE_GRID = 8192 * 8192, 8


@dataclass(frozen=True)
class Scaling:
    """A linear map of pixel values to uint8: ``floor(v * ratio + offset + 0.5)`` clipped to 0-255.

    Attributes:
        rule: which case of the radiometric rule chose it (see the module docstring).
        ratio, offset: the linear map.
        detail: what decided it, for reports (e.g. ``"NBITS=12"``).
    """

    rule: str
    ratio: float = 1.0
    offset: float = 0.0
    detail: str = ""

    def apply(self, values: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
        """Map an array of any shape to uint8; pixels outside ``valid`` and non-finite ones -> 0."""
        if self.rule == UINT8 and values.dtype == np.uint8:
            out = values.copy()
        else:
            scaled = np.floor(values.astype(np.float64) * self.ratio + self.offset + 0.5)
            finite = np.isfinite(scaled)
            out = np.clip(np.where(finite, scaled, 0), 0, 255).astype(np.uint8)
        if valid is not None:
            out[..., ~valid] = 0
        return out

    def maps_exactly(self, value: float) -> int | None:
        """The uint8 that ``value`` maps to when it is an integer 0-255 without rounding, else None."""
        if value is None or not np.isfinite(value):
            return None
        mapped = float(value) * self.ratio + self.offset
        if abs(mapped - round(mapped)) > 1e-6 or not 0 <= round(mapped) <= 255:
            return None
        return int(round(mapped))

    def describe(self) -> str:
        text = self.rule if not self.detail else f"{self.rule} ({self.detail})"
        if self.rule == UINT8:
            return text
        return f"{text}: v * {self.ratio:.6g} + {self.offset:.6g}"


IDENTITY = Scaling(UINT8)


def declared_bits(dataset) -> int | None:
    """The bit depth a raster declares (GDAL ``NBITS``, band or dataset ``IMAGE_STRUCTURE``)."""
    for tags in (dataset.tags(1, ns="IMAGE_STRUCTURE"), dataset.tags(ns="IMAGE_STRUCTURE")):
        text = tags.get("NBITS")
        if text:
            try:
                bits = int(text)
            except ValueError:
                continue
            if 1 <= bits <= 32:
                return bits
    return None


def choose_scaling(dtype, bits: int | None, values: np.ndarray, exact: np.ndarray | None = None):
    """The scaling of one file by rules 1-4, or None when it needs the joint stretch (rule 5).

    Args:
        dtype: the file's pixel type.
        bits: its declared bit depth (:func:`declared_bits`), None when it declares none.
        values: valid pixel values of bands 1-3 (all of them, or a sample), any shape.
        exact: full-resolution valid values to test rule 3 on (default ``values``); a decimated
            read through averaged overviews is no test of multiples of 257.
    """
    dtype = np.dtype(dtype)
    if dtype == np.uint8:
        return IDENTITY
    values = np.asarray(values).ravel()
    if np.issubdtype(dtype, np.unsignedinteger):
        if bits is not None and 8 <= bits <= min(16, dtype.itemsize * 8):
            return Scaling(DECLARED_BITS, 255.0 / (2**bits - 1), 0.0, f"NBITS={bits}")
        probe = values if exact is None else np.asarray(exact).ravel()
        if dtype == np.uint16 and probe.size and not (probe % 257).any():
            return Scaling(MULTIPLE_OF_257, 1.0 / 257.0, 0.0, "every value a multiple of 257")
        return None
    if np.issubdtype(dtype, np.floating):
        finite = values[np.isfinite(values)]
        if finite.size and finite.min() >= 0.0:
            if finite.max() <= 1.0:
                return Scaling(FLOAT_UNIT, 255.0, 0.0, "values in [0, 1]")
            if finite.max() <= 255.0:
                return Scaling(FLOAT_255, 1.0, 0.0, "values in [0, 255]")
    return None


def joint_stretch(samples: list[np.ndarray]) -> Scaling:
    """Rule 5: one 2nd-98th percentile stretch over the pooled valid values of all ``samples``.

    With no valid value (or a constant one) the map sends everything to 0: blank imagery, which
    :func:`data_prep.quality.is_blank` then refuses to grade.
    """
    pooled = [np.asarray(s, dtype=np.float64).ravel() for s in samples]
    pooled = np.concatenate(pooled) if pooled else np.zeros(0)
    pooled = pooled[np.isfinite(pooled)]
    if not pooled.size:
        return Scaling(STRETCH, 0.0, 0.0, "no valid pixel")
    lo, hi = (float(v) for v in np.percentile(pooled, STRETCH_PERCENTILES))
    if not hi > lo:
        return Scaling(STRETCH, 0.0, 0.0, f"constant value {lo:g}")
    ratio = 255.0 / (hi - lo)
    return Scaling(STRETCH, ratio, -lo * ratio, f"2-98% of pre and post: {lo:g}-{hi:g}")


def probe_values(dataset, alpha: int = 0, grid: int = PROBE_GRID) -> np.ndarray:
    """Valid full-resolution values of bands 1-3 from a grid of small windows over the raster
    (``grid`` squared windows of :data:`PROBE_PX` px), for testing rule 3."""
    from rasterio.windows import Window

    w, h = dataset.width, dataset.height
    size_x, size_y = min(PROBE_PX, w), min(PROBE_PX, h)
    cols = np.unique(np.linspace(0, w - size_x, grid).round().astype(int))
    rows = np.unique(np.linspace(0, h - size_y, grid).round().astype(int))
    out = []
    for r in rows:
        for c in cols:
            window = Window(int(c), int(r), size_x, size_y)
            data = dataset.read([1, 2, 3], window=window, masked=True)
            mask = np.ma.getmaskarray(data)
            if alpha:
                mask = mask | (dataset.read(alpha, window=window) == 0)[None]
            out.append(np.asarray(data.data)[~mask])
    return np.concatenate(out) if out else np.zeros(0)


def sample_values(dataset, alpha: int = 0) -> np.ndarray:
    """Valid values of bands 1-3, at most :data:`SAMPLE_VALUES` in all, for choosing a scaling and
    computing the stretch: a decimated read (through overviews when present) of rasters with
    overviews or of at most :data:`SAMPLE_FULL_PX` pixels, else :data:`SAMPLE_GRID` squared
    full-resolution windows, so a huge sparse raster is not read block by block."""
    if dataset.width * dataset.height > SAMPLE_FULL_PX and not dataset.overviews(1):
        return probe_values(dataset, alpha, grid=SAMPLE_GRID)
    scale = max(1.0, max(dataset.width, dataset.height) / float(SAMPLE_PX))
    shape = (3, max(1, round(dataset.height / scale)), max(1, round(dataset.width / scale)))
    data = dataset.read([1, 2, 3], out_shape=shape, masked=True)
    mask = np.ma.getmaskarray(data)
    if alpha:
        mask = mask | (dataset.read(alpha, out_shape=shape[1:]) == 0)[None]
    values = np.asarray(data.data, dtype=np.float64)[~mask]
    values = values[np.isfinite(values)]
    return values[:: max(1, values.size // SAMPLE_VALUES)]


def scene_scalings(tiles: list) -> None:
    """Give every :class:`data_prep.mosaic.Tile` of a scene (pre and post together) its scaling:
    rules 1-4 were chosen per tile when it was opened; the tiles left need the stretch (rule 5)
    and share one computed over all of them."""
    pending = [t for t in tiles if t.scaling is None]
    if pending:
        stretch = joint_stretch([t.sample for t in pending])
        for tile in pending:
            tile.scaling = stretch
    for tile in tiles:
        tile.use_scaling(tile.scaling)


def vrt_root(dataset):
    """The ``VRTDataset`` element (xml.etree) of a VRT over ``dataset``: its size, CRS (when it
    has one) and geotransform, so that a warp from the VRT lands where one from the file would."""
    import xml.etree.ElementTree as ET

    root = ET.Element("VRTDataset", rasterXSize=str(dataset.width), rasterYSize=str(dataset.height))
    if dataset.crs is not None:
        ET.SubElement(root, "SRS").text = dataset.crs.to_wkt()
    ET.SubElement(root, "GeoTransform").text = ", ".join(
        repr(float(v)) for v in dataset.transform.to_gdal()
    )
    return root


def scaled_vrt(dataset, scaling: Scaling, alpha: int = 0) -> tuple[str, int]:
    """A GDAL VRT (XML text) showing bands 1-3 of ``dataset`` as uint8 through ``scaling``.

    The VRT has the dataset's CRS, geotransform and size, so a warp from it matches a warp of the
    8-bit original pixel for pixel. Validity carries over: a nodata value that the scaling maps
    exactly onto a grey level stays the nodata value; otherwise (or with an alpha band) the
    dataset's mask becomes a 4th, alpha band.

    Returns:
        ``(xml, alpha)``: the VRT and the 1-based index of its alpha band (0 when none).
    """
    import xml.etree.ElementTree as ET

    path = os.path.abspath(dataset.name)
    source_type = {
        "uint8": "Byte",
        "uint16": "UInt16",
        "int16": "Int16",
        "uint32": "UInt32",
        "int32": "Int32",
        "float32": "Float32",
        "float64": "Float64",
    }.get(dataset.dtypes[0], "Float64")
    nodata = dataset.nodata
    mapped_nodata = scaling.maps_exactly(nodata) if nodata is not None else None
    needs_alpha = bool(alpha) or (nodata is not None and mapped_nodata is None)
    root = vrt_root(dataset)

    def source(parent, tag: str, band: str, dtype: str):
        src = ET.SubElement(parent, tag)
        ET.SubElement(src, "SourceFilename", relativeToVRT="0").text = path
        ET.SubElement(src, "SourceBand").text = band
        ET.SubElement(
            src,
            "SourceProperties",
            RasterXSize=str(dataset.width),
            RasterYSize=str(dataset.height),
            DataType=dtype,
        )
        rect = {"xOff": "0", "yOff": "0", "xSize": str(dataset.width), "ySize": str(dataset.height)}
        ET.SubElement(src, "SrcRect", **rect)
        ET.SubElement(src, "DstRect", **rect)
        return src

    for b, colour in zip((1, 2, 3), ("Red", "Green", "Blue"), strict=True):
        band = ET.SubElement(root, "VRTRasterBand", dataType="Byte", band=str(b))
        if mapped_nodata is not None:
            ET.SubElement(band, "NoDataValue").text = str(mapped_nodata)
        ET.SubElement(band, "ColorInterp").text = colour
        src = source(band, "ComplexSource", str(b), source_type)
        if nodata is not None:
            ET.SubElement(src, "NODATA").text = repr(float(nodata))
        ET.SubElement(src, "ScaleOffset").text = repr(float(scaling.offset))
        ET.SubElement(src, "ScaleRatio").text = repr(float(scaling.ratio))
    if needs_alpha:
        band = ET.SubElement(root, "VRTRasterBand", dataType="Byte", band="4")
        ET.SubElement(band, "ColorInterp").text = "Alpha"
        source(band, "SimpleSource", "mask,1", "Byte")
    return ET.tostring(root, encoding="unicode"), 4 if needs_alpha else 0
