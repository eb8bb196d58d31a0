"""data_prep.grid: moving geometries between CRS, with the transformers kept between calls."""

from __future__ import annotations

import threading

import numpy as np
import shapely

from data_prep import grid


def _points(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lon = rng.uniform(-94.55, -94.45, 50)
    lat = rng.uniform(37.03, 37.10, 50)
    return shapely.points(lon, lat)


def test_reprojection_equals_a_fresh_transformer():
    """A kept transformer gives what a new one gives, bit for bit, call after call."""
    from pyproj import Transformer

    pts = _points()
    fresh = Transformer.from_crs("EPSG:4326", "EPSG:32615", always_xy=True)
    want = np.column_stack(fresh.transform(shapely.get_x(pts), shapely.get_y(pts)))
    for _ in range(3):
        got = grid.reproject_geometries(pts, "EPSG:4326", "EPSG:32615")
        assert np.array_equal(shapely.get_coordinates(got), want)
    back = grid.reproject_geometries(got, "EPSG:32615", "EPSG:4326")
    assert np.allclose(shapely.get_coordinates(back), shapely.get_coordinates(pts), atol=1e-9)
    same = grid.reproject_geometries(pts, "EPSG:4326", "EPSG:4326")
    assert all(a.equals(b) for a, b in zip(same, pts, strict=True))


def test_transformers_are_bounded_and_per_thread():
    """At most TRANSFORMER_CACHE pairs are kept; another thread builds its own."""
    codes = [f"EPSG:{32600 + zone}" for zone in range(1, grid.TRANSFORMER_CACHE + 6)]
    for code in codes:
        grid.reproject_geometries(_points(), "EPSG:4326", code)
    pairs = grid._TRANSFORMERS.pairs
    assert len(pairs) == grid.TRANSFORMER_CACHE
    mine = pairs[("EPSG:4326", codes[-1])]
    theirs = []

    def other():
        grid.reproject_geometries(_points(), "EPSG:4326", codes[-1])
        theirs.append(grid._TRANSFORMERS.pairs[("EPSG:4326", codes[-1])])

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert theirs and theirs[0] is not mine
