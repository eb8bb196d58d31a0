"""Virtual mosaics of georeferenced tiles on one pixel grid, read one window at a time.

A scene is a set of pre-disaster tiles and a set of post-disaster tiles, each set possibly in
several CRS and resolutions. :func:`open_scene` puts both on one target grid, the *pre grid*
(:func:`data_prep.grid.pre_grid`).

Nothing is mosaicked in memory. :meth:`Mosaic.read` warps each tile that meets a window onto that
window (one ``rasterio.warp.reproject`` per tile and window from the open dataset, bilinear, with a
destination alpha band), so only the source pixels under the window are read. A warped pixel does
not depend on the window it was read in, up to one grey level of resampling rounding (a warped
VRT read in internal blocks can differ far more at its block edges, which is why it is not used).
Where tiles overlap, the earlier tile in the given order wins. A pixel is valid where some tile has data there: inside the tile, not nodata, not masked, not
zero alpha. Outside every tile the window is zero filled and invalid.

Rasters that are not uint8 (11/16-bit or float products) are mapped to uint8 by the radiometric
rule of :mod:`data_prep.radiometry`, decided once per scene when it is opened (the stretch, where
one is needed, over the pre and post tiles together) and applied to the source pixels through a
VRT before any warping, so every window of a scene is scaled alike and a x257 or /255 copy of an
8-bit tile reads exactly as the original.

Guards: a tile whose internal blocks exceed the pixel limit (:func:`data_prep.quality.max_pixels`)
is refused when opened, and so is a window larger than the limit; a large tile read in windows
is not refused for its size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from data_prep import radiometry
from data_prep.errors import LocalDamageError, not_found
from data_prep.grid import Grid, affine_geometries, pre_grid, reproject_geometries
from data_prep.imagery import ImageError, check_png_complete
from data_prep.nodata_free import open_nodata_free
from data_prep.quality import max_pixels as pixel_limit
from data_prep.quality import pixel_limit_problem
from data_prep.radiometry import Scaling
from data_prep.report import Skipped

if TYPE_CHECKING:
    import shapely


#: Largest distance, in pixels, of a window's offset from whole pixels for it to be read from a
#: tile on the same grid without warping (:meth:`Tile.read_warped`).
ALIGNED_TOLERANCE = 1e-6


class SceneError(LocalDamageError, ValueError):
    """An input that makes a scene or one of its tiles unusable.

    Attributes:
        item: the file (or input) at fault.
        reason: what is wrong with it and, where possible, what to do.
    """

    def __init__(self, item: str | os.PathLike, reason: str):
        self.item = str(item)
        self.reason = reason
        super().__init__(f"{self.item}: {reason}")


@dataclass
class Tile:
    """One open GeoTIFF of a mosaic.

    Attributes:
        path: the file.
        dataset: the open rasterio dataset.
        alpha: 1-based index of the source alpha band, 0 when it has none.
        footprint: the tile's extent as a polygon in the grid CRS (set by :func:`open_scene`).
        scaling: how its pixel values map to uint8 (:mod:`data_prep.radiometry`); None while a
            non-uint8 tile waits for the scene's joint stretch.
        sample: valid values of bands 1-3 drawn when opening a non-uint8 tile, for the stretch.
        source: the file's own dataset once ``dataset`` is the uint8 VRT over it, else None.
    """

    path: str
    dataset: object
    alpha: int = 0
    footprint: shapely.Geometry | None = None
    scaling: Scaling | None = None
    sample: np.ndarray | None = None
    source: object | None = None
    _plain: bool | None = field(default=None, repr=False)
    _same_crs: object | None = field(default=None, repr=False)
    _warp_from: object | None = field(default=None, repr=False)

    def use_scaling(self, scaling: Scaling) -> None:
        """Show the tile as uint8 through ``scaling`` (a VRT over the file; uint8 tiles as is)."""
        import rasterio

        self.scaling = scaling
        if scaling.rule == radiometry.UINT8 or self.source is not None:
            return
        xml, alpha = radiometry.scaled_vrt(self.dataset, scaling, self.alpha)
        self.source, self.dataset, self.alpha = self.dataset, rasterio.open(xml), alpha

    @property
    def crs(self):
        return self.dataset.crs

    def source_footprint(self):
        """The tile's extent as a polygon in its own CRS, edges densified for reprojection."""
        import shapely

        ds = self.dataset
        w, h = ds.width, ds.height
        ring = shapely.segmentize(shapely.box(0, 0, w, h), max(w, h) / 32.0)
        return affine_geometries(np.array([ring], dtype=object), ds.transform)[0]

    def read_warped(self, crs, transform, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
        """Warp the tile onto a window: uint8 [height, width, 3] RGB and bool [height, width] valid.

        One GDAL warp per call (``rasterio.warp.reproject`` from the open dataset, bilinear): only
        the source pixels under the window are read. A pixel's value depends a little on the
        window it is read in: GDAL approximates the transformation to within 0.125 source pixels
        along each row of the window, which moves a grey value by up to one level on smooth
        imagery and by more at sharp edges (17 levels on 3,409 pixels of one 128 px block of the
        synthetic scene, read alone and inside the whole scene).
        """
        import rasterio
        from rasterio.enums import Resampling
        from rasterio.warp import reproject

        if self.dataset.dtypes[0] != "uint8":  # read outside a scene: the rule from this tile
            self.use_scaling(self.scaling or radiometry.joint_stretch([self.sample]))
        at = self._aligned(crs, transform)
        if at is not None:
            return self._read_aligned(at[0], at[1], width, height)
        data = np.zeros((4, height, width), dtype=np.uint8)
        if self._warp_from is None:  # a tile holding no pixel of its nodata value: warped
            # without it, the same pixels at a fraction of the cost (data_prep.nodata_free)
            free = open_nodata_free(self.dataset, self.alpha) if self.source is None else None
            self._warp_from = self.dataset if free is None else free
        reproject(
            rasterio.band(self._warp_from, [1, 2, 3, self.alpha] if self.alpha else [1, 2, 3]),
            data,
            dst_transform=transform,
            dst_crs=crs,
            resampling=Resampling.bilinear,
            src_alpha=4 if self.alpha else 0,
            dst_alpha=4,
        )
        valid = data[3] > 0
        return _interleave(data), valid

    def _aligned(self, crs, transform) -> tuple[int, int] | None:
        """The window's top-left pixel in the tile when the window lies on the tile's own pixel
        grid (same CRS and pixel size, a whole-pixel offset) and every pixel of the tile is
        valid (uint8, three bands, no nodata, mask or alpha); None otherwise.

        On such a window the bilinear warp of :meth:`read_warped` samples every source pixel at
        its centre, so it returns the source pixels themselves: a plain windowed read gives the
        same array at a fraction of the cost (``tests/data_prep/test_block_scoring.py`` holds the
        two equal, on real tiles too)."""
        ds = self.dataset
        t = ds.transform
        if (
            transform.b
            or transform.d
            or t.b
            or t.d
            or transform.a != t.a
            or transform.e != t.e
            or self.alpha
            or self.source is not None
        ):
            return None
        col, row = (transform.c - t.c) / t.a, (transform.f - t.f) / t.e
        if abs(col - round(col)) > ALIGNED_TOLERANCE or abs(row - round(row)) > ALIGNED_TOLERANCE:
            return None
        if self._plain is None:
            from rasterio.enums import MaskFlags

            self._plain = bool(
                ds.count == 3
                and ds.nodata is None
                and all(dt == "uint8" for dt in ds.dtypes)
                and all(list(f) == [MaskFlags.all_valid] for f in ds.mask_flag_enums)
            )
        if not self._plain:
            return None
        if crs is not self._same_crs:  # compared once per CRS object (the scene's grid CRS)
            if ds.crs != crs:
                return None
            self._same_crs = crs
        return int(round(col)), int(round(row))

    def _read_aligned(self, col: int, row: int, width: int, height: int):
        """:meth:`read_warped` of a window at whole pixel ``(col, row)`` of the tile's own grid
        (:meth:`_aligned`): the part inside the tile read as it is, zero and invalid around."""
        from rasterio.windows import Window

        ds = self.dataset
        c0, r0 = max(col, 0), max(row, 0)
        c1, r1 = min(col + width, ds.width), min(row + height, ds.height)
        if (c0, r0, c1, r1) == (col, row, col + width, row + height):
            data = ds.read([1, 2, 3], window=Window(col, row, width, height))
            return _interleave(data), np.ones((height, width), dtype=bool)
        rgb = np.zeros((height, width, 3), dtype=np.uint8)
        valid = np.zeros((height, width), dtype=bool)
        if c1 > c0 and r1 > r0:
            data = ds.read([1, 2, 3], window=Window(c0, r0, c1 - c0, r1 - r0))
            ys, xs = slice(r0 - row, r1 - row), slice(c0 - col, c1 - col)
            rgb[ys, xs] = _interleave(data)
            valid[ys, xs] = True
        return rgb, valid

    def close(self) -> None:
        if self._warp_from is not None and self._warp_from is not self.dataset:
            self._warp_from.close()
        self.dataset.close()
        if self.source is not None:
            self.source.close()


def _interleave(bands: np.ndarray) -> np.ndarray:
    """uint8 ``[H, W, 3]`` of bands 1-3 of a band-first ``[B, H, W]`` array (OpenCV's merge:
    the same array as ``np.moveaxis``, copied some 30 times faster)."""
    import cv2

    return cv2.merge([np.ascontiguousarray(bands[i]) for i in range(3)])


def open_tile(path: str | os.PathLike, max_pixels: int | None = None) -> Tile:
    """Open one GeoTIFF for a scene, refusing what cannot be mosaicked.

    Raises:
        SceneError: naming the file, when it is missing, unreadable, corrupt or truncated, has no
            CRS or geotransform, has other than 3 bands (or 4: RGBA, or RGB plus NIR which is
            ignored), has a pixel type that cannot be scaled to uint8, or internal blocks larger
            than the pixel limit.
    """
    import warnings

    import rasterio
    from rasterio.enums import ColorInterp
    from rasterio.errors import NotGeoreferencedWarning, RasterioError

    path = str(path)
    limit = pixel_limit(max_pixels)
    if not os.path.exists(path):
        raise SceneError(path, not_found(path))
    try:
        check_png_complete(path)
    except ImageError as exc:
        raise SceneError(path, str(exc)[len(f"{path}: ") :]) from exc
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGeoreferencedWarning)
            ds = rasterio.open(path)
    except RasterioError as exc:
        raise SceneError(path, f"cannot be read as a raster ({exc})") from exc
    try:
        if ds.crs is None:
            raise SceneError(
                path,
                "has no CRS (not georeferenced); scene mode needs georeferenced GeoTIFFs "
                "(assign one, e.g. `gdal_edit.py -a_srs EPSG:XXXX`, or use `prepare xbd` for "
                "pixel-aligned pairs)",
            )
        if ds.transform.is_identity:
            raise SceneError(
                path, "has a CRS but no geotransform; scene mode needs georeferenced GeoTIFFs"
            )
        if ds.count not in (3, 4):
            raise SceneError(
                path,
                f"has {ds.count} band(s); an RGB image with 3 bands (or 4: RGBA, or RGB plus NIR, "
                "the 4th is dropped) is required",
            )
        alpha = 0
        for i, ci in enumerate(ds.colorinterp, start=1):
            if ci == ColorInterp.alpha:
                alpha = i
        if alpha in (1, 2, 3):
            raise SceneError(
                path, f"band {alpha} is an alpha band; bands 1-3 must be red, green, blue"
            )
        dtype = np.dtype(ds.dtypes[0])
        if not (np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating)):
            raise SceneError(path, f"unsupported pixel type {dtype}")
        block_h, block_w = ds.block_shapes[0]
        problem = pixel_limit_problem(block_w, block_h, limit, "an internal block")
        if problem:
            raise SceneError(
                path,
                f"{problem}; a scene is read in windows, so retile the file "
                "(e.g. `gdal_translate -co TILED=YES`)",
            )
        # A small decimated read reaches blocks across the file: truncated or corrupt data fails
        # here rather than half way through a run.
        ds.read(1, out_shape=(min(ds.height, 64), min(ds.width, 64)))
        scaling, sample = radiometry.IDENTITY, None
        if dtype != np.uint8:
            sample = radiometry.sample_values(ds, alpha)
            scaling = radiometry.choose_scaling(
                dtype, radiometry.declared_bits(ds), sample, radiometry.probe_values(ds, alpha)
            )
    except RasterioError as exc:
        ds.close()
        raise SceneError(
            path, f"cannot be read, the file looks corrupt or truncated ({exc})"
        ) from exc
    except BaseException:
        ds.close()
        raise
    return Tile(path=path, dataset=ds, alpha=alpha, scaling=scaling, sample=sample)


class Mosaic:
    """Tiles of one acquisition (pre or post) read as one raster on a :class:`data_prep.grid.Grid`.

    Attributes:
        name: "pre" or "post", used in messages.
        grid: the target grid.
        tiles: the tiles in order of precedence (earlier wins where they overlap).
        coverage: union of the tile footprints in the grid CRS (moved with :attr:`offset`).
        offset: ``(dx, dy)`` grid pixels the tiles are read shifted by (:meth:`set_offset`).
        skipped: tiles dropped after a read failure, with the reason.
    """

    def __init__(self, name: str, tiles: list[Tile], grid: Grid, max_pixels: int | None = None):
        import shapely

        self.max_pixels = pixel_limit(max_pixels)
        self.name = name
        self.grid = grid
        self.tiles = list(tiles)
        self.skipped: list[Skipped] = []
        groups: dict[str, list[Tile]] = {}
        for tile in self.tiles:
            groups.setdefault(tile.crs.to_wkt(), []).append(tile)
        parts = []
        for tiles_in_crs in groups.values():
            crs = tiles_in_crs[0].crs
            footprints = reproject_geometries(
                np.array([t.source_footprint() for t in tiles_in_crs], dtype=object), crs, grid.crs
            )
            for tile, fp in zip(tiles_in_crs, footprints, strict=True):
                tile.footprint = shapely.make_valid(fp)
            # The union is formed in the tiles' own CRS, where neighbours share edges exactly,
            # then densified and reprojected, so it has no slivers along tile seams.
            merged = shapely.union_all([t.source_footprint() for t in tiles_in_crs])
            minx, miny, maxx, maxy = merged.bounds
            merged = shapely.segmentize(merged, max(maxx - minx, maxy - miny) / 256.0)
            parts.append(reproject_geometries(np.array([merged], dtype=object), crs, grid.crs)[0])
        self.coverage = shapely.make_valid(shapely.union_all(parts)) if parts else shapely.Polygon()
        self._georeferenced_coverage = self.coverage
        self.offset = (0.0, 0.0)

    def set_offset(self, dx: float, dy: float) -> None:
        """Read the tiles as if their georeferencing were moved by ``(-dx, -dy)`` grid pixels.

        After this, what the tiles place at grid pixel ``(x + dx, y + dy)`` is read at ``(x, y)``:
        the correction of a measured post-to-pre shift (:mod:`data_prep.alignment`). Applied in
        the warp of every read (sub-pixel, one resampling), and to :attr:`coverage`.
        """
        import shapely

        t = self.grid.transform
        self.offset = (float(dx), float(dy))
        xoff, yoff = -(dx * t.a + dy * t.b), -(dx * t.d + dy * t.e)
        self.coverage = shapely.transform(
            self._georeferenced_coverage, lambda xy: xy + np.array([xoff, yoff])
        )

    @property
    def paths(self) -> list[str]:
        return [t.path for t in self.tiles]

    def read(
        self, col_off: int, row_off: int, width: int, height: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Read a window of the grid (it may extend beyond the grid).

        Args:
            col_off, row_off: top-left pixel of the window in grid pixels.
            width, height: window size in pixels.

        Returns:
            ``(rgb, valid)``: uint8 [height, width, 3], zero where no tile has data, and bool
            [height, width].

        Raises:
            SceneError: a window of more pixels than the mosaic's pixel limit.
        """
        import cv2
        import shapely
        from rasterio.errors import RasterioError

        problem = pixel_limit_problem(width, height, self.max_pixels, "a read window")
        if problem:
            raise SceneError(f"{self.name} imagery ({', '.join(self.paths)})", problem)

        dx, dy = self.offset
        if dx or dy:
            from affine import Affine

            transform = self.grid.window_transform(col_off, row_off) @ Affine.translation(dx, dy)
        else:
            transform = self.grid.window_transform(col_off, row_off)
        x0, y1 = transform.c, transform.f
        x1, y0 = transform @ (width, height)
        window_box = shapely.box(min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1))
        rgb = np.zeros((height, width, 3), dtype=np.uint8)
        valid = np.zeros((height, width), dtype=bool)
        empty = True  # no tile has given a pixel yet
        for tile in list(self.tiles):
            if tile.footprint is None or not tile.footprint.intersects(window_box):
                continue
            try:
                tile_rgb, tile_valid = tile.read_warped(self.grid.crs, transform, width, height)
            except RasterioError as exc:
                self.tiles.remove(tile)
                self.skipped.append(
                    Skipped(
                        tile.path,
                        f"read failed, tile dropped from the {self.name} mosaic for the rest of the run ({exc})",
                    )
                )
                tile.close()
                continue
            take = tile_valid if empty else tile_valid & ~valid
            if take.any():
                if empty and take.all():
                    return tile_rgb, take  # the first tile covers the whole window
                # OpenCV's masked copy: numpy's with a broadcast mask costs 80 times more
                cv2.copyTo(tile_rgb, np.ascontiguousarray(take).view(np.uint8), rgb)
                valid |= take
                empty = False
                if valid.all():
                    break
        return rgb, valid

    def close(self) -> None:
        for tile in self.tiles:
            tile.close()


@dataclass
class Scene:
    """Pre and post mosaics on the pre grid; close it (or use ``with``) to release the files.

    Attributes:
        grid: the pre grid (CRS, transform, size).
        pre, post: the two mosaics.
        skipped: tiles that could not be used, with the reason.
    """

    grid: Grid
    pre: Mosaic
    post: Mosaic
    skipped: list[Skipped] = field(default_factory=list)
    _kept: tuple | None = field(default=None, init=False, repr=False)

    @property
    def coverage(self):
        """Where both pre and post tiles exist (polygon in the grid CRS)."""
        return self.pre.coverage.intersection(self.post.coverage)

    def read_pair(self, col_off: int, row_off: int, width: int, height: int, keep: bool = False):
        """Read the same window from pre and post.

        With ``keep`` the arrays are kept for the next read: when it asks for the same window
        with the mosaics' offsets unchanged it gets them (the same objects, not read again, so
        whoever holds them first must not write into them), and keeps them again if it too
        asks to keep them; any other read forgets them.

        Returns:
            ``(pre_rgb, pre_valid, post_rgb, post_valid)`` as in :meth:`Mosaic.read`.
        """
        key = (col_off, row_off, width, height, self.pre.offset, self.post.offset)
        kept, self._kept = self._kept, None
        if kept is not None and kept[0] == key:
            if keep:
                self._kept = kept
            return kept[1]
        pre_rgb, pre_valid = self.pre.read(col_off, row_off, width, height)
        post_rgb, post_valid = self.post.read(col_off, row_off, width, height)
        pair = (pre_rgb, pre_valid, post_rgb, post_valid)
        if keep:
            self._kept = (key, pair)
        return pair

    @property
    def max_pixels(self) -> int:
        return self.pre.max_pixels

    def open_files(self) -> dict[str, object]:
        """Each tile still in the scene, by path: the file as rasterio opened it (for a tile read
        through a uint8 VRT, the file's own dataset)."""
        return {
            t.path: t.source if t.source is not None else t.dataset
            for t in (*self.pre.tiles, *self.post.tiles)
        }

    def radiometry(self) -> dict[str, str]:
        """How each tile's pixel values map to uint8 (file -> rule), for reports and metadata."""
        return {t.path: t.scaling.describe() for t in [*self.pre.tiles, *self.post.tiles]}

    def all_skipped(self) -> list[Skipped]:
        """Tiles refused when opening plus tiles dropped after a read failure."""
        return [*self.skipped, *self.pre.skipped, *self.post.skipped]

    def close(self) -> None:
        self._kept = None
        self.pre.close()
        self.post.close()

    def __enter__(self) -> Scene:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open_tiles(paths, skipped: list[Skipped], max_pixels: int | None) -> list[Tile]:
    tiles = []
    for path in paths:
        try:
            tiles.append(open_tile(path, max_pixels))
        except SceneError as exc:
            skipped.append(Skipped(exc.item, exc.reason))
    return tiles


def open_scene(pre_paths, post_paths, max_pixels: int | None = None) -> Scene:
    """Open pre and post tiles as two virtual mosaics on the pre grid.

    Tiles that cannot be used are left out and listed in ``Scene.skipped``. Non-uint8 tiles are
    scaled by the radiometric rule (:func:`data_prep.radiometry.scene_scalings`, pre and post
    together).

    Args:
        pre_paths: pre-disaster GeoTIFF tiles, in order of precedence where they overlap.
        post_paths: post-disaster GeoTIFF tiles, likewise.
        max_pixels: pixel limit per internal block and per read window (default
            :func:`data_prep.quality.max_pixels`).

    Returns:
        An open :class:`Scene`.

    Raises:
        SceneError: when no pre or no post tile is usable, or pre and post do not overlap.
    """
    max_pixels = pixel_limit(max_pixels)
    pre_skipped: list[Skipped] = []
    post_skipped: list[Skipped] = []
    pre_tiles = _open_tiles(pre_paths, pre_skipped, max_pixels)
    post_tiles = _open_tiles(post_paths, post_skipped, max_pixels)
    skipped = pre_skipped + post_skipped
    try:
        groups = (
            ("pre", pre_paths, pre_tiles, pre_skipped),
            ("post", post_paths, post_tiles, post_skipped),
        )
        unusable = [
            f"none of the {len(paths)} {name} tile(s) can be used "
            f"({'; '.join(str(s) for s in own) or 'no files given'})"
            for name, paths, tiles, own in groups
            if not tiles
        ]
        if unusable:  # each date's files under its own name, both when neither can be used
            name = "pre" if not pre_tiles else "post"
            raise SceneError(f"{name} imagery", "; ".join(unusable))
        radiometry.scene_scalings([*pre_tiles, *post_tiles])
        grid = pre_grid(pre_tiles)
        pre = Mosaic("pre", pre_tiles, grid, max_pixels)
        post = Mosaic("post", post_tiles, grid, max_pixels)
    except BaseException:
        for tile in [*pre_tiles, *post_tiles]:
            tile.close()
        raise
    scene = Scene(grid=grid, pre=pre, post=post, skipped=skipped)
    if scene.coverage.area <= 0:
        scene.close()
        raise SceneError(
            "post imagery",
            f"the post tiles ({', '.join(post.paths)}) do not overlap the pre tiles "
            f"({', '.join(pre.paths)}): pre bounds {_fmt_bounds(pre.coverage.bounds)}, post bounds "
            f"{_fmt_bounds(post.coverage.bounds)} in {grid.crs.to_string()}",
        )
    return scene


def _fmt_bounds(bounds) -> str:
    return "(" + ", ".join(f"{v:.6g}" for v in bounds) + ")"
