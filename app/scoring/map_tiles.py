"""The imagery of the web map: pre and post images cut into pyramids of 256 px tiles (no torch).

A pyramid holds one layer's tiles at every zoom level from the finest (about the imagery's own
resolution, and at most :data:`MAP_MAX_SIDE` pixels on the long side, so a large scene stays
light) down to the level where the whole image fits one tile; the map's tile layer picks the
level of the zoom it shows and stretches the nearest level beyond them. Tiles that hold no
imagery are left out; the others are lossy WebP images (transparent where part of a tile has no
imagery), as ``data:`` URIs to be written into the map file itself.

- Georeferenced imagery (:func:`scene_pyramids` for a mosaic of GeoTIFF tiles, :func:`array_pyramids`
  for an image pair held in memory): warped onto Web Mercator (EPSG:3857) tiles of the standard
  ``z/x/y`` scheme, so an online basemap lines up with them. A corrected post-to-pre shift
  (:attr:`data_prep.mosaic.Mosaic.offset`) is applied as the scoring applied it.
- Images without georeferencing (:func:`pixel_pyramids`): tiles of Leaflet's ``CRS.Simple``,
  where image pixel ``(col, row)`` is map point ``(col, row)`` at zoom 0 (latitude ``-row``,
  longitude ``col``) and each zoom level down halves the image.
"""

from __future__ import annotations

import base64
import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

#: Side in pixels of a map tile.
TILE = 256
#: Longest side in pixels of the finest level of a pyramid (the imagery is downsampled to it).
MAP_MAX_SIDE = 4096
#: WebP quality of the tiles (0-100).
QUALITY = 80
#: Threads that encode tiles and warp imagery (OpenCV and GDAL release Python's lock).
THREADS = max(1, min(4, os.cpu_count() or 1))
#: Width of the Web Mercator plane in metres (EPSG:3857), 2 pi times the WGS 84 semi-major axis.
MERCATOR_WIDTH = 2 * math.pi * 6378137.0
#: Finest Web Mercator zoom level a pyramid is cut at (about 2 cm per pixel at the equator).
MAX_ZOOM = 23


@dataclass
class Pyramid:
    """The tiles of one image layer.

    Attributes:
        min_zoom, max_zoom: the coarsest and the finest level cut.
        tiles: ``"z/x/y"`` -> ``data:`` URI of the tile's WebP image.
    """

    min_zoom: int
    max_zoom: int
    tiles: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Characters of the tiles' data URIs (what they add to the map file)."""
        return sum(len(v) for v in self.tiles.values())

    def to_dict(self) -> dict:
        return {"minZoom": self.min_zoom, "maxZoom": self.max_zoom, "tiles": self.tiles}


@dataclass
class _Canvas:
    """One level's imagery: ``rgb`` [H, W, 3] and ``valid`` [H, W] whose top-left corner is the
    top-left corner of tile ``(x0, y0)`` at ``zoom``; H and W are multiples of :data:`TILE`."""

    rgb: np.ndarray
    valid: np.ndarray
    zoom: int
    x0: int
    y0: int


@dataclass(frozen=True)
class _Frame:
    """The finest level's canvas on Web Mercator: zoom, top-left tile and size in pixels."""

    zoom: int
    x0: int
    y0: int
    width: int
    height: int

    @property
    def resolution(self) -> float:
        return MERCATOR_WIDTH / (TILE * 2**self.zoom)

    @property
    def transform(self):
        from affine import Affine

        r = self.resolution
        half = MERCATOR_WIDTH / 2
        return Affine(r, 0.0, -half + self.x0 * TILE * r, 0.0, -r, half - self.y0 * TILE * r)


def mercator_frame(crs, transform, width: int, height: int, max_side: int = MAP_MAX_SIDE) -> _Frame:
    """The finest Web Mercator level for a ``width`` x ``height`` grid: the zoom whose pixel is
    nearest the grid's own (on Web Mercator), lowered until the grid's extent fits ``max_side``
    pixels, and the tiles that cover it."""
    from affine import Affine
    from rasterio.warp import transform_bounds

    t = Affine(*transform[:6]) if not isinstance(transform, Affine) else transform
    x0, y0 = t.c, t.f
    x1, y1 = t @ (width, height)
    bounds = (min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1))
    minx, miny, maxx, maxy = transform_bounds(crs, "EPSG:3857", *bounds, densify_pts=21)
    extent = max(maxx - minx, maxy - miny, 1e-6)
    res = min((maxx - minx) / max(width, 1), (maxy - miny) / max(height, 1))
    zoom = min(MAX_ZOOM, max(0, round(math.log2(MERCATOR_WIDTH / (TILE * max(res, 1e-9))))))
    while zoom > 0 and extent / (MERCATOR_WIDTH / (TILE * 2**zoom)) > max_side:
        zoom -= 1
    step = MERCATOR_WIDTH / 2**zoom  # metres per tile
    half = MERCATOR_WIDTH / 2
    n = 2**zoom
    tx0 = min(max(int(math.floor((minx + half) / step)), 0), n - 1)
    tx1 = min(max(int(math.ceil((maxx + half) / step)) - 1, tx0), n - 1)
    ty0 = min(max(int(math.floor((half - maxy) / step)), 0), n - 1)
    ty1 = min(max(int(math.ceil((half - miny) / step)) - 1, ty0), n - 1)
    return _Frame(zoom, tx0, ty0, (tx1 - tx0 + 1) * TILE, (ty1 - ty0 + 1) * TILE)


def lonlat_bounds(crs, transform, width: int, height: int) -> tuple[float, float, float, float]:
    """(west, south, east, north) in degrees of a georeferenced grid."""
    from affine import Affine
    from rasterio.warp import transform_bounds

    t = Affine(*transform[:6]) if not isinstance(transform, Affine) else transform
    x0, y0 = t.c, t.f
    x1, y1 = t @ (width, height)
    box = (min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1))
    return tuple(float(v) for v in transform_bounds(crs, "EPSG:4326", *box, densify_pts=21))


def _shift_vector(grid, offset: tuple[float, float]) -> tuple[float, float]:
    """A shift of ``offset`` grid pixels at the grid's centre, in Web Mercator metres."""
    from rasterio.warp import transform as transform_points

    dx, dy = offset
    t = grid.transform
    cx, cy = t @ (grid.width / 2, grid.height / 2)
    sx, sy = cx + dx * t.a + dy * t.b, cy + dx * t.d + dy * t.e
    xs, ys = transform_points(grid.crs, "EPSG:3857", [cx, sx], [cy, sy])
    return xs[1] - xs[0], ys[1] - ys[0]


def _warp_mosaic(mosaic, grid, frame: _Frame) -> _Canvas:
    """A mosaic's tiles warped onto ``frame`` (area averaging; earlier tiles win on overlaps)."""
    import rasterio
    from affine import Affine
    from rasterio.enums import Resampling
    from rasterio.errors import RasterioError
    from rasterio.warp import reproject

    transform = frame.transform
    offset = getattr(mosaic, "offset", (0.0, 0.0))
    if offset != (0.0, 0.0):  # read where the corrected shift says, as scoring did
        transform = Affine.translation(*_shift_vector(grid, offset)) @ transform
    rgb = np.zeros((frame.height, frame.width, 3), dtype=np.uint8)
    valid = np.zeros((frame.height, frame.width), dtype=bool)
    for tile in mosaic.tiles:
        data = np.zeros((4, frame.height, frame.width), dtype=np.uint8)
        bands = [1, 2, 3, tile.alpha] if tile.alpha else [1, 2, 3]
        try:
            reproject(
                rasterio.band(tile.dataset, bands),
                data,
                dst_transform=transform,
                dst_crs="EPSG:3857",
                resampling=Resampling.average,
                src_alpha=4 if tile.alpha else 0,
                dst_alpha=4,
                num_threads=THREADS,
            )
        except RasterioError:
            continue  # a tile that cannot be read leaves its area empty on the map
        take = (data[3] > 0) & ~valid
        if take.any():
            rgb[take] = np.moveaxis(data[:3], 0, -1)[take]
            valid |= take
    return _Canvas(rgb, valid, frame.zoom, frame.x0, frame.y0)


def _warp_array(image: np.ndarray, crs, transform, frame: _Frame) -> _Canvas:
    """An in-memory uint8 [H, W, 3] image on ``crs``/``transform`` warped onto ``frame``."""
    from rasterio.enums import Resampling
    from rasterio.warp import reproject

    h, w = image.shape[:2]
    src = np.concatenate(
        [np.moveaxis(image[..., :3], -1, 0), np.full((1, h, w), 255, dtype=np.uint8)], axis=0
    )
    data = np.zeros((4, frame.height, frame.width), dtype=np.uint8)
    reproject(
        src,
        data,
        src_transform=transform,
        src_crs=crs,
        dst_transform=frame.transform,
        dst_crs="EPSG:3857",
        resampling=Resampling.average,
        src_alpha=4,
        dst_alpha=4,
    )
    valid = data[3] > 0
    return _Canvas(
        np.ascontiguousarray(np.moveaxis(data[:3], 0, -1)), valid, frame.zoom, frame.x0, frame.y0
    )


def scene_pyramids(scene, max_side: int = MAP_MAX_SIDE) -> tuple[Pyramid, Pyramid]:
    """The pre and post pyramids of a scene (:class:`data_prep.mosaic.Scene`) over its grid."""
    grid = scene.grid
    frame = mercator_frame(grid.crs, grid.transform, grid.width, grid.height, max_side)
    pre = _pyramid(_warp_mosaic(scene.pre, grid, frame))
    post = _pyramid(_warp_mosaic(scene.post, grid, frame))
    return pre, post


def array_pyramids(
    images: Sequence[np.ndarray], crs, transform, max_side: int = MAP_MAX_SIDE
) -> list[Pyramid]:
    """The pyramids of pixel-aligned in-memory images sharing one georeferencing."""
    h, w = images[0].shape[:2]
    frame = mercator_frame(crs, transform, w, h, max_side)
    return [_pyramid(_warp_array(image, crs, transform, frame)) for image in images]


def pixel_zoom(width: int, height: int, max_side: int = MAP_MAX_SIDE) -> int:
    """The finest ``CRS.Simple`` level of an image: 0 (its own pixels), or below 0 until its
    long side fits ``max_side``."""
    zoom = 0
    while max(width, height) * 2.0**zoom > max_side:
        zoom -= 1
    return zoom


def pixel_pyramids(images: Sequence[np.ndarray], max_side: int = MAP_MAX_SIDE) -> list[Pyramid]:
    """The ``CRS.Simple`` pyramids of pixel-aligned images without georeferencing."""
    import cv2

    out = []
    for image in images:
        h, w = image.shape[:2]
        zoom = pixel_zoom(w, h, max_side)
        if zoom < 0:
            size = (max(1, math.ceil(w * 2.0**zoom)), max(1, math.ceil(h * 2.0**zoom)))
            image = cv2.resize(image[..., :3], size, interpolation=cv2.INTER_AREA)
        sh, sw = image.shape[:2]
        ph, pw = math.ceil(sh / TILE) * TILE, math.ceil(sw / TILE) * TILE
        rgb = np.zeros((ph, pw, 3), dtype=np.uint8)
        valid = np.zeros((ph, pw), dtype=bool)
        rgb[:sh, :sw] = image[..., :3]
        valid[:sh, :sw] = True
        out.append(_pyramid(_Canvas(rgb, valid, zoom, 0, 0), min_zoom=zoom - 12))
    return out


def _pyramid(canvas: _Canvas, min_zoom: int = 0) -> Pyramid:
    """Every level from ``canvas`` down to the one that fits a single tile (or ``min_zoom``)."""
    pyramid = Pyramid(canvas.zoom, canvas.zoom)
    while True:
        _cut(canvas, pyramid.tiles)
        pyramid.min_zoom = canvas.zoom
        fits = canvas.rgb.shape[0] <= TILE and canvas.rgb.shape[1] <= TILE
        if fits or canvas.zoom <= min_zoom:
            return pyramid
        canvas = _coarsen(canvas)


def _cut(canvas: _Canvas, tiles: dict[str, str]) -> None:
    """Encode every tile of ``canvas`` that holds imagery into ``tiles``."""
    rows, cols = canvas.rgb.shape[0] // TILE, canvas.rgb.shape[1] // TILE
    todo = []
    for r in range(rows):
        for c in range(cols):
            ys, xs = slice(r * TILE, (r + 1) * TILE), slice(c * TILE, (c + 1) * TILE)
            valid = canvas.valid[ys, xs]
            if valid.any():
                todo.append((f"{canvas.zoom}/{canvas.x0 + c}/{canvas.y0 + r}", ys, xs))
    with ThreadPoolExecutor(THREADS) as pool:
        encoded = pool.map(
            lambda t: encode_tile(canvas.rgb[t[1], t[2]], canvas.valid[t[1], t[2]]), todo
        )
        for (key, _, _), uri in zip(todo, encoded, strict=True):
            tiles[key] = uri


def encode_tile(rgb: np.ndarray, valid: np.ndarray) -> str:
    """A tile as a ``data:`` URI of a lossy WebP image, transparent where it has no imagery.

    WebP (every current browser shows it) keeps a tile at the scene's edge, part imagery and
    part transparent, at about a fifteenth of its size as PNG, and a full tile at about 60% of
    its size as JPEG of the same quality.
    """
    import cv2

    bgra = np.dstack([cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), np.where(valid, 255, 0)])
    ok, data = cv2.imencode(".webp", bgra.astype(np.uint8), [cv2.IMWRITE_WEBP_QUALITY, QUALITY])
    if not ok:
        raise ValueError("tile encoding failed")
    return "data:image/webp;base64," + base64.b64encode(data.tobytes()).decode("ascii")


def _coarsen(canvas: _Canvas) -> _Canvas:
    """The next level down: padded to whole tiles of the coarser level, then halved by area
    averaging over the pixels that hold imagery."""
    import cv2

    left, top = canvas.x0 % 2, canvas.y0 % 2
    h, w = canvas.rgb.shape[:2]
    tiles_w, tiles_h = left + w // TILE, top + h // TILE
    width, height = (tiles_w + tiles_w % 2) * TILE, (tiles_h + tiles_h % 2) * TILE
    weight = np.zeros((height, width), dtype=np.float32)
    total = np.zeros((height, width, 3), dtype=np.float32)
    ys, xs = slice(top * TILE, top * TILE + h), slice(left * TILE, left * TILE + w)
    weight[ys, xs] = canvas.valid
    total[ys, xs] = canvas.rgb * canvas.valid[..., None]
    half = (width // 2, height // 2)
    weight = cv2.resize(weight, half, interpolation=cv2.INTER_AREA)
    total = cv2.resize(total, half, interpolation=cv2.INTER_AREA)
    valid = weight > 0.25
    rgb = np.where(valid[..., None], total / np.maximum(weight, 1e-6)[..., None], 0)
    rgb = np.clip(np.rint(rgb), 0, 255).astype(np.uint8)
    return _Canvas(rgb, valid, canvas.zoom - 1, (canvas.x0 - left) // 2, (canvas.y0 - top) // 2)
