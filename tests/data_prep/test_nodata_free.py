"""A tile that declares nodata 0 but holds no pixel of it is warped without it
(:mod:`data_prep.nodata_free`): the same pixels and validity, bit for bit, as the warp that
honours the value, on synthetic tiles and on real ones given a nodata value they do not hold."""

from __future__ import annotations

import numpy as np
import pytest
from affine import Affine

from data_prep import nodata_free
from data_prep.mosaic import open_tile
from tests.conftest import shared_data


def _reference(dataset, crs, transform, width: int, height: int):
    """The warp honouring the dataset's nodata value: RGB [H, W, 3] and valid [H, W]."""
    import rasterio
    from rasterio.enums import Resampling
    from rasterio.warp import reproject

    data = np.zeros((4, height, width), dtype=np.uint8)
    reproject(
        rasterio.band(dataset, [1, 2, 3]),
        data,
        dst_transform=transform,
        dst_crs=crs,
        resampling=Resampling.bilinear,
        dst_alpha=4,
    )
    return np.moveaxis(data[:3], 0, -1), data[3] > 0


def _check_windows(path, crs, origin: Affine, windows, free: bool) -> int:
    """Each window ``(col, row, width, height)`` of the grid at ``origin`` read through
    :meth:`Tile.read_warped` equals the reference; returns the valid pixels read."""
    tile = open_tile(path)
    seen = 0
    try:
        for col, row, width, height in windows:
            transform = origin @ Affine.translation(col, row)
            rgb, valid = tile.read_warped(crs, transform, width, height)
            want_rgb, want_valid = _reference(tile.dataset, crs, transform, width, height)
            np.testing.assert_array_equal(valid, want_valid)
            np.testing.assert_array_equal(rgb, want_rgb)
            seen += int(valid.sum())
        assert (tile._warp_from is not tile.dataset) == free
    finally:
        tile.close()
    return seen


WINDOWS = [(0, 0, 512, 268), (-40, -30, 300, 200), (200, 100, 350, 220), (7, 3, 61, 45)]


def test_synthetic_post_tiles_warp_as_with_their_nodata(synthetic_scene):
    """The synthetic post tiles (EPSG:4326, finer pixels, nodata 0): the one with the nodata hole
    is warped honouring it, the other without the value; both equal the reference."""
    import rasterio

    with rasterio.open(synthetic_scene.pre[0]) as pre:
        crs, origin = pre.crs, pre.transform
    holes = []
    for path in synthetic_scene.post:
        with rasterio.open(path) as ds:
            assert nodata_free.scannable(ds)
            holes.append(nodata_free.holds_nodata(ds))
        seen = _check_windows(path, crs, origin, WINDOWS, free=not holes[-1])
        assert seen > 50_000
    assert sorted(holes) == [False, True]  # the scene's post nodata hole is in one tile


def _write(path, rgb: np.ndarray, nodata, dtype="uint8", alpha: bool = False) -> None:
    import rasterio

    bands = np.moveaxis(rgb, -1, 0).astype(dtype)
    if alpha:
        bands = np.concatenate([bands, np.full((1, *rgb.shape[:2]), 255, dtype)])
    profile = {
        "driver": "GTiff",
        "width": rgb.shape[1],
        "height": rgb.shape[0],
        "count": bands.shape[0],
        "dtype": dtype,
        "crs": "EPSG:32615",
        "transform": Affine(0.45, 0, 362000.0, 0, -0.45, 4102000.0),
    }
    if nodata is not None:
        profile["nodata"] = nodata
    with rasterio.open(path, "w", **profile) as ds:
        ds.write(bands)


def test_which_tiles_are_scanned_and_what_a_scan_finds(tmp_path, monkeypatch):
    import rasterio

    rng = np.random.default_rng(3)
    rgb = rng.integers(1, 256, (300, 200, 3)).astype(np.uint8)
    one_band = rgb.copy()
    one_band[299, 150, 2] = 0  # the last strip, one band
    middle = rgb.copy()
    middle[150, 3, 1] = 0  # a strip in the middle: every strip is read
    cases = {
        "plain.tif": (rgb, 0, "uint8", False, True, False),
        "one_band.tif": (one_band, 0, "uint8", False, True, True),
        "middle.tif": (middle, 0, "uint8", False, True, True),
        "none.tif": (rgb, None, "uint8", False, False, False),
        "alpha.tif": (rgb, 0, "uint8", True, False, False),
        "uint16.tif": (rgb, 0, "uint16", False, False, False),
        "far.tif": (rgb, 300.5, "float32", False, False, False),
        "seven.tif": (rgb, 7, "uint8", False, False, False),  # only 0 fills as the plain warp
    }
    monkeypatch.setattr(nodata_free, "STRIP_PIXELS", 7_000)  # many strips
    for name, (image, nodata, dtype, alpha, scannable, holds) in cases.items():
        path = tmp_path / name
        _write(path, image, nodata, dtype, alpha)
        with rasterio.open(path) as ds:
            assert nodata_free.scannable(ds, 4 if alpha else 0) == scannable, name
            if scannable:
                assert nodata_free.holds_nodata(ds) == holds, name
                free = nodata_free.open_nodata_free(ds)
                assert (free is None) == holds, name
                if free is not None:
                    with free:
                        assert free.nodata is None and free.count == 3
                        assert free.transform == ds.transform and free.crs == ds.crs
                        np.testing.assert_array_equal(free.read(), ds.read([1, 2, 3]))
    with rasterio.open(tmp_path / "plain.tif") as ds:
        monkeypatch.setattr(nodata_free, "MAX_SCAN_PIXELS", 300 * 200 - 1)
        assert not nodata_free.scannable(ds)  # too large to scan: warped as it is


def test_a_tile_with_its_nodata_value_in_one_band_is_warped_honouring_it(tmp_path):
    """A pixel of the nodata value in one band only: the tile is warped as before."""
    rng = np.random.default_rng(5)
    rgb = rng.integers(1, 256, (240, 320, 3)).astype(np.uint8)
    rgb[100:140, 50:90, 0] = 0
    path = tmp_path / "band.tif"
    _write(path, rgb, 0)
    origin = Affine(0.5, 0, 362010.0, 0, -0.5, 4101990.0)  # coarser, shifted: a real warp
    _check_windows(path, "EPSG:32615", origin, [(0, 0, 200, 150), (-10, 20, 90, 80)], free=False)


@pytest.mark.realdata
def test_real_tiles_given_a_nodata_value_they_do_not_hold(tmp_path):
    """Joplin's post tiles (EPSG:4326) rewritten with nodata 0 and no pixel of it, warped onto
    the pre tiles' grid (EPSG:26915, 0.6 m pixels): the same as honouring the value."""
    import rasterio
    from rasterio.warp import transform_bounds

    root = shared_data("joplin_geotiff")
    with rasterio.open(sorted((root / "pre").glob("*.tif"))[0]) as pre:
        crs, pixel = pre.crs, pre.transform.a
    seen = 0
    for source in sorted((root / "post").glob("*.tif"))[:2]:
        with rasterio.open(source) as ds:
            bands = ds.read([1, 2, 3])
            profile = ds.profile
            left, _, _, top = transform_bounds(ds.crs, crs, *ds.bounds)
        origin = Affine(pixel, 0, left, 0, -pixel, top)  # the pre grid's pixels, over this tile
        bands = np.maximum(bands, 1)  # the tile's few black pixels made 1: nodata 0 is absent
        profile.update(count=3, nodata=0)
        path = tmp_path / source.name
        with rasterio.open(path, "w", **profile) as out:
            out.write(bands)
        windows = [(0, 0, 700, 700), (300, 250, 900, 600), (-50, 600, 500, 500)]
        seen += _check_windows(path, crs, origin, windows, free=True)
    assert seen > 100_000


def test_a_tile_without_a_crs_gets_a_plain_vrt_too(tmp_path):
    """plain_vrt shares the VRT header of radiometry.scaled_vrt, which leaves out a missing CRS."""
    import rasterio
    from rasterio.errors import NotGeoreferencedWarning

    rgb = np.random.default_rng(9).integers(1, 256, (64, 80, 3)).astype(np.uint8)
    path = tmp_path / "nocrs.tif"
    profile = {"driver": "GTiff", "width": 80, "height": 64, "count": 3, "dtype": "uint8"}
    with pytest.warns(NotGeoreferencedWarning), rasterio.open(path, "w", nodata=0, **profile) as ds:
        ds.write(np.moveaxis(rgb, -1, 0))
    with pytest.warns(NotGeoreferencedWarning), rasterio.open(path) as ds:
        free = nodata_free.open_nodata_free(ds)
        assert free is not None
        with free:
            assert free.crs is None and free.nodata is None
            np.testing.assert_array_equal(free.read(), ds.read())
