"""A small seeded xBD-format dataset for tests, demos and benchmarks (the imagery is synthetic).

The tiles follow the xBD layout (``ROOT/images/<event>_<id>_{pre,post}_disaster.{png,tif}`` and
``ROOT/labels/<same>.json`` with ``features.xy`` pixel WKT, ``features.lng_lat`` geographic WKT,
``properties.subtype/uid/feature_type`` and ``metadata``). Buildings are drawn as rotated
rectangles with shadows on textured ground; the post image shows each building altered by its
class: no-damage identical, minor-damage a few debris spots and a tarp, major-damage half of the
roof collapsed, destroyed the whole footprint turned to dark rubble. Damage is drawn only within
two pixels of the footprint and buildings sit one per 64-pixel cell, so the 64-pixel chip window
of a no-damage building is identical in pre and post.

Run ``python -m data_prep.synthetic --out DIR`` to write ``DIR/xbd``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.spec import CLASS_NAMES, UNCLASSIFIED

#: Side of the grid cell that holds one building, in pixels.
CELL = 64
#: Event names used by the generator (tile t belongs to EVENTS[t % len(EVENTS)]).
EVENTS: tuple[str, ...] = ("synthetic-flood", "synthetic-wildfire")
#: Geographic pixel size of the synthetic tiles in degrees (about 0.5 m).
DEG_PER_PX = 5e-6
#: Pixels around a footprint that post-disaster damage may touch.
DAMAGE_MARGIN = 2
INVALID_WKT = "POLYGON ((10 10, 20 10, 20"


@dataclass
class _Building:
    uid: str
    subtype: str
    polygon: np.ndarray  # [K, 2] float (x, y) pixel vertices
    wkt: str | None = None  # overrides the polygon's WKT (used for the invalid building)


def _ground(rng: np.random.Generator, size: int) -> np.ndarray:
    """Textured ground: smooth colour variation plus fine noise, uint8 [size, size, 3]."""
    import cv2

    coarse = rng.uniform(0, 1, (size // 32 + 2, size // 32 + 2, 1)).astype(np.float32)
    smooth = cv2.resize(coarse, (size, size), interpolation=cv2.INTER_CUBIC)[..., None]
    base = np.array([92, 112, 70], np.float32) + smooth * np.array([40, 30, 20], np.float32)
    fine = rng.normal(0, 7, (size, size, 1)).astype(np.float32)
    return np.clip(base + fine, 0, 255).astype(np.uint8)


def _rectangle(cx: float, cy: float, w: float, h: float, angle: float) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    corners = np.array([[-w / 2, -h / 2], [w / 2, -h / 2], [w / 2, h / 2], [-w / 2, h / 2]])
    rot = np.array([[c, -s], [s, c]])
    return corners @ rot.T + np.array([cx, cy])


def _mask(shape: tuple[int, int], polygon: np.ndarray, dilate: int = 0) -> np.ndarray:
    import cv2

    mask = np.zeros(shape, np.uint8)
    cv2.fillPoly(mask, [np.round(polygon * 16).astype(np.int32)], 1, lineType=cv2.LINE_8, shift=4)
    if dilate:
        mask = cv2.dilate(mask, np.ones((2 * dilate + 1, 2 * dilate + 1), np.uint8))
    return mask.astype(bool)


def _draw_pre(image: np.ndarray, rng: np.random.Generator, polygon: np.ndarray) -> None:
    """A roof with a one-pixel shadow towards the lower right."""
    shape = image.shape[:2]
    shadow = _mask(shape, polygon + 1.0) & ~_mask(shape, polygon)
    image[shadow] = (image[shadow] * 0.45).astype(np.uint8)
    roof = _mask(shape, polygon)
    colour = rng.choice(np.array([[176, 84, 60], [150, 150, 155], [205, 190, 160], [90, 95, 120]]))
    texture = rng.normal(0, 6, (int(roof.sum()), 3))
    image[roof] = np.clip(colour + texture, 0, 255).astype(np.uint8)


def _draw_damage(
    image: np.ndarray, rng: np.random.Generator, polygon: np.ndarray, subtype: str
) -> None:
    """Alter one building in the post image according to its damage class."""
    shape = image.shape[:2]
    roof = _mask(shape, polygon)
    if subtype == "no-damage":
        return
    if subtype == "destroyed":
        area = _mask(shape, polygon, dilate=DAMAGE_MARGIN)
        n = int(area.sum())
        grey = rng.uniform(25, 85, (n, 1))
        image[area] = np.clip(grey * np.array([1.0, 0.9, 0.8]) + rng.normal(0, 8, (n, 3)), 0, 255)
        return
    if subtype == "major-damage":
        rows, cols = np.nonzero(roof)
        angle = rng.uniform(0, 2 * math.pi)
        cx, cy = polygon.mean(axis=0)
        side = (cols - cx) * math.cos(angle) + (rows - cy) * math.sin(angle) > 0
        rows, cols = rows[side], cols[side]
        n = rows.size
        image[rows, cols] = np.clip(
            rng.uniform(40, 110, (n, 1)) + rng.normal(0, 10, (n, 3)), 0, 255
        )
        return
    # minor-damage and un-classified: scattered debris spots and a blue tarp patch
    rows, cols = np.nonzero(roof)
    if rows.size == 0:
        return
    spots = 4 if subtype == "minor-damage" else 2
    for k, i in enumerate(rng.choice(rows.size, size=min(spots, rows.size), replace=False)):
        r, c = rows[i], cols[i]
        colour = (40, 90, 190) if k == 0 and subtype == "minor-damage" else (70, 60, 50)
        r0, r1 = max(r - 2, 0), min(r + 3, shape[0])
        c0, c1 = max(c - 2, 0), min(c + 3, shape[1])
        patch = roof[r0:r1, c0:c1]
        image[r0:r1, c0:c1][patch] = colour


def _plan_tile(rng: np.random.Generator, tile_index: int, size: int) -> list[_Building]:
    """Buildings of one tile: one per used grid cell, with guaranteed special cases on tile 0."""
    cells = [(r, c) for r in range(size // CELL) for c in range(size // CELL)]
    order = rng.permutation(len(cells))
    n = min(len(cells), max(6, int(len(cells) * 0.7)))
    buildings: list[_Building] = []
    for k, idx in enumerate(order[:n]):
        r, c = cells[idx]
        cx = c * CELL + CELL / 2 + rng.uniform(-5, 5)
        cy = r * CELL + CELL / 2 + rng.uniform(-5, 5)
        w, h = rng.uniform(10, 20, 2)
        polygon = _rectangle(cx, cy, w, h, rng.uniform(0, math.pi))
        if k < len(CLASS_NAMES):
            subtype = CLASS_NAMES[(k + tile_index) % len(CLASS_NAMES)]
        else:
            subtype = str(rng.choice(CLASS_NAMES, p=[0.5, 0.2, 0.15, 0.15]))
        buildings.append(
            _Building(str(uuid.UUID(bytes=rng.bytes(16), version=4)), subtype, polygon)
        )
    if tile_index == 0:
        # an un-classified building, one whose bbox crosses the left tile edge, one with bad WKT
        buildings[len(CLASS_NAMES)].subtype = UNCLASSIFIED
        edge = buildings[len(CLASS_NAMES) + 1]
        row_centre = float(edge.polygon[:, 1].mean())
        cells_used = {
            (int(b.polygon[:, 1].mean() // CELL), int(b.polygon[:, 0].mean() // CELL))
            for b in buildings
        }
        free_rows = [r for r in range(size // CELL) if (r, 0) not in cells_used]
        if free_rows:
            row_centre = free_rows[0] * CELL + CELL / 2
            edge.polygon = np.array(
                [
                    [-6.0, row_centre - 7],
                    [12.0, row_centre - 7],
                    [12.0, row_centre + 7],
                    [-6.0, row_centre + 7],
                ]
            )
        else:  # every row has a building in column 0: move that one onto the edge
            first = next(b for b in buildings if int(b.polygon[:, 0].mean() // CELL) == 0)
            y = float(first.polygon[:, 1].mean())
            first.polygon = np.array([[-6.0, y - 7], [12.0, y - 7], [12.0, y + 7], [-6.0, y + 7]])
        invalid = _Building(
            str(uuid.UUID(bytes=rng.bytes(16), version=4)),
            "no-damage",
            np.zeros((0, 2)),
            INVALID_WKT,
        )
        buildings.append(invalid)
    return buildings


def _polygon_wkt(points: np.ndarray) -> str:
    ring = [*points.tolist(), points[0].tolist()]
    return "POLYGON ((" + ", ".join(f"{x:.6f} {y:.6f}" for x, y in ring) + "))"


def _label(
    name: str,
    phase: str,
    event: str,
    size: int,
    ext: str,
    buildings: list[_Building],
    origin: tuple[float, float],
) -> dict:
    """Label JSON in xBD shape; the pre label carries no damage subtype, as in xBD."""
    lon0, lat0 = origin
    xy, lng_lat = [], []
    for b in buildings:
        props = {"feature_type": "building", "uid": b.uid}
        if phase == "post":
            props["subtype"] = b.subtype
        if b.wkt is not None:
            pixel_wkt, geo_wkt = (
                b.wkt,
                _polygon_wkt(np.array([[lon0, lat0], [lon0 + 1e-5, lat0], [lon0, lat0 - 1e-5]])),
            )
        else:
            pixel_wkt = _polygon_wkt(b.polygon)
            geo = np.column_stack(
                [lon0 + b.polygon[:, 0] * DEG_PER_PX, lat0 - b.polygon[:, 1] * DEG_PER_PX]
            )
            geo_wkt = _polygon_wkt(geo)
        xy.append({"properties": dict(props), "wkt": pixel_wkt})
        lng_lat.append({"properties": dict(props), "wkt": geo_wkt})
    return {
        "features": {"lng_lat": lng_lat, "xy": xy},
        "metadata": {
            "sensor": "SYNTHETIC",
            "disaster": event,
            "disaster_type": event.split("-", 1)[-1],
            "width": size,
            "height": size,
            "original_width": size,
            "original_height": size,
            "gsd": 0.5,
            "img_name": f"{name}_{phase}_disaster.{ext}",
        },
    }


def _write_image(path: Path, image: np.ndarray) -> None:
    """Write an [H, W, C] or [H, W] array as PNG (PIL) or as a GeoTIFF without georeferencing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".png":
        from PIL import Image

        Image.fromarray(image).save(path, compress_level=1)
        return
    import rasterio
    from rasterio.errors import NotGeoreferencedWarning

    bands = image[None] if image.ndim == 2 else np.moveaxis(image, -1, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGeoreferencedWarning)
        with rasterio.open(
            path,
            "w",
            driver="GTiff",
            width=bands.shape[2],
            height=bands.shape[1],
            count=bands.shape[0],
            dtype=bands.dtype,
        ) as ds:
            ds.write(bands)


def _render_tile(
    rng: np.random.Generator, tile_index: int, size: int
) -> tuple[np.ndarray, np.ndarray, list[_Building]]:
    """The pre image, post image (uint8 [size, size, 3]) and buildings of one tile."""
    buildings = _plan_tile(rng, tile_index, size)
    pre = _ground(rng, size)
    for b in buildings:
        if b.wkt is None:
            _draw_pre(pre, rng, b.polygon)
    post = pre.copy()
    for b in buildings:
        if b.wkt is None:
            _draw_damage(post, rng, b.polygon, b.subtype)
    return pre, post, buildings


def _write_tile(
    root: Path,
    name: str,
    event: str,
    pre: np.ndarray,
    post: np.ndarray,
    buildings: list[_Building],
    ext: str,
    origin: tuple[float, float],
) -> dict[str, Path]:
    paths = {}
    for phase, image in (("pre", pre), ("post", post)):
        img = root / "images" / f"{name}_{phase}_disaster.{ext}"
        _write_image(img, image)
        label = root / "labels" / f"{name}_{phase}_disaster.json"
        label.parent.mkdir(parents=True, exist_ok=True)
        label.write_text(
            json.dumps(_label(name, phase, event, pre.shape[0], ext, buildings, origin))
        )
        paths[f"{phase}_image"] = img
        paths[f"{phase}_label"] = label
    return paths


def tile_name(tile_index: int) -> str:
    """The tile name (file stem without ``_post_disaster``) of synthetic tile ``tile_index``."""
    return f"{EVENTS[tile_index % len(EVENTS)]}_{tile_index:08d}"


def make_xbd(root: str | Path, seed: int = 0, n_tiles: int = 3, size: int = 256) -> Path:
    """Write a small seeded xBD-format dataset into ``root/images`` and ``root/labels``.

    Tile 1 (and every third tile after it) is written as GeoTIFF without georeferencing, the
    others as PNG. Over all tiles there is at least one building of each damage class; tile 0
    also holds one un-classified building, one whose bbox crosses the tile's left edge and one
    with invalid WKT.

    Args:
        root: output folder (created).
        seed: random seed; the same seed writes the same files.
        n_tiles: number of pre/post tile pairs (at least 1).
        size: tile side in pixels (a multiple of 64, at least 192).

    Returns:
        ``root`` as a Path.
    """
    if n_tiles < 1:
        raise ValueError(f"n_tiles must be at least 1, got {n_tiles}")
    if size < 3 * CELL or size % CELL:
        raise ValueError(f"size must be a multiple of {CELL} and at least {3 * CELL}, got {size}")
    root = Path(root)
    rng = np.random.default_rng(seed)
    for t in range(n_tiles):
        pre, post, buildings = _render_tile(rng, t, size)
        ext = "tif" if t % 3 == 1 else "png"
        origin = (-90.0 + 0.01 * t, 30.0 + 0.01 * t)
        _write_tile(root, tile_name(t), EVENTS[t % len(EVENTS)], pre, post, buildings, ext, origin)
    return root


def make_bad_xbd(root: str | Path, seed: int = 0, size: int = 128) -> dict[str, Path]:
    """Write an xBD-format dataset in which most tiles have one problem each, for error tests.

    Tiles (all under ``root/images`` and ``root/labels``):
        ``bad-good_00000000``: a good tile with two extra buildings: one with invalid WKT and one
        whose polygon lies entirely outside the tile; ``bad-uint16_00000001``: 16-bit GeoTIFFs
        (usable, scaled to uint8 when read); ``bad-nopost``: pre image without post image;
        ``bad-nopre``: post without pre; ``bad-nolabel``: images without label files;
        ``bad-truncated``: the post PNG cut off halfway; ``bad-garbage``: a pre "PNG" of random
        bytes; ``bad-notjson``: a post label that is not JSON; ``bad-oneband``: a one-band pre
        image; ``bad-sizes``: a post image of a different size than the pre image.

    Returns:
        Problem name -> the file that a skip message must name: ``outside`` and ``bad_wkt`` (the
        good tile's post label), ``missing_post`` (the pre image), ``missing_pre`` (the post
        image), ``missing_label`` (the expected post label path), ``truncated``, ``garbage``,
        ``not_json``, ``one_band``, ``size_mismatch`` (the post image). ``uint16`` names the
        usable 16-bit tile's post image and is not a problem.
    """
    root = Path(root)
    rng = np.random.default_rng(seed)
    problems: dict[str, Path] = {}

    def tile(
        name: str, ext: str = "png", index: int = 2
    ) -> tuple[dict[str, Path], np.ndarray, np.ndarray]:
        pre, post, buildings = _render_tile(rng, index, size)
        paths = _write_tile(root, name, "bad", pre, post, buildings, ext, (-80.0, 20.0))
        return paths, pre, post

    # a good tile with an invalid building and one outside the tile
    pre, post, buildings = _render_tile(rng, 2, size)
    buildings.append(
        _Building("outside-0001", "destroyed", _rectangle(size + 40.0, 30.0, 12, 12, 0.0))
    )
    buildings.append(_Building("badwkt-0001", "minor-damage", np.zeros((0, 2)), "POLYGON ((1 1, 2"))
    paths = _write_tile(
        root, "bad-good_00000000", "bad", pre, post, buildings, "png", (-80.0, 20.0)
    )
    problems["outside"] = problems["bad_wkt"] = paths["post_label"]

    # 16-bit GeoTIFFs: usable
    paths, pre, post = tile("bad-uint16_00000001", ext="tif")
    _write_image(paths["pre_image"], pre.astype(np.uint16) * 64)
    _write_image(paths["post_image"], post.astype(np.uint16) * 64)
    problems["uint16"] = paths["post_image"]

    paths, _, _ = tile("bad-nopost_00000002")
    paths["post_image"].unlink()
    problems["missing_post"] = paths["pre_image"]

    paths, _, _ = tile("bad-nopre_00000003")
    paths["pre_image"].unlink()
    problems["missing_pre"] = paths["post_image"]

    paths, _, _ = tile("bad-nolabel_00000004")
    paths["post_label"].unlink()
    paths["pre_label"].unlink()
    problems["missing_label"] = paths["post_label"]

    paths, _, _ = tile("bad-truncated_00000005")
    data = paths["post_image"].read_bytes()
    paths["post_image"].write_bytes(data[: len(data) // 2])
    problems["truncated"] = paths["post_image"]

    paths, _, _ = tile("bad-garbage_00000006")
    paths["pre_image"].write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    problems["garbage"] = paths["pre_image"]

    paths, _, _ = tile("bad-notjson_00000007")
    paths["post_label"].write_text("<html>not json</html>\n")
    problems["not_json"] = paths["post_label"]

    paths, pre, _ = tile("bad-oneband_00000008")
    _write_image(paths["pre_image"], pre[..., 0])
    problems["one_band"] = paths["pre_image"]

    paths, _, post = tile("bad-sizes_00000009")
    _write_image(paths["post_image"], post[: size - 16, : size - 16])
    problems["size_mismatch"] = paths["post_image"]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep.synthetic",
        description="Write a small seeded SYNTHETIC xBD-format dataset to OUT/xbd (drawn imagery, not real data).",
    )
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="output folder; the data set goes to DIR/xbd"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--tiles", type=int, default=3, help="number of tile pairs (default 3)")
    parser.add_argument(
        "--size", type=int, default=256, help="tile side in pixels, a multiple of 64 (default 256)"
    )
    args = parser.parse_args(argv)
    root = make_xbd(Path(args.out) / "xbd", seed=args.seed, n_tiles=args.tiles, size=args.size)
    counts: dict[str, int] = {}
    for label in sorted((root / "labels").glob("*_post_disaster.json")):
        for feature in json.loads(label.read_text())["features"]["xy"]:
            subtype = feature["properties"]["subtype"]
            counts[subtype] = counts.get(subtype, 0) + 1
    print(
        f"wrote a SYNTHETIC xBD-format data set (drawn imagery, not real satellite data) to {root}"
    )
    print(
        f"  {args.tiles} tile pair(s) of {args.size}x{args.size} px in {root / 'images'}, labels in {root / 'labels'}"
    )
    print("  buildings per subtype: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"next: local-damage prepare xbd --xbd {root} --out {Path(args.out) / 'chips'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
