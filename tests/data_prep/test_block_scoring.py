"""Scoring per block: the work shared between the buildings of one read gives, building by
building, what the per-building code gives (the same chips, coverage, residual shifts and flags).

Each shared path is held equal to the straightforward per-building function it replaces, which
stays in the code as its reference: :func:`data_prep.footprint_cover.footprints_valid` to
:func:`~data_prep.footprint_cover.footprint_valid`, :class:`data_prep.residual.ReadContext` to
:func:`data_prep.residual.image_context_residual`, :func:`runtime.flags.sky_flags` and
:meth:`runtime.flags.Flagger.batch` to :func:`~runtime.flags.sky_flag` and
:meth:`~runtime.flags.Flagger.pair`, and the plain windowed read of a tile on the scene's own grid
to the bilinear warp (``rasterio.warp.reproject``). The real-data tests do it on the Joplin scene.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from data_prep.footprint_cover import footprint_valid, footprints_valid
from data_prep.residual import (
    COARSE_MARGIN_PX,
    CONTEXT_LIMIT_PX,
    ReadContext,
    image_context_residual,
)
from runtime.flags import Flagger, batch_sky_stats, luminance, sky_flag, sky_flags, sky_stats
from tests.conftest import shared_data


def _textured(rng, height: int, width: int) -> np.ndarray:
    import cv2

    base = (rng.random((height // 8 + 2, width // 8 + 2, 3)) * 255).astype(np.uint8)
    return cv2.resize(base, (width, height), interpolation=cv2.INTER_CUBIC)


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def _settles_alike(want: float, got: float, limit: float = CONTEXT_LIMIT_PX) -> bool:
    """Whether a :class:`ReadContext` value settles the flag as the full measurement ``want``
    does: the full value itself, or a coarse one the margin under the limit standing for a full
    one that is not over the limit."""
    if _same(want, got):
        return True
    if math.isnan(got) or got > limit - COARSE_MARGIN_PX:
        return False
    return math.isnan(want) or want <= limit


@pytest.mark.slow
@pytest.mark.parametrize("limit", [None, CONTEXT_LIMIT_PX])
def test_read_context_equals_per_building_residual(limit):
    """Without a limit every value is the per-building one bit for bit; with the flag's limit a
    value is that one or a coarse one that settles the flag alike."""
    rng = np.random.default_rng(0)
    finite = coarse = 0
    for trial in range(5):
        height, width = (int(v) for v in rng.integers(300, 800, 2))
        pre = _textured(rng, height, width)
        post = np.roll(pre, (int(rng.integers(-5, 6)), int(rng.integers(-5, 6))), axis=(0, 1))
        post = np.clip(post.astype(int) + rng.integers(-20, 20, post.shape), 0, 255)
        post = post.astype(np.uint8)
        valid = np.ones((height, width), bool)
        if trial % 2:  # invalid corners: windows there are filled
            valid[: height // 3, : width // 4] = False
            valid[:, -20:] = False
        valid = None if trial == 4 else valid
        shared = ReadContext(pre, post, valid, limit=limit)
        for _ in range(30):
            centre = (float(rng.uniform(-50, width + 50)), float(rng.uniform(-50, height + 50)))
            side = int(rng.choice([0, 100, 600]))
            want = image_context_residual(pre, post, centre, side, valid=valid)
            got = shared.residual(centre, side)
            if limit is None:
                assert _same(want, got), (trial, centre, side, want, got)
            else:
                assert _settles_alike(want, got), (trial, centre, side, want, got)
                coarse += not _same(want, got)
            finite += not math.isnan(want)
    assert finite > 20  # most windows are measured, not NaN
    if limit is not None:
        assert coarse > 20  # most values here come from the coarse match alone


def test_read_context_refuses_mismatched_images():
    a = np.zeros((10, 10, 3), np.uint8)
    with pytest.raises(ValueError, match="one \\[H, W, 3\\] shape"):
        ReadContext(a, np.zeros((10, 12, 3), np.uint8))


def _random_footprints(rng, n: int, extent: int):
    import shapely

    cx, cy = rng.uniform(-30, extent + 30, (2, n))
    w, h = rng.uniform(0.2, 40, (2, n))
    boxes = shapely.box(cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)
    angles = rng.uniform(0, 90, n)
    return [shapely.affinity.rotate(b, a) for b, a in zip(boxes, angles, strict=True)]


def _check_cover(geometries, valid, col_off, row_off) -> int:
    import shapely

    bounds = shapely.bounds(np.array(geometries, dtype=object))
    got = footprints_valid(geometries, bounds, valid, col_off, row_off)
    want = np.array([footprint_valid(g, valid, col_off, row_off) for g in geometries])
    np.testing.assert_array_equal(got, want)
    return int(want.sum())


def test_footprints_valid_equals_per_building():
    rng = np.random.default_rng(1)
    covered = 0
    for trial in range(6):
        height, width = (int(v) for v in rng.integers(100, 400, 2))
        valid = np.kron(rng.random((height // 16 + 1, width // 16 + 1)) > 0.2, np.ones((16, 16)))
        valid = valid[:height, :width].astype(bool)
        if trial == 0:
            valid[:] = True
        col_off, row_off = (int(v) for v in rng.integers(-50, 50, 2))
        geoms = _random_footprints(rng, 150, max(height, width))
        geoms = [g.buffer(0) for g in geoms]
        import shapely

        geoms = [shapely.affinity.translate(g, col_off, row_off) for g in geoms]
        covered += _check_cover(geoms, valid, col_off, row_off)
    assert covered > 50
    assert not footprints_valid([], np.zeros((0, 4)), np.ones((4, 4), bool), 0, 0).size


@pytest.mark.slow
def test_luminance_channel_by_channel_equals_converting_the_whole_chip():
    """Every one of the 2**24 uint8 colours gets the float32 luma of the chip converted first."""
    v = np.arange(1 << 24, dtype=np.uint32)
    rgb = np.stack([(v >> 16) & 255, (v >> 8) & 255, v & 255], axis=-1).astype(np.uint8)
    rgb = rgb.reshape(4096, 4096, 3)
    c = rgb.astype(np.float32)
    want = 0.299 * c[..., 0] + 0.587 * c[..., 1] + 0.114 * c[..., 2]
    got = luminance(rgb)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert np.array_equal(luminance(c), want)  # float input: the formula as it is


def test_luminance_of_views_and_single_chips_equals_the_formula():
    rng = np.random.default_rng(9)
    big = rng.integers(0, 256, (5, 40, 50, 4), dtype=np.uint8)
    for chips in (big[..., :3], big[1:4, 3:30, ::2, 1:], big[0, :, :, :3], big[:0, ..., :3]):
        c = chips.astype(np.float32)
        want = 0.299 * c[..., 0] + 0.587 * c[..., 1] + 0.114 * c[..., 2]
        got = luminance(chips)
        assert got.shape == chips.shape[:-1] and np.array_equal(got, want)


def test_batch_contrast_equals_the_laplacian_of_each_image_bit_for_bit():
    from runtime.flags import _batch_contrast, local_contrast

    rng = np.random.default_rng(4)
    for shape in ((3, 1, 1), (4, 2, 7), (6, 33, 64)):
        gray = luminance(rng.integers(0, 256, (*shape, 3), dtype=np.uint8))
        got = _batch_contrast(gray)
        for g, want in zip(got, (local_contrast(x) for x in gray), strict=True):
            assert g.dtype == np.float32 and np.array_equal(g.view(np.uint32), want.view(np.uint32))


def test_batch_sky_stats_equal_per_pair_bit_for_bit():
    rng = np.random.default_rng(5)
    for side in (17, 64, 128):
        pre = rng.integers(0, 256, (6, side, side, 3), dtype=np.uint8)
        post = rng.integers(0, 256, (6, side, side, 3), dtype=np.uint8)
        post[1] = 250
        post[2, : side // 2] = 200
        got = batch_sky_stats(pre, post)
        assert got == [sky_stats(a, b) for a, b in zip(pre, post, strict=True)]
    assert batch_sky_stats(pre[:0], post[:0]) == []


def test_sky_flags_and_flagger_batch_equal_per_pair():
    rng = np.random.default_rng(2)
    n = 24
    pre = np.stack([_textured(rng, 32, 32) for _ in range(n)])
    post = pre.copy()
    post[0:4] = 240 + rng.integers(0, 3, post[0:4].shape)  # cloud: bright and flat
    post[4:8] = (pre[4:8] * 0.3 + 120).astype(np.uint8)  # haze
    post[8:10] = 0  # blank
    pre[10] = 7  # blank pre
    post[11:] = np.clip(post[11:].astype(int) + rng.integers(-30, 30, post[11:].shape), 0, 255)
    want = [sky_flag(a, b) for a, b in zip(pre, post, strict=True)]
    assert sky_flags(pre, post) == want
    assert {"cloud", "haze", None} <= set(want)
    flagger = Flagger({})
    context = [float(v) for v in rng.uniform(0, 20, n)]
    context[3] = math.nan
    got = flagger.batch(pre, post, None, context_px=context)
    assert got == [
        flagger.pair(a, b, None, None, c) for a, b, c in zip(pre, post, context, strict=True)
    ]
    assert ["blank"] in got and any("misaligned" in f for f in got)
    assert sky_flags(pre[:0], post[:0]) == [] and flagger.batch(pre[:0], post[:0], None) == []


def _warped(tile, crs, transform, width, height):
    """The bilinear warp that :meth:`data_prep.mosaic.Tile.read_warped` does off the grid."""
    import rasterio
    from rasterio.warp import Resampling, reproject

    data = np.zeros((4, height, width), dtype=np.uint8)
    reproject(
        rasterio.band(tile.dataset, [1, 2, 3]),
        data,
        dst_transform=transform,
        dst_crs=crs,
        resampling=Resampling.bilinear,
        dst_alpha=4,
    )
    return np.ascontiguousarray(np.moveaxis(data[:3], 0, -1)), data[3] > 0


def _check_aligned_reads(path, windows) -> None:
    from rasterio.windows import transform as window_transform

    from data_prep.mosaic import open_tile

    tile = open_tile(path)
    try:
        ds = tile.dataset
        for col, row, width, height in windows:
            t = window_transform(((row, row + height), (col, col + width)), ds.transform)
            assert tile._aligned(ds.crs, t) == (col, row)
            rgb, valid = tile.read_warped(ds.crs, t, width, height)
            want_rgb, want_valid = _warped(tile, ds.crs, t, width, height)
            np.testing.assert_array_equal(valid, want_valid)
            np.testing.assert_array_equal(rgb, want_rgb)
    finally:
        tile.close()


def test_aligned_tile_read_equals_warp(tmp_path):
    import rasterio
    from affine import Affine

    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, (3, 300, 400), dtype=np.uint8)
    path = tmp_path / "t.tif"
    profile = dict(driver="GTiff", width=400, height=300, count=3, dtype="uint8")
    transform = Affine(0.5, 0, 362000.0, 0, -0.5, 4102000.0)
    with rasterio.open(path, "w", crs="EPSG:32615", transform=transform, **profile) as ds:
        ds.write(data)
    # inside, across each edge, and wholly outside the tile
    windows = [(10, 20, 64, 48), (-30, 250, 100, 80), (380, -10, 50, 40), (500, 400, 16, 16)]
    _check_aligned_reads(path, windows)

    from data_prep.mosaic import open_tile

    tile = open_tile(path)
    try:  # half a pixel off the grid, another pixel size: warped as before
        assert tile._aligned(tile.dataset.crs, transform @ Affine.translation(0.5, 0)) is None
        assert tile._aligned(tile.dataset.crs, transform @ Affine.scale(2)) is None
    finally:
        tile.close()


@pytest.mark.realdata
def test_aligned_read_equals_warp_on_real_tiles():
    root = shared_data("joplin_geotiff")
    for path in sorted((root / "pre").glob("*.tif"))[:2]:
        _check_aligned_reads(path, [(100, 200, 700, 500), (-40, -40, 300, 300)])


@pytest.mark.realdata
def test_footprints_valid_on_real_footprints():
    import shapely

    from data_prep.footprints import load_footprints
    from data_prep.mosaic import open_scene

    root = shared_data("joplin_geotiff")
    pre, post = sorted((root / "pre").glob("*.tif")), sorted((root / "post").glob("*.tif"))
    with open_scene(pre, post) as scene:
        footprints = load_footprints(root / "footprints" / "joplin.geojson", scene.grid.crs)
        pixels = scene.grid.to_pixels(footprints.geometries)
    bounds = shapely.bounds(pixels)
    rng = np.random.default_rng(4)
    covered = 0
    for _ in range(8):
        c0, r0 = (int(v) for v in rng.integers(0, 3000, 2))
        height, width = (int(v) for v in rng.integers(400, 1400, 2))
        valid = np.kron(rng.random((height // 16 + 1, width // 16 + 1)) > 0.1, np.ones((16, 16)))
        valid = valid[:height, :width].astype(bool)
        near = (bounds[:, 2] > c0 - 20) & (bounds[:, 0] < c0 + width + 20)
        near &= (bounds[:, 3] > r0 - 20) & (bounds[:, 1] < r0 + height + 20)
        geoms = [pixels[k] for k in np.flatnonzero(near)]
        geoms += [shapely.affinity.translate(g, 3.3, 1.7) for g in geoms[:5]]  # overlapping
        covered += _check_cover(geoms, valid, c0, r0)
    assert covered > 100


@pytest.mark.realdata
@pytest.mark.timeout(600)
def test_joplin_per_block_equals_per_building():
    """Cutting and flagging the Joplin scene per block (as scoring does) gives every building the
    coverage, chips, residual shift and flags that the per-building functions give on the same
    reads."""
    from data_prep.alignment import align_scene
    from data_prep.footprints import load_footprints
    from data_prep.mosaic import open_scene
    from data_prep.quality import blank_reason
    from data_prep.scene import (
        CHIP,
        NOT_COVERED,
        SKIPPED,
        iter_building_chips,
        pixel_centroids,
        plan_reads,
    )
    from data_prep.windows import ChipWindow, cut_pair
    from runtime.predictor import Predictor
    from runtime.registry import default_model

    root = shared_data("joplin_geotiff")
    pre, post = sorted((root / "pre").glob("*.tif")), sorted((root / "post").glob("*.tif"))
    predictor = Predictor(default_model(), threads=1)
    spec = predictor.spec
    with open_scene(pre, post) as scene:
        footprints = load_footprints(root / "footprints" / "joplin.geojson", scene.grid.crs)
        shift = align_scene(scene, pixel_centroids(scene.grid, footprints), "auto")
        assert shift.to_dict()  # measured (Joplin's post is corrected by under a pixel)
        buildings = plan_reads(scene, footprints, spec).buildings
        reads = []  # the real reads of the scene, as cutting makes them
        read_pair = scene.read_pair

        def recorded(c0, r0, width, height):
            got = read_pair(c0, r0, width, height)
            reads.append((c0, r0, got))
            return got

        scene.read_pair = recorded
        chips = [(b, reads[-1] if reads else None) for b in iter_building_chips(
            scene, footprints, spec, progress=False, context=True)]  # fmt: skip
    counts = {CHIP: 0, NOT_COVERED: 0, SKIPPED: 0}
    pairs, context = [], []
    for b, read in chips:
        counts[b.status] = counts.get(b.status, 0) + 1
        if read is None:  # settled by the plan, before any read
            assert b.status in (NOT_COVERED, SKIPPED), b.uid
            continue
        c0, r0, (pre_rgb, pre_valid, post_rgb, post_valid) = read
        both = pre_valid & post_valid
        k = b.index
        if not footprint_valid(buildings.pixels[k], both, c0, r0):
            assert b.status == NOT_COVERED, b.uid
            continue
        w = buildings.windows[k]
        local = ChipWindow(w.col_off - c0, w.row_off - r0, w.size)
        want_pre, want_post = cut_pair(pre_rgb, post_rgb, local, spec.chip_size)
        if blank_reason(want_pre, want_post):
            assert b.status == SKIPPED, b.uid
            continue
        assert b.status == CHIP, b.uid
        np.testing.assert_array_equal(b.pre, want_pre)
        np.testing.assert_array_equal(b.post, want_post)
        centre = (local.col_off + w.size / 2, local.row_off + w.size / 2)
        want = image_context_residual(pre_rgb, post_rgb, centre, w.size, valid=both)
        assert _settles_alike(want, b.context_px), (b.uid, b.context_px, want)
        pairs.append((b.pre, b.post))
        context.append(b.context_px)
    assert counts[CHIP] > 300 and counts[NOT_COVERED] > 1000  # Joplin: 363 scored, 2460 not covered

    flagger = Flagger(predictor.metadata)
    a, b = np.stack([p for p, _ in pairs]), np.stack([q for _, q in pairs])
    embedding = predictor.predict(a, b, batch_size=32).embedding
    for s in range(0, len(a), 32):
        batch = flagger.batch(a[s : s + 32], b[s : s + 32], embedding[s : s + 32],
                              context_px=context[s : s + 32])  # fmt: skip
        for i, got in enumerate(batch):
            j = s + i
            assert got == flagger.pair(a[j], b[j], embedding[j], None, context[j]), j


@pytest.mark.slow
@pytest.mark.parametrize("move", [0.0, 6.0])
def test_coarse_context_settles_alike_on_every_labelled_xbd_tile(move):
    """Every building window of every labelled xBD tile, as it is and with its post image moved
    by 6 px (around the limit) in a random direction: the cascade of :class:`ReadContext` keeps
    the full measurement's side of the limit, and most windows of the tiles as they are settle on
    the coarse match alone."""
    import json

    import cv2
    from shapely import wkt

    rng = np.random.default_rng(1)
    windows = coarse = 0
    labels = sorted(
        p
        for name in ("xbd_sample", "xbd_extra")
        for p in (shared_data(name) / "labels").glob("*_post_disaster.json")
    )
    assert len(labels) > 50
    for label in labels:
        images = label.parent.parent / "images"
        stem = label.name.replace("_post_disaster.json", "")
        pre = cv2.cvtColor(cv2.imread(str(images / f"{stem}_pre_disaster.png")), cv2.COLOR_BGR2RGB)
        post = cv2.cvtColor(
            cv2.imread(str(images / f"{stem}_post_disaster.png")), cv2.COLOR_BGR2RGB
        )
        if move:
            angle = rng.uniform(0, 2 * np.pi)
            shift = np.float32([[1, 0, move * np.cos(angle)], [0, 1, move * np.sin(angle)]])
            post = cv2.warpAffine(post, shift, post.shape[1::-1], borderMode=cv2.BORDER_REFLECT)
        full, cascade = ReadContext(pre, post, limit=None), ReadContext(pre, post)
        for feature in json.loads(label.read_text())["features"]["xy"]:
            c = wkt.loads(feature["wkt"]).centroid
            want, got = full.residual((c.x, c.y)), cascade.residual((c.x, c.y))
            assert _settles_alike(want, got), (stem, c.x, c.y, want, got)
            windows += 1
            coarse += not _same(want, got)
    assert windows > 3000
    if not move:
        assert coarse > 0.6 * windows, (coarse, windows)


def test_mosaic_read_pastes_each_tile_where_the_earlier_ones_left_nothing(
    synthetic_scene, tmp_path
):
    """A window across the synthetic scene's post tiles (EPSG:4326, warped) and an inverted copy
    of the first one lying half under it: each pixel is the first tile's that has it, as each tile's
    own warp of the window pasted in turn."""
    import shutil

    import rasterio

    from data_prep.mosaic import open_scene

    s = synthetic_scene
    under = tmp_path / "under.tif"
    shutil.copy(s.post[0], under)
    with rasterio.open(under, "r+") as ds:  # inverted, moved 20 px down: half under the first
        ds.write(255 - ds.read())
        ds.transform = ds.transform @ ds.transform.translation(0, 20)
    with open_scene(s.pre, [s.post[0], under, *s.post[1:]]) as scene:
        grid, mosaic = scene.grid, scene.post
        for col, row, width, height in (
            (-40, -30, grid.width + 80, grid.height + 60),
            (5, 7, 200, 150),
        ):
            rgb, valid = mosaic.read(col, row, width, height)
            want = np.zeros((height, width, 3), np.uint8)
            have = np.zeros((height, width), bool)
            transform = grid.window_transform(col, row)
            tiles = 0
            for tile in mosaic.tiles:
                t_rgb, t_valid = tile.read_warped(grid.crs, transform, width, height)
                take = t_valid & ~have
                np.copyto(want, t_rgb, where=take[..., None])
                have |= take
                tiles += bool(take.any())
            assert tiles >= 2  # more than one tile gives pixels: the paste is what is tested
            assert np.array_equal(valid, have) and np.array_equal(rgb, want)
