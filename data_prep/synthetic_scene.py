"""A small seeded georeferenced scene for tests and examples (synthetic imagery, not real data).

:func:`make_scene` writes:

- ``pre/pre_west.tif``, ``pre/pre_east.tif``: two 256 x 256 RGB tiles side by side in
  EPSG:32615 (UTM 15N) at 0.5 m, 256 m x 128 m in all.
- ``post/post_north.tif``, ``post/post_south.tif``: two RGB tiles in EPSG:4326 at 5e-6 degrees
  (about 0.44 m x 0.56 m) stacked north-south. They cover the pre area except a strip of about
  50 m along its east side, and declare nodata 0 with a small nodata hole over one building.
- ``buildings.geojson`` (CRS84) and ``buildings.gpkg`` (EPSG:3857): the same 40 building polygons
  with ``uid`` and ``damage`` attributes (class names in the GeoJSON, 0-3 in the GeoPackage).

Every pixel is rendered from its ground position (pixel centre -> UTM metres), so pre and post
line up exactly once post is warped onto the pre grid. Post shows each building according to its
class: unchanged (no-damage), tarps (minor), half the roof in rubble (major), rubble over the
whole footprint and around it (destroyed). Buildings are laid out so that which of them lie fully
inside both pre and post is known by construction: 32 are covered (one straddles the two pre
tiles, eight straddle the two post tiles), 8 are not (4 in the strip outside post, 1 across the
post edge, 1 across the pre edge, 1 outside the imagery, 1 under the nodata hole).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.grid import reproject_geometries
from data_prep.spec import CLASS_NAMES

PRE_CRS = "EPSG:32615"
POST_CRS = "EPSG:4326"
PRE_RES = 0.5
POST_RES = 5e-6
TILE_PX = 256
X0, Y_TOP = 362000.0, 4102000.0
PRE_WIDTH_M = 2 * TILE_PX * PRE_RES
PRE_HEIGHT_M = TILE_PX * PRE_RES
#: UTM rectangle that the post tiles must contain (their lon/lat box is its bounding box).
POST_UTM = (X0 - 10.0, Y_TOP - PRE_HEIGHT_M - 10.0, X0 + 205.0, Y_TOP + 10.0)
LABEL_FIELD = "damage"


@dataclass(frozen=True)
class SceneFixture:
    """Paths of a synthetic scene and the numbers a correct pipeline must reproduce.

    Attributes:
        root: folder holding everything.
        pre, post: the GeoTIFF tiles.
        buildings: GeoJSON footprints (CRS84), ``damage`` as class names.
        buildings_gpkg: the same footprints as a GeoPackage in EPSG:3857, ``damage`` as 0-3.
        label_field: the attribute holding the damage label.
        n_buildings: features in each footprint file.
        covered: buildings entirely inside valid pre and post data.
        not_covered: the others.
        per_class: covered buildings per class name.
        covered_uids: uids of the covered buildings.
        no_damage_uids: uids of covered no-damage buildings (identical roofs pre and post).
        lonlat_bounds: (west, south, east, north) of the pre imagery in degrees.
    """

    root: Path
    pre: tuple[Path, ...]
    post: tuple[Path, ...]
    buildings: Path
    buildings_gpkg: Path
    label_field: str
    n_buildings: int
    covered: int
    not_covered: int
    per_class: dict
    covered_uids: tuple[str, ...]
    no_damage_uids: tuple[str, ...]
    lonlat_bounds: tuple[float, float, float, float]


@dataclass(frozen=True)
class _Building:
    uid: str
    polygon: object  # shapely Polygon in UTM metres
    label: int
    covered: bool
    roof: tuple[int, int, int]


def _transformer(src: str, dst: str):
    from pyproj import Transformer

    return Transformer.from_crs(src, dst, always_xy=True)


def _rect(cx: float, cy: float, w: float, h: float, angle: float):
    import shapely
    from shapely import affinity

    return affinity.rotate(
        shapely.box(cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2), angle, origin=(cx, cy)
    )


def _hash01(x: np.ndarray, y: np.ndarray, cell: float, salt: int) -> np.ndarray:
    """Deterministic value noise in [0, 1) on ground cells of ``cell`` metres."""
    ix = np.floor(x / cell).astype(np.int64)
    iy = np.floor(y / cell).astype(np.int64)
    h = (ix * 73856093) ^ (iy * 19349663) ^ np.int64(salt * 83492791)
    h = (h.astype(np.uint64) * np.uint64(2654435761)) % np.uint64(2**32)
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(1274126177)) % np.uint64(2**32)
    return h.astype(np.float64) / 2**32


def _layout(rng: np.random.Generator) -> list[_Building]:
    """Building polygons in UTM with whether each is covered by both pre and post."""
    east_edge = _post_east_edge()
    spots = []  # (cx, cy, w, h, angle, covered)
    for cy in (4101885.0, 4101910.0, 4101935.0, 4101960.0):
        for k in range(8):
            spots.append(
                (
                    X0 + 20.0 + 24.0 * k + rng.uniform(-2, 2),
                    cy + rng.uniform(-2, 2),
                    rng.uniform(6, 12),
                    rng.uniform(6, 12),
                    rng.uniform(0, 25),
                    True,
                )
            )
    for cy in (4101885.0, 4101910.0, 4101935.0, 4101960.0):
        spots.append(
            (
                X0 + 232.0 + rng.uniform(-2, 2),
                cy + rng.uniform(-2, 2),
                rng.uniform(6, 12),
                rng.uniform(6, 12),
                rng.uniform(0, 25),
                False,
            )
        )
    spots.append((X0 + 128.0, 4101985.0, 10.0, 8.0, 0.0, True))  # across the two pre tiles
    spots.append((east_edge(4101985.0), 4101985.0, 10.0, 8.0, 0.0, False))  # across the post edge
    spots.append((X0 + PRE_WIDTH_M, 4101985.0, 10.0, 8.0, 0.0, False))  # across the pre edge
    spots.append((X0 + 290.0, 4101940.0, 10.0, 10.0, 0.0, False))  # outside the imagery
    hole = 3  # the 4th building of the first row lies under the post nodata hole
    spots[hole] = (*spots[hole][:5], False)

    n_cov = sum(s[5] for s in spots)
    covered_labels = list(rng.permutation(np.resize(np.arange(len(CLASS_NAMES)), n_cov)))
    buildings = []
    for i, (cx, cy, w, h, angle, covered) in enumerate(spots):
        label = int(covered_labels.pop()) if covered else int(rng.integers(0, len(CLASS_NAMES)))
        roof = tuple(int(v) for v in rng.integers(120, 230, size=3))
        buildings.append(_Building(f"b{i:03d}", _rect(cx, cy, w, h, angle), label, covered, roof))
    return buildings


def _post_box() -> tuple[float, float, float, float]:
    """(west, south, east, north) in degrees of the post tiles, snapped to POST_RES."""
    minx, miny, maxx, maxy = POST_UTM
    lon, lat = _transformer(PRE_CRS, POST_CRS).transform(
        np.array([minx, maxx, maxx, minx]), np.array([miny, miny, maxy, maxy])
    )
    west = np.floor(lon.min() / POST_RES) * POST_RES
    east = np.ceil(lon.max() / POST_RES) * POST_RES
    south = np.floor(lat.min() / POST_RES) * POST_RES
    north = np.ceil(lat.max() / POST_RES) * POST_RES
    return float(west), float(south), float(east), float(north)


def _post_east_edge():
    """UTM easting of the post east edge as a function of northing."""
    west, south, east, north = _post_box()
    to_utm = _transformer(POST_CRS, PRE_CRS)
    lats = np.linspace(south, north, 50)
    xs, ys = to_utm.transform(np.full_like(lats, east), lats)

    def edge(northing: float) -> float:
        return float(np.interp(northing, ys, xs))

    return edge


def render(
    x: np.ndarray, y: np.ndarray, buildings: list[_Building], post: bool, hole=None
) -> np.ndarray:
    """RGB uint8 [N, 3] of ground points (UTM metres) before or after the event.

    Values are 1-255 (0 is nodata); points inside ``hole`` (a shapely polygon) are 0 after.
    """
    import shapely
    from shapely import affinity

    tex = 10.0 * np.sin(x / 7.3 + 0.5) * np.cos(y / 5.1) + 7.0 * np.sin((x + y) / 13.7)
    tex += 14.0 * (_hash01(x, y, 1.0, 1) - 0.5)
    rgb = np.column_stack([78 + tex, 104 + 1.1 * tex, 58 + 0.6 * tex])
    for road_y in (4101897.5, 4101922.5, 4101947.5, 4101972.5):
        on = np.abs(y - road_y) < 1.5
        rgb[on] = 128 + 6.0 * (_hash01(x[on], y[on], 0.5, 2)[:, None] - 0.5)

    def inside(poly) -> np.ndarray:
        minx, miny, maxx, maxy = poly.bounds
        sel = np.flatnonzero((x >= minx) & (x <= maxx) & (y >= miny) & (y <= maxy))
        mask = np.zeros(x.shape, dtype=bool)
        if sel.size:
            mask[sel] = shapely.contains_xy(poly, x[sel], y[sel])
        return mask

    for b in buildings:
        damage = b.label if post else 0
        footprint = b.polygon
        shadow = inside(affinity.translate(footprint, 0.8, -0.8)) & ~inside(footprint)
        roof = inside(footprint)
        c = footprint.centroid
        if damage < 3:
            rgb[shadow] *= 0.55
            side = ((x[roof] - c.x) * 0.6 + (y[roof] - c.y) * 0.8) > 0  # two roof faces
            rgb[roof] = np.array(b.roof, dtype=np.float64) * np.where(side, 1.0, 0.82)[:, None]
        if damage == 1:
            for dx, dy in ((1.2, 0.8), (-1.5, -1.0)):
                tarp = inside(shapely.Point(c.x + dx, c.y + dy).buffer(1.2))
                rgb[tarp] = (40, 80, 170)
        elif damage >= 2:
            zone = footprint if damage == 2 else footprint.buffer(1.5)
            hit = inside(zone)
            if damage == 2:
                hit &= (x - c.x) * 0.8 - (y - c.y) * 0.6 > 0
            noise = _hash01(x[hit], y[hit], 0.5, 3 + int(b.uid[1:]))
            rgb[hit] = np.column_stack([90 + 110 * noise, 80 + 100 * noise, 70 + 80 * noise])
    if post:
        rgb = rgb * 0.92 + 10.0
    out = np.clip(np.rint(rgb), 1, 255).astype(np.uint8)
    if post and hole is not None:
        out[inside(hole)] = 0
    return out


def write_tile(
    path: Path, rgb: np.ndarray, crs: str | None, transform, nodata: float | None = None
) -> Path:
    """Write a band-last [H, W, C] array as a GeoTIFF (no CRS/transform when ``crs`` is None)."""
    import warnings

    import rasterio
    from rasterio.errors import NotGeoreferencedWarning

    path.parent.mkdir(parents=True, exist_ok=True)
    height, width, count = rgb.shape
    profile = {
        "driver": "GTiff",
        "width": width,
        "height": height,
        "count": count,
        "dtype": rgb.dtype.name,
    }
    if crs is not None:
        profile.update(crs=crs, transform=transform)
    if nodata is not None:
        profile["nodata"] = nodata
    if count in (3, 4) and rgb.dtype == np.uint8:
        profile["photometric"] = "RGB"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGeoreferencedWarning)
        with rasterio.open(path, "w", **profile) as ds:
            ds.write(np.moveaxis(rgb, -1, 0))
    return path


def write_footprints(path: Path, polygons, crs: str, fields: dict, driver: str) -> Path:
    """Write polygons (already in ``crs``) with attribute columns through pyogrio."""
    import shapely
    from pyogrio.raw import write

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    write(
        str(path),
        shapely.to_wkb(np.asarray(polygons, dtype=object)),
        field_data=[np.asarray(v) for v in fields.values()],
        fields=list(fields),
        crs=crs,
        driver=driver,
        geometry_type="Polygon",
    )
    return path


def _pre_tiles(root: Path, buildings: list[_Building]) -> list[Path]:
    from affine import Affine

    paths = []
    for name, col in (("pre_west", 0), ("pre_east", 1)):
        left = X0 + col * TILE_PX * PRE_RES
        transform = Affine(PRE_RES, 0, left, 0, -PRE_RES, Y_TOP)
        cols, rows = np.meshgrid(np.arange(TILE_PX) + 0.5, np.arange(TILE_PX) + 0.5)
        x, y = transform @ (cols.ravel(), rows.ravel())
        rgb = render(np.asarray(x), np.asarray(y), buildings, post=False).reshape(
            TILE_PX, TILE_PX, 3
        )
        paths.append(write_tile(root / "pre" / f"{name}.tif", rgb, PRE_CRS, transform))
    return paths


def _post_tiles(root: Path, buildings: list[_Building], hole) -> list[Path]:
    from affine import Affine

    west, south, east, north = _post_box()
    width = int(round((east - west) / POST_RES))
    mid = south + round((north - south) / POST_RES / 2) * POST_RES
    to_utm = _transformer(POST_CRS, PRE_CRS)
    paths = []
    for name, top, bottom in (("post_north", north, mid), ("post_south", mid, south)):
        height = int(round((top - bottom) / POST_RES))
        transform = Affine(POST_RES, 0, west, 0, -POST_RES, top)
        cols, rows = np.meshgrid(np.arange(width) + 0.5, np.arange(height) + 0.5)
        lon, lat = transform @ (cols.ravel(), rows.ravel())
        x, y = to_utm.transform(np.asarray(lon), np.asarray(lat))
        rgb = render(np.asarray(x), np.asarray(y), buildings, post=True, hole=hole).reshape(
            height, width, 3
        )
        paths.append(write_tile(root / "post" / f"{name}.tif", rgb, POST_CRS, transform, nodata=0))
    return paths


def make_scene(root: str | os.PathLike, seed: int = 0) -> SceneFixture:
    """Write the synthetic scene under ``root`` (see the module docstring) and describe it."""
    import shapely

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    buildings = _layout(rng)
    hole_building = next(b for b in buildings if b.uid == "b003")
    c = hole_building.polygon.centroid
    hole = shapely.box(c.x - 1.0, c.y - 1.0, c.x + 1.0, c.y + 1.0)

    pre = _pre_tiles(root, buildings)
    post = _post_tiles(root, buildings, hole)

    polygons = np.array([b.polygon for b in buildings], dtype=object)
    uids = np.array([b.uid for b in buildings], dtype=object)
    labels = np.array([b.label for b in buildings])
    geojson = write_footprints(
        root / "buildings.geojson",
        reproject_geometries(polygons, PRE_CRS, "OGC:CRS84"),
        "OGC:CRS84",
        {"uid": uids, LABEL_FIELD: np.array([CLASS_NAMES[v] for v in labels], dtype=object)},
        "GeoJSON",
    )
    gpkg = write_footprints(
        root / "buildings.gpkg",
        reproject_geometries(polygons, PRE_CRS, "EPSG:3857"),
        "EPSG:3857",
        {"uid": uids, LABEL_FIELD: labels.astype(np.int64)},
        "GPKG",
    )
    covered = [b for b in buildings if b.covered]
    per_class = {name: sum(b.label == k for b in covered) for k, name in enumerate(CLASS_NAMES)}
    lon, lat = _transformer(PRE_CRS, POST_CRS).transform(
        np.array([X0, X0 + PRE_WIDTH_M, X0 + PRE_WIDTH_M, X0]),
        np.array([Y_TOP - PRE_HEIGHT_M, Y_TOP - PRE_HEIGHT_M, Y_TOP, Y_TOP]),
    )
    return SceneFixture(
        root=root,
        pre=tuple(pre),
        post=tuple(post),
        buildings=geojson,
        buildings_gpkg=gpkg,
        label_field=LABEL_FIELD,
        n_buildings=len(buildings),
        covered=len(covered),
        not_covered=len(buildings) - len(covered),
        per_class=per_class,
        covered_uids=tuple(b.uid for b in covered),
        no_damage_uids=tuple(b.uid for b in covered if b.label == 0),
        lonlat_bounds=(float(lon.min()), float(lat.min()), float(lon.max()), float(lat.max())),
    )


@dataclass(frozen=True)
class BadSceneInputs:
    """Broken variants of a synthetic scene's inputs, one problem each.

    Attributes:
        no_crs: the east pre tile without CRS or geotransform.
        corrupt: a ``.tif`` holding bytes that are no image.
        truncated: the north post tile cut to half its bytes.
        truncated_cog: the east pre tile as a Cloud Optimized GeoTIFF cut to 70% of its bytes: its
            overviews (at the start of the file) read, its full-resolution blocks fail.
        one_band: the east pre tile as a single band.
        uint16: the east pre tile as uint16 (values * 40 + 300).
        rgba: the east pre tile with an opaque alpha band.
        rgbn: the east pre tile with a 4th non-alpha band (NIR).
        outside: the footprints moved 50 km east.
        bad_label: the footprints with ``damage`` of b000 set to ``wrecked``.
        empty: a footprint file with no features.
        unreadable: a footprint file that is not a vector format.
    """

    no_crs: Path
    corrupt: Path
    truncated: Path
    truncated_cog: Path
    one_band: Path
    uint16: Path
    rgba: Path
    rgbn: Path
    outside: Path
    bad_label: Path
    empty: Path
    unreadable: Path


def make_bad_scene_inputs(root: str | os.PathLike, scene: SceneFixture) -> BadSceneInputs:
    """Write one broken variant per kind of bad input under ``root`` from a synthetic scene."""
    import rasterio
    import rasterio.shutil
    import shapely
    from pyogrio.raw import read

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    east = next(p for p in scene.pre if p.stem == "pre_east")
    with rasterio.open(east) as ds:
        rgb = np.moveaxis(ds.read(), 0, -1)
        transform, crs = ds.transform, ds.crs.to_string()
    no_crs = write_tile(root / "no_crs.tif", rgb, None, None)
    corrupt = root / "corrupt.tif"
    corrupt.write_bytes(b"this is not a GeoTIFF\n" * 200)
    north = next(p for p in scene.post if p.stem == "post_north")
    data = north.read_bytes()
    truncated = root / "truncated.tif"
    truncated.write_bytes(data[: len(data) // 2])
    cog = root / "east_cog.tif"
    rasterio.shutil.copy(east, cog, driver="COG", BLOCKSIZE=64, OVERVIEW_COUNT=2)
    data = cog.read_bytes()
    truncated_cog = root / "truncated_cog.tif"
    truncated_cog.write_bytes(data[: int(len(data) * 0.7)])
    cog.unlink()
    one_band = write_tile(root / "one_band.tif", rgb[..., :1], crs, transform)
    uint16 = write_tile(root / "uint16.tif", rgb.astype(np.uint16) * 40 + 300, crs, transform)
    alpha = np.full(rgb.shape[:2] + (1,), 255, dtype=np.uint8)
    rgba = root / "rgba.tif"
    with rasterio.open(
        rgba,
        "w",
        driver="GTiff",
        width=rgb.shape[1],
        height=rgb.shape[0],
        count=4,
        dtype="uint8",
        crs=crs,
        transform=transform,
        photometric="RGB",
        alpha="YES",
    ) as ds:
        ds.write(np.moveaxis(np.concatenate([rgb, alpha], axis=-1), -1, 0))
    nir = rgb[..., :1] // 2 + 60
    rgbn = write_tile(root / "rgbn.tif", np.concatenate([rgb, nir], axis=-1), crs, transform)

    meta, _, wkb, values = read(str(scene.buildings))
    polygons = shapely.from_wkb(wkb)
    fields = {
        str(k): np.asarray(v, dtype=object) for k, v in zip(meta["fields"], values, strict=True)
    }
    moved = shapely.transform(polygons, lambda xy: xy + np.array([0.56, 0.0]))  # about 50 km east
    outside = write_footprints(root / "outside.geojson", moved, "OGC:CRS84", fields, "GeoJSON")
    bad = dict(fields)
    bad[LABEL_FIELD] = bad[LABEL_FIELD].copy()
    bad[LABEL_FIELD][list(fields["uid"]).index("b000")] = "wrecked"
    bad_label = write_footprints(root / "bad_label.geojson", polygons, "OGC:CRS84", bad, "GeoJSON")
    empty = root / "empty.geojson"
    empty.write_text('{"type": "FeatureCollection", "features": []}\n')
    unreadable = root / "unreadable.gpkg"
    shutil.copyfile(corrupt, unreadable)
    return BadSceneInputs(
        no_crs=no_crs,
        corrupt=corrupt,
        truncated=truncated,
        truncated_cog=truncated_cog,
        one_band=one_band,
        uint16=uint16,
        rgba=rgba,
        rgbn=rgbn,
        outside=outside,
        bad_label=bad_label,
        empty=empty,
        unreadable=unreadable,
    )


def make_large_scene(root: str | Path, size: int, spacing: int = 100, seed: int = 0) -> int:
    """Write a ``size`` x ``size`` px georeferenced scene block by block; returns the buildings.

    ``pre/pre.tif`` and ``post/post.tif`` (EPSG:32615, 0.5 m, tiled, deflate) and
    ``buildings.geojson``: one rectangular building of 12-30 px per ``spacing`` px cell (so the
    density does not depend on ``size``), drawn darker in post according to a random class.
    Generation reads and writes 512 px blocks, so its memory does not grow with ``size``.
    """
    import rasterio
    import shapely
    from affine import Affine
    from rasterio.windows import Window

    root = Path(root)
    for sub in ("pre", "post"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    cells = size // spacing
    n = cells * cells
    r, c = np.divmod(np.arange(n), cells)
    w, h = rng.integers(12, 31, n), rng.integers(12, 31, n)
    x0 = c * spacing + (spacing - w) // 2 + rng.integers(-20, 21, n)
    y0 = r * spacing + (spacing - h) // 2 + rng.integers(-20, 21, n)
    label = rng.integers(0, 4, n)
    roof = rng.integers(120, 230, (n, 3))
    transform = Affine(0.5, 0, 362000.0, 0, -0.5, 4102000.0)
    profile = {
        "driver": "GTiff",
        "width": size,
        "height": size,
        "count": 3,
        "dtype": "uint8",
        "crs": "EPSG:32615",
        "transform": transform,
        "tiled": True,
        "blockxsize": 512,
        "blockysize": 512,
        "compress": "deflate",
        "predictor": 2,
        "photometric": "RGB",
        "BIGTIFF": "IF_SAFER",
    }
    block = 512
    with (
        rasterio.open(root / "pre" / "pre.tif", "w", **profile) as pre,
        rasterio.open(root / "post" / "post.tif", "w", **profile) as post,
    ):
        for br in range(0, size, block):
            for bc in range(0, size, block):
                bh, bw = min(block, size - br), min(block, size - bc)
                rows, cols = np.mgrid[br : br + bh, bc : bc + bw].astype(np.float32)
                tex = 10 * np.sin(cols / 23.0) * np.cos(rows / 17.0)
                before = np.clip(np.stack([80 + tex, 105 + tex, 60 + tex / 2], -1), 1, 255)
                before = before.astype(np.uint8)
                after = before.copy()
                hit = (x0 < bc + bw) & (x0 + w > bc) & (y0 < br + bh) & (y0 + h > br)
                for i in np.flatnonzero(hit):
                    ys = slice(max(y0[i] - br, 0), min(y0[i] + h[i] - br, bh))
                    xs = slice(max(x0[i] - bc, 0), min(x0[i] + w[i] - bc, bw))
                    before[ys, xs] = roof[i]
                    after[ys, xs] = (roof[i] * (1 - 0.25 * label[i])).astype(np.uint8)
                window = Window(bc, br, bw, bh)
                pre.write(np.moveaxis(before, -1, 0), window=window)
                post.write(np.moveaxis(after, -1, 0), window=window)
    boxes = shapely.box(x0, y0, x0 + w, y0 + h)
    geo = shapely.transform(boxes, lambda xy: np.column_stack(transform @ (xy[:, 0], xy[:, 1])))
    write_footprints(
        root / "buildings.geojson",
        geo,
        "EPSG:32615",
        {"uid": np.array([f"b{i:06d}" for i in range(n)], dtype=object)},
        "GeoJSON",
    )
    return n


def main(argv: list[str] | None = None) -> int:
    """``python -m data_prep.synthetic_scene --out DIR [--large SIZE]``: write an example scene."""
    import argparse

    parser = argparse.ArgumentParser(
        description="Write the synthetic georeferenced example scene (synthetic imagery)."
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument(
        "--large",
        type=int,
        metavar="SIZE",
        help="instead, a SIZE x SIZE px scene written block by block (memory measurements)",
    )
    parser.add_argument("--spacing", type=int, default=100, help="pixels per building (--large)")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    if a.large:
        n = make_large_scene(a.out, a.large, a.spacing, a.seed)
    else:
        n = make_scene(a.out, a.seed).n_buildings
    print(f"{n} buildings written to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
