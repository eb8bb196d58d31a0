"""Mask to building polygons (data_prep.polygons) on synthetic shapes with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from data_prep.polygons import PolygonOptions, mask_to_polygons


def _areas(polygons) -> list[float]:
    return sorted(round(p.area, 1) for p in polygons)


def test_empty_mask_gives_no_polygons():
    assert mask_to_polygons(np.zeros((64, 64), bool)) == []
    assert mask_to_polygons(np.zeros((64, 64), np.float32)) == []
    assert (
        mask_to_polygons(np.full((64, 64), 0.49, np.float32), PolygonOptions(threshold=0.5)) == []
    )


def test_separate_rectangles_counts_and_areas():
    mask = np.zeros((120, 160), bool)
    mask[10:30, 10:50] = True  # 20 x 40 = 800 px
    mask[50:90, 20:40] = True  # 40 x 20 = 800 px
    mask[60:110, 80:150] = True  # 50 x 70 = 3500 px
    polygons = mask_to_polygons(mask)
    assert len(polygons) == 3
    assert all(p.is_valid and p.geom_type == "Polygon" for p in polygons)
    # axis-aligned rectangles trace exactly: the area is the pixel count, four corners each
    assert _areas(polygons) == [800.0, 800.0, 3500.0]
    assert all(len(p.exterior.coords) == 5 for p in polygons)
    assert polygons[0].bounds == (10.0, 10.0, 50.0, 30.0)  # (x = column, y = row)


def test_probability_is_thresholded():
    prob = np.zeros((60, 60), np.float32)
    prob[5:25, 5:25] = 0.9
    prob[35:55, 35:55] = 0.4
    assert len(mask_to_polygons(prob, PolygonOptions(threshold=0.5))) == 1
    assert len(mask_to_polygons(prob, PolygonOptions(threshold=0.3))) == 2


def test_rotated_rectangle_area_within_tolerance():
    import cv2

    mask = np.zeros((120, 120), np.uint8)
    corners = cv2.boxPoints(((60, 60), (70, 30), 30))
    cv2.fillPoly(mask, [np.round(corners).astype(np.int32)], 1)
    (poly,) = mask_to_polygons(mask.astype(bool), PolygonOptions(simplify_px=1.0))
    assert poly.area == pytest.approx(mask.sum(), rel=0.05)
    assert poly.area == pytest.approx(70 * 30, rel=0.08)
    assert len(poly.exterior.coords) <= 12  # the pixel staircase is simplified away


def test_small_blob_dropped():
    mask = np.zeros((64, 64), bool)
    mask[10:30, 10:30] = True  # 400 px
    mask[50:53, 50:53] = True  # 9 px
    assert _areas(mask_to_polygons(mask, PolygonOptions(min_area_px=10))) == [400.0]
    assert _areas(mask_to_polygons(mask, PolygonOptions(min_area_px=0))) == [9.0, 400.0]


def test_small_holes_filled_large_holes_kept():
    mask = np.zeros((80, 80), bool)
    mask[10:70, 10:70] = True
    mask[20:22, 20:22] = False  # 4 px hole: noise
    mask[40:60, 40:60] = False  # 400 px courtyard
    (poly,) = mask_to_polygons(mask, PolygonOptions(min_area_px=10))
    assert len(poly.interiors) == 1
    assert poly.area == pytest.approx(3600 - 400)


def test_two_touching_rectangles_are_separated():
    # two 40 x 40 buildings, the second shifted down by half: they share 20 px of wall
    mask = np.zeros((100, 120), bool)
    mask[10:50, 10:50] = True
    mask[30:70, 50:90] = True
    polygons = mask_to_polygons(mask, PolygonOptions(min_area_px=10))
    assert len(polygons) == 2
    assert _areas(polygons)[0] == pytest.approx(1600, rel=0.1)
    assert _areas(polygons)[1] == pytest.approx(1600, rel=0.1)
    assert sum(p.area for p in polygons) == pytest.approx(3200, abs=10)
    # each polygon holds one building's centre
    centres = [(30, 30), (70, 50)]
    from shapely import Point

    for x, y in centres:
        assert sum(p.contains(Point(x, y)) for p in polygons) == 1
    # without separation they stay one blob
    assert len(mask_to_polygons(mask, PolygonOptions(separate=False))) == 1


def test_separation_leaves_single_buildings_whole():
    import cv2

    l_shape = np.zeros((80, 80), bool)
    l_shape[10:70, 10:30] = True
    l_shape[50:70, 10:70] = True
    rotated = np.zeros((120, 120), np.uint8)
    cv2.fillPoly(rotated, [np.round(cv2.boxPoints(((60, 60), (90, 24), 20))).astype(np.int32)], 1)
    for mask in (l_shape, rotated.astype(bool)):
        assert len(mask_to_polygons(mask, PolygonOptions(min_area_px=10))) == 1
    # three in a row, each pair joined by a narrow bridge
    row = np.zeros((60, 160), bool)
    for x0 in (10, 60, 110):
        row[10:50, x0 : x0 + 40] = True
    row[25:35, 50:60] = row[25:35, 100:110] = True
    assert len(mask_to_polygons(row, PolygonOptions(min_area_px=10))) == 3


def test_transform_places_polygons_on_the_map():
    from affine import Affine

    mask = np.zeros((50, 50), bool)
    mask[10:20, 30:40] = True
    transform = Affine(0.5, 0, 362000.0, 0, -0.5, 4102000.0)
    (poly,) = mask_to_polygons(mask, transform=transform)
    assert poly.bounds == pytest.approx((362015.0, 4101990.0, 362020.0, 4101995.0))
    assert poly.area == pytest.approx(100 * 0.25)


def test_deterministic():
    rng = np.random.default_rng(0)
    mask = np.zeros((256, 256), bool)
    for _ in range(40):
        x, y = rng.integers(0, 230, 2)
        w, h = rng.integers(6, 26, 2)
        mask[y : y + h, x : x + w] = True
    a = mask_to_polygons(mask, PolygonOptions(min_area_px=10))
    b = mask_to_polygons(mask.copy(), PolygonOptions(min_area_px=10))
    assert [p.wkt for p in a] == [p.wkt for p in b]
    assert all(p.is_valid for p in a)
    # no two polygons overlap (touching along an edge is allowed)
    for i, p in enumerate(a):
        for q in a[i + 1 :]:
            assert p.intersection(q).area < 1.0
