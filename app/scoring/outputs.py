"""Files written by scoring: per-building vectors, a class raster and a PNG overlay.

- Vectors: GeoJSON (RFC 7946: EPSG:4326 longitude/latitude, no ``crs`` member) or GeoPackage (any
  CRS, or none for pixel coordinates), written through pyogrio (GDAL/OGR) with null values where
  a building has no score. GeoPandas and QGIS open both.
- Class raster: a Cloud-Optimised GeoTIFF of the class id under every building pixel and 255
  (nodata) elsewhere, rasterised one block at a time into a tiled GeoTIFF and then copied to
  the COG layout (internal overviews, nearest resampling), so memory stays bounded by the block.
- Overlay: an RGB PNG of the post image, downsampled to at most :data:`OVERLAY_MAX_SIDE` pixels
  on its long side, with footprints filled and outlined in their class colour, flagged buildings
  (:mod:`runtime.flags`) outlined in magenta over their grade colour, and a legend.

Every file is written under a temporary name next to its destination and renamed into place only
when complete (:func:`data_prep.store.atomic_path`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from data_prep.errors import LocalDamageError
from data_prep.store import atomic_path

if TYPE_CHECKING:
    from affine import Affine

#: Vector formats by file suffix: (format name, OGR driver).
VECTOR_FORMATS: dict[str, tuple[str, str]] = {
    ".geojson": ("geojson", "GeoJSON"),
    ".json": ("geojson", "GeoJSON"),
    ".gpkg": ("gpkg", "GPKG"),
}
#: Suffix written for each format name.
FORMAT_SUFFIX: dict[str, str] = {"geojson": ".geojson", "gpkg": ".gpkg"}
#: Class raster value of pixels outside every scored building.
RASTER_NODATA = 255
#: Longest side of the overlay PNG in pixels.
OVERLAY_MAX_SIDE = 2048
#: RGB colour per class id (no-damage, minor, major, destroyed) in overlays and the raster palette.
CLASS_COLOURS: tuple[tuple[int, int, int], ...] = (
    (40, 200, 60),  # green
    (250, 225, 30),  # yellow
    (255, 140, 0),  # orange
    (230, 20, 20),  # red
)
#: Outline colour of buildings without a score (not covered or skipped).
UNSCORED_COLOUR = (170, 170, 170)
#: Outline colour of flagged buildings (an abstain flag says the grade should be checked); their
#: fill keeps the grade colour.
FLAGGED_COLOUR = (230, 0, 230)  # magenta
#: Legend label of flagged buildings.
FLAGGED_LABEL = "flagged: check"


class OutputError(LocalDamageError, ValueError):
    """An output path that cannot be used; the message names it and says what is accepted."""


def vector_format(path: str | os.PathLike) -> str:
    """``"geojson"`` or ``"gpkg"`` from the file suffix.

    Raises:
        OutputError: for any other suffix.
    """
    suffix = Path(path).suffix.lower()
    if suffix not in VECTOR_FORMATS:
        raise OutputError(
            f"{path}: unknown output format {suffix or '(no suffix)'!r}; use .geojson or .gpkg"
        )
    return VECTOR_FORMATS[suffix][0]


def write_vector(
    path: str | os.PathLike,
    geometries: Sequence,
    crs: str | None,
    columns: Mapping[str, np.ndarray],
    masks: Mapping[str, np.ndarray] | None = None,
    layer: str | None = None,
    metadata: Mapping[str, str] | None = None,
    collection_members: Mapping[str, Any] | None = None,
) -> Path:
    """Write building features atomically as GeoJSON or GeoPackage (chosen by the suffix).

    Args:
        path: ``.geojson``/``.json`` or ``.gpkg`` file.
        geometries: [N] shapely geometries (None for a feature without geometry). For GeoJSON they
            must already be in longitude/latitude (EPSG:4326 axis order x = lon, y = lat).
        crs: the geometries' CRS (any pyproj/GDAL string; ignored for GeoJSON, which is always
            written as RFC 7946), or None for a GeoPackage in pixel coordinates.
        columns: attribute name -> [N] values (object arrays for text).
        masks: attribute name -> [N] bool, True where the value is null.
        layer: layer name (default: the file stem).
        metadata: GeoPackage layer metadata (ignored by GeoJSON).
        collection_members: GeoJSON only: extra JSON members of the FeatureCollection
            (e.g. ``local_damage_alignment``), as GDAL's ``FOREIGN_MEMBERS_COLLECTION`` writes them.

    Returns:
        The written path.
    """
    import shapely
    from pyogrio.raw import write

    path = Path(path)
    fmt = vector_format(path)
    driver = "GeoJSON" if fmt == "geojson" else "GPKG"
    geoms = np.asarray(list(geometries) if not isinstance(geometries, np.ndarray) else geometries)
    geoms = geoms.astype(object)
    wkb = np.array(
        [None if g is None or g.is_empty else shapely.to_wkb(g) for g in geoms], dtype=object
    )
    types = {g.geom_type for g in geoms if g is not None and not g.is_empty}
    geometry_type = types.pop() if len(types) == 1 else "Unknown"
    names = list(columns)
    data = [np.asarray(columns[k]) for k in names]
    field_mask = [None if not masks or k not in masks else np.asarray(masks[k]) for k in names]
    options: dict = {}
    if fmt == "geojson":
        options["layer_options"] = {"RFC7946": "YES", "WRITE_NAME": "NO"}
        if collection_members:
            members = json.dumps(dict(collection_members), sort_keys=True, allow_nan=False)
            options["layer_options"]["FOREIGN_MEMBERS_COLLECTION"] = members
        crs = "OGC:CRS84"
    elif metadata:
        options["layer_metadata"] = {str(k): str(v) for k, v in metadata.items()}
    import warnings

    with atomic_path(path, suffix=path.suffix) as tmp, warnings.catch_warnings():
        # pixel coordinates without a CRS are intended (xBD images without georeferencing)
        warnings.filterwarnings("ignore", message=".*'crs' was not provided.*")
        tmp.unlink()  # OGR drivers create the file themselves
        write(
            str(tmp),
            wkb,
            field_data=data,
            fields=names,
            field_mask=field_mask,
            layer=layer or path.stem,
            driver=driver,
            geometry_type=geometry_type,
            crs=_crs_wkt(crs) if crs is not None else None,
            promote_to_multi=False,
            **options,
        )
    return path


def _crs_wkt(crs) -> str:
    from pyproj import CRS

    if hasattr(crs, "to_wkt"):
        crs = crs.to_wkt()
    return CRS.from_user_input(crs).to_wkt()


@dataclass(frozen=True)
class RasterGrid:
    """The pixel grid of a class raster.

    Attributes:
        width, height: grid size in pixels.
        crs: the grid CRS (None: no georeferencing, pixel grid only).
        transform: the grid transform (pixel corner -> CRS units); identity when None.
    """

    width: int
    height: int
    crs: Any = None
    transform: Affine | None = None


def write_class_raster(
    path: str | os.PathLike,
    pixel_geometries: Sequence,
    class_ids: np.ndarray,
    grid: RasterGrid,
    class_names: Sequence[str] = (),
    block_size: int = 1024,
) -> Path:
    """Rasterise scored buildings into a Cloud-Optimised GeoTIFF, one block at a time.

    Args:
        path: output ``.tif``.
        pixel_geometries: [N] shapely footprints in pixel coordinates of the grid (x = column,
            y = row); None entries are ignored.
        class_ids: [N] class id per footprint, negative for buildings without a score (left out).
        grid: the raster's grid (size and georeferencing).
        class_names: written to the band description and the ``classes`` tag.
        block_size: side in pixels of the blocks rasterised at once (memory is about
            ``block_size**2`` bytes plus the buildings of one block).

    Returns:
        The written path. The file holds one uint8 band: class id under each pixel whose centre
        lies in a scored building (later buildings win where footprints overlap), 255 elsewhere,
        with a colour table in the class colours.
    """
    import json
    import warnings

    import rasterio
    import rasterio.shutil
    import shapely
    from affine import Affine
    from rasterio.errors import NotGeoreferencedWarning
    from rasterio.features import rasterize
    from rasterio.windows import Window

    path = Path(path)
    width, height, crs, transform = grid.width, grid.height, grid.crs, grid.transform
    if width < 1 or height < 1:
        raise OutputError(f"{path}: cannot write an empty {width}x{height} raster")
    geoms = np.asarray(pixel_geometries, dtype=object)
    class_ids = np.asarray(class_ids)
    keep = np.array([g is not None and not g.is_empty for g in geoms], dtype=bool) & (
        class_ids >= 0
    )
    index = np.flatnonzero(keep)
    tree = shapely.STRtree(geoms[index]) if index.size else None
    transform = transform if transform is not None else Affine.identity()
    colormap = {k: (*c, 255) for k, c in enumerate(CLASS_COLOURS)}
    colormap[RASTER_NODATA] = (0, 0, 0, 0)
    profile = {
        "driver": "GTiff",
        "width": width,
        "height": height,
        "count": 1,
        "dtype": "uint8",
        "nodata": RASTER_NODATA,
        "tiled": True,
        "blockxsize": 512,
        "blockysize": 512,
        "compress": "deflate",
        "BIGTIFF": "IF_SAFER",
    }
    if crs is not None:
        profile.update(crs=crs, transform=transform)
    staging = None
    try:  # from the temporary's creation on, so an interrupt never leaks it
        fd, staging = tempfile.mkstemp(
            prefix=f".{path.name}.", suffix=".staging.tif", dir=_dir(path)
        )
        os.close(fd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGeoreferencedWarning)
            with rasterio.open(staging, "w", **profile) as ds:
                ds.write_colormap(1, colormap)
                if class_names:
                    ds.set_band_description(1, "damage class id (" + ", ".join(class_names) + ")")
                    ds.update_tags(classes=json.dumps(list(class_names)), nodata=RASTER_NODATA)
                for r0 in range(0, height, block_size):
                    for c0 in range(0, width, block_size):
                        h, w = min(block_size, height - r0), min(block_size, width - c0)
                        block = np.full((h, w), RASTER_NODATA, dtype=np.uint8)
                        if tree is not None:
                            hits = np.sort(tree.query(shapely.box(c0, r0, c0 + w, r0 + h)))
                            if hits.size:
                                members = index[hits]
                                rasterize(
                                    [(geoms[i], int(class_ids[i])) for i in members],
                                    out=block,
                                    transform=Affine.translation(c0, r0),
                                )
                        ds.write(block, 1, window=Window(c0, r0, w, h))
            with atomic_path(path, suffix=".tif") as tmp:
                rasterio.shutil.copy(
                    staging,
                    str(tmp),
                    driver="COG",
                    COMPRESS="DEFLATE",
                    BLOCKSIZE=512,
                    OVERVIEW_RESAMPLING="NEAREST",
                    BIGTIFF="IF_SAFER",
                )
    finally:
        if staging is not None:
            Path(staging).unlink(missing_ok=True)
    return path


def _dir(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    return str(path.parent)


def overlay_size(width: int, height: int, max_side: int = OVERLAY_MAX_SIDE) -> tuple[int, int]:
    """(width, height) of an overlay of a ``width`` x ``height`` grid: the long side at most
    ``max_side`` pixels, never enlarged, aspect kept."""
    scale = min(1.0, max_side / float(max(width, height)))
    return max(1, round(width * scale)), max(1, round(height * scale))


def mosaic_preview(mosaic, grid, width: int, height: int) -> np.ndarray:
    """A mosaic warped onto a coarse version of ``grid``: uint8 [height, width, 3].

    Each tile is warped with area averaging (``rasterio.warp.reproject``, GDAL chunks the source
    read, so memory is bounded by the output and GDAL's warp buffer) onto the grid's extent at
    ``width`` x ``height`` pixels; earlier tiles win where they overlap; no data is black.

    Args:
        mosaic: a :class:`data_prep.mosaic.Mosaic` (pre or post).
        grid: the :class:`data_prep.grid.Grid` whose extent the preview covers.
        width, height: preview size in pixels.
    """
    import rasterio
    from affine import Affine
    from rasterio.enums import Resampling
    from rasterio.errors import RasterioError
    from rasterio.warp import reproject

    dx, dy = getattr(mosaic, "offset", (0.0, 0.0))  # a corrected post-to-pre shift
    transform = (
        grid.transform
        @ Affine.translation(dx, dy)
        @ Affine.scale(grid.width / width, grid.height / height)
    )
    rgb = np.zeros((height, width, 3), dtype=np.uint8)
    filled = np.zeros((height, width), dtype=bool)
    for tile in mosaic.tiles:
        dtype = np.dtype(tile.dataset.dtypes[0])
        data = np.zeros((4, height, width), dtype=dtype)
        bands = [1, 2, 3, tile.alpha] if tile.alpha else [1, 2, 3]
        try:
            reproject(
                rasterio.band(tile.dataset, bands),
                data,
                dst_transform=transform,
                dst_crs=grid.crs,
                resampling=Resampling.average,
                src_alpha=4 if tile.alpha else 0,
                dst_alpha=4,
            )
        except RasterioError:
            continue  # a tile that cannot be read leaves its area black in the preview
        valid = data[3] > 0
        bands_rgb = data[:3]  # tiles are uint8 (non-uint8 files through their scaling's VRT)
        take = valid & ~filled
        if take.any():
            rgb[take] = np.moveaxis(bands_rgb, 0, -1)[take].astype(np.uint8)
            filled |= take
    return rgb


def write_overlay(
    path: str | os.PathLike,
    image: np.ndarray,
    pixel_geometries: Sequence,
    class_ids: np.ndarray,
    scale: tuple[float, float],
    class_names: Sequence[str],
    flagged: np.ndarray | None = None,
) -> Path:
    """Draw footprints in class colours over an image, add a legend, write a PNG atomically.

    Args:
        path: output ``.png``.
        image: uint8 [H, W, 3] RGB background (the post image, already downsampled).
        pixel_geometries: [N] footprints in full-resolution grid pixels (None entries ignored).
        class_ids: [N] class id, negative for buildings without a score (grey outline only).
        scale: (sx, sy) from full-resolution grid pixels to ``image`` pixels.
        class_names: names for the legend, in class-id order.
        flagged: [N] bool, buildings with an abstain flag: a thicker :data:`FLAGGED_COLOUR`
            outline over the grade fill, and a legend entry (None: no flags shown).

    Returns:
        The written path.
    """
    import cv2
    import shapely

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise OutputError(f"{path}: the overlay is written as PNG; give a .png path")
    canvas = np.ascontiguousarray(image[..., :3]).copy()
    fill = canvas.copy()
    sx, sy = scale
    shift = 4  # sub-pixel vertex precision for OpenCV drawing (1/16 px)
    outlines: list[tuple[list[np.ndarray], tuple[int, int, int]]] = []
    marked: list[list[np.ndarray]] = []
    flags = np.zeros(len(class_ids), bool) if flagged is None else np.asarray(flagged, bool)
    for geom, cid, flag in zip(pixel_geometries, np.asarray(class_ids), flags, strict=True):
        if geom is None or geom.is_empty:
            continue
        rings = []
        for part in shapely.get_parts(geom):
            if part.geom_type != "Polygon":
                continue
            xy = np.asarray(part.exterior.coords)[:, :2] * (sx, sy) - 0.5
            rings.append(np.round(xy * (1 << shift)).astype(np.int32))
        if not rings:
            continue
        colour = CLASS_COLOURS[int(cid)] if 0 <= cid < len(CLASS_COLOURS) else UNSCORED_COLOUR
        if cid >= 0:
            cv2.fillPoly(fill, rings, colour, lineType=cv2.LINE_AA, shift=shift)
        outlines.append((rings, colour))
        if flag:
            marked.append(rings)
    canvas = cv2.addWeighted(fill, 0.45, canvas, 0.55, 0.0)
    thickness = 1 if max(canvas.shape[:2]) < 1200 else 2
    for rings, colour in outlines:
        cv2.polylines(canvas, rings, True, colour, thickness, lineType=cv2.LINE_AA, shift=shift)
    for rings in marked:
        cv2.polylines(
            canvas, rings, True, FLAGGED_COLOUR, thickness + 1, lineType=cv2.LINE_AA, shift=shift
        )
    canvas = _legend(canvas, class_names, flags=flagged is not None)
    with atomic_path(path, suffix=".png") as tmp:
        ok, encoded = cv2.imencode(".png", cv2.cvtColor(canvas, cv2.COLOR_RGB2BGR))
        if not ok:
            raise OutputError(f"{path}: PNG encoding failed")
        tmp.write_bytes(encoded.tobytes())
    return path


def _legend(canvas: np.ndarray, class_names: Sequence[str], flags: bool = False) -> np.ndarray:
    """The canvas with a legend band below it: one colour swatch and name per class, not scored,
    and (with ``flags``) the outline of flagged buildings."""
    import cv2

    entries = [
        (name, CLASS_COLOURS[k]) for k, name in enumerate(class_names) if k < len(CLASS_COLOURS)
    ]
    entries.append(("not scored", UNSCORED_COLOUR))
    if flags:
        entries.append((FLAGGED_LABEL, FLAGGED_COLOUR))
    height, width = canvas.shape[:2]
    font_scale = 0.45 if width < 1200 else 0.8
    line = int(round(24 * font_scale / 0.45))
    pad = line // 3
    font = cv2.FONT_HERSHEY_SIMPLEX
    sizes = [
        line + pad + cv2.getTextSize(n, font, font_scale, 1)[0][0] + 2 * pad for n, _ in entries
    ]
    rows: list[list[int]] = [[]]
    used = pad
    for k, size in enumerate(sizes):
        if rows[-1] and used + size > width:
            rows.append([])
            used = pad
        rows[-1].append(k)
        used += size
    band = np.full((pad + line * len(rows), width, 3), 255, dtype=np.uint8)
    for r, members in enumerate(rows):
        x, y = pad, pad // 2 + r * line
        for k in members:
            name, colour = entries[k]
            cv2.rectangle(band, (x, y + 4), (x + line - 8, y + line - 4), colour, thickness=-1)
            cv2.rectangle(band, (x, y + 4), (x + line - 8, y + line - 4), (60, 60, 60), 1)
            cv2.putText(
                band,
                name,
                (x + line - 8 + pad, y + int(line * 0.7)),
                font,
                font_scale,
                (20, 20, 20),
                1,
                cv2.LINE_AA,
            )
            x += sizes[k]
    return np.concatenate([canvas, band], axis=0)
