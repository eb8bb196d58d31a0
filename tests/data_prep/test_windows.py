"""Window arithmetic at tile borders: property tests plus hand-computed cases."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data_prep.spec import ChipSpec
from data_prep.windows import (
    ChipWindow,
    building_window,
    chip_window,
    covered_fraction,
    crop_boundless,
    cut_building,
    cut_pair,
    resize_chip,
    window_overlap,
)
from data_prep.xbd_tiles import Building

coords = st.floats(min_value=-500, max_value=1500, allow_nan=False, allow_infinity=False)
extents = st.floats(min_value=0, max_value=400, allow_nan=False, allow_infinity=False)
specs = st.builds(
    ChipSpec,
    chip_size=st.integers(8, 256),
    context=st.floats(min_value=0.1, max_value=5, allow_nan=False),
    min_size=st.integers(1, 128),
)


@st.composite
def image_and_window(draw):
    height = draw(st.integers(1, 24))
    width = draw(st.integers(1, 24))
    channels = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    image = np.random.default_rng(seed).integers(1, 256, (height, width, channels), dtype=np.uint8)
    size = draw(st.integers(1, 40))
    col = draw(st.integers(-45, width + 5))
    row = draw(st.integers(-45, height + 5))
    return image, ChipWindow(col, row, size)


@given(image_and_window())
def test_crop_boundless_equals_padding_then_slicing(case):
    image, window = case
    pad = 50
    padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)), constant_values=0)
    expected = padded[
        window.row_off + pad : window.row_off + pad + window.size,
        window.col_off + pad : window.col_off + pad + window.size,
    ]
    got = crop_boundless(image, window)
    assert got.shape == (window.size, window.size, image.shape[2])
    assert got.dtype == image.dtype
    np.testing.assert_array_equal(got, expected)


@given(image_and_window())
def test_overlap_slices_stay_in_bounds(case):
    image, window = case
    height, width = image.shape[:2]
    src_r, src_c, dst_r, dst_c = window_overlap(window, height, width)
    for s, limit in ((src_r, height), (src_c, width), (dst_r, window.size), (dst_c, window.size)):
        assert 0 <= s.start <= s.stop <= limit
    assert src_r.stop - src_r.start == dst_r.stop - dst_r.start
    assert src_c.stop - src_c.start == dst_c.stop - dst_c.start
    inside = (src_r.stop - src_r.start) * (src_c.stop - src_c.start)
    assert covered_fraction(window, height, width) == pytest.approx(inside / window.size**2)
    # the pixels that come from the image are exactly the non-zero ones (image values are >= 1)
    chip = crop_boundless(image, window)
    assert int((chip[..., 0] != 0).sum()) == inside


@given(coords, coords, extents, extents, specs)
def test_window_centre_and_size_rule(cx, cy, w, h, spec):
    bbox = (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)
    window = chip_window((cx, cy), bbox, spec)
    assert abs(window.col_off + window.size / 2 - cx) <= 0.5 + 1e-9
    assert abs(window.row_off + window.size / 2 - cy) <= 0.5 + 1e-9
    need = max(spec.min_size, spec.context * max(bbox[2] - bbox[0], bbox[3] - bbox[1]))
    # the smallest whole number of pixels that is at least the required side
    assert window.size >= need - 1e-9
    assert window.size - 1 < need
    assert window.size >= spec.min_size


def test_window_hand_computed():
    spec = ChipSpec(chip_size=32, context=2.0, min_size=8)
    # longest side 10 -> 20 px; centre (10.3, 20.7) -> offsets floor(0.8)=0, floor(11.2)=11
    assert chip_window((10.3, 20.7), (5, 15, 15, 25), spec) == ChipWindow(0, 11, 20)
    # a small building gets min_size; centre 2.5 with an even size 8 -> offset floor(-1.0) = -1
    assert chip_window((2.5, 2.5), (2, 2, 3, 3), spec) == ChipWindow(-1, -1, 8)
    # 2.0 * 7.25 = 14.5 -> 15 px (odd): centre 100 -> offset floor(100 - 7.5 + 0.5) = 93
    assert chip_window((100.0, 50.0), (96.375, 48, 103.625, 52), spec) == ChipWindow(93, 43, 15)


def test_crop_and_overlap_hand_computed():
    image = np.arange(1, 17, dtype=np.uint8).reshape(4, 4, 1)
    chip = crop_boundless(image, ChipWindow(-1, -1, 3))[..., 0]
    np.testing.assert_array_equal(chip, [[0, 0, 0], [0, 1, 2], [0, 5, 6]])
    chip = crop_boundless(image, ChipWindow(3, 2, 3), fill=9)[..., 0]
    np.testing.assert_array_equal(chip, [[12, 9, 9], [16, 9, 9], [9, 9, 9]])
    assert window_overlap(ChipWindow(-1, -1, 3), 4, 4) == (
        slice(0, 2),
        slice(0, 2),
        slice(1, 3),
        slice(1, 3),
    )
    assert covered_fraction(ChipWindow(-1, -1, 4), 4, 4) == 9 / 16
    # a window that misses the image entirely
    assert covered_fraction(ChipWindow(10, 0, 3), 4, 4) == 0.0
    assert not crop_boundless(image, ChipWindow(10, 0, 3)).any()


@settings(max_examples=40, deadline=None)
@given(st.integers(9, 300), st.sampled_from([8, 32, 64, 128]), st.integers(0, 2**32 - 1))
def test_resize_chip_paths(side, chip_size, seed):
    chip = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = resize_chip(chip, chip_size)
    assert out.shape == (chip_size, chip_size, 3) and out.dtype == np.uint8
    factor = side // chip_size
    if side == chip_size:
        np.testing.assert_array_equal(out, chip)
    elif factor < 2:  # enlarging, or shrinking by less than 2x: plain bilinear
        linear = cv2.resize(chip, (chip_size, chip_size), interpolation=cv2.INTER_LINEAR)
        np.testing.assert_array_equal(out, linear)
    elif side == factor * chip_size:  # integer ratio: exact area averaging
        area = cv2.resize(chip, (chip_size, chip_size), interpolation=cv2.INTER_AREA)
        np.testing.assert_array_equal(out, area)


def test_resize_chip_area_average_by_hand():
    # 4x4 -> 2x2 area averaging: each output is the mean of a 2x2 block
    chip = np.zeros((4, 4, 3), np.uint8)
    chip[:2, :2] = 40
    chip[2:, 2:] = 200
    chip[0, 2] = 100
    out = resize_chip(chip, 2)
    assert out[0, 0, 0] == 40 and out[1, 1, 0] == 200 and out[0, 1, 0] == 25 and out[1, 0, 0] == 0


@pytest.mark.parametrize("side", [300, 333, 420, 457])
def test_resize_chip_shrinking_does_not_alias(side):
    # A one-pixel checkerboard has no content a 128 px chip can show: an anti-aliased resampler
    # gives flat mid-grey, plain bilinear or nearest sampling gives strong moire.
    yy, xx = np.mgrid[:side, :side]
    chip = np.repeat(((yy + xx) % 2 * 255).astype(np.uint8)[..., None], 3, axis=2)
    out = resize_chip(chip, 128).astype(float)
    assert abs(out.mean() - 127.5) < 3 and out.std() < 12
    linear = cv2.resize(chip, (128, 128), interpolation=cv2.INTER_LINEAR).astype(float)
    assert linear.std() > 30  # the test image really aliases without filtering


def test_resize_chip_close_to_area_resampling_on_imagery():
    # On smooth image content the two-step resampler matches OpenCV's area resampling closely.
    rng = np.random.default_rng(3)
    base = cv2.GaussianBlur(rng.integers(0, 256, (420, 420, 3), dtype=np.uint8), (0, 0), 3)
    for side in (260, 333, 419):
        chip = np.ascontiguousarray(base[:side, :side])
        area = cv2.resize(chip, (128, 128), interpolation=cv2.INTER_AREA).astype(float)
        assert np.abs(resize_chip(chip, 128).astype(float) - area).mean() < 2.0, side


def _building(uid: str, bbox: tuple[float, float, float, float]) -> Building:
    minx, miny, maxx, maxy = bbox
    return Building(uid, 0, ((minx + maxx) / 2, (miny + maxy) / 2), bbox, None)


# (name, bbox, covered) on a 40 x 50 (height x width) image
BUILDINGS = [
    ("inside", (10.0, 10.0, 20.0, 18.0), True),
    ("large", (5.0, 5.0, 45.0, 35.0), True),  # window wider than the chip: shrinking path
    ("left edge", (-5.0, 5.0, 4.0, 15.0), True),
    ("bottom right corner", (45.0, 35.0, 55.0, 45.0), True),
    ("left", (-6.0, 10.0, 0.0, 14.0), False),  # touches x = 0 from outside
    ("top", (10.0, -9.5, 14.0, -0.5), False),
    ("right", (50.0, 10.0, 56.0, 14.0), False),  # starts at x = width
    ("bottom", (10.0, 41.0, 14.0, 45.0), False),
]


def test_cut_building_matches_window_and_cut_pair():
    height, width = 40, 50
    rng = np.random.default_rng(0)
    pre = rng.integers(1, 256, (height, width, 3), dtype=np.uint8)
    post = rng.integers(1, 256, (height, width, 3), dtype=np.uint8)
    spec = ChipSpec(chip_size=16, context=2.0, min_size=8)
    pre_rows = np.full((len(BUILDINGS), 16, 16, 3), 7, np.uint8)
    post_rows = np.full_like(pre_rows, 7)
    for i, (name, bbox, covered) in enumerate(BUILDINGS):
        b = _building(name, bbox)
        window = chip_window(b.centroid, b.bbox, spec)
        expected = cut_pair(pre, post, window, spec.chip_size)
        # outside or not, the window itself is the plain chip window
        kept = cut_building(pre, post, b, spec, keep_outside=True)
        assert kept is not None and kept.window == window, name
        np.testing.assert_array_equal(kept.pre, expected[0], err_msg=name)
        np.testing.assert_array_equal(kept.post, expected[1], err_msg=name)
        out = (pre_rows[i], post_rows[i])
        cut = cut_building(pre, post, b, spec, out=out)
        if not covered:
            assert building_window(b, spec, height, width) is None, name
            assert cut_building(pre, post, b, spec) is None, name
            assert cut is None and (pre_rows[i] == 7).all() and (post_rows[i] == 7).all(), name
            continue
        assert building_window(b, spec, height, width) == window, name
        plain = cut_building(pre, post, b, spec)
        assert plain is not None and cut is not None, name
        for got in (plain, cut):
            window_got, pre_chip, post_chip = got
            assert window_got == window, name
            assert pre_chip.shape == (16, 16, 3) and pre_chip.dtype == np.uint8, name
            np.testing.assert_array_equal(pre_chip, expected[0], err_msg=name)
            np.testing.assert_array_equal(post_chip, expected[1], err_msg=name)
        # out= fills the given arrays (rows of a batch) and returns them
        assert np.shares_memory(cut.pre, pre_rows[i]) and np.shares_memory(cut.post, post_rows[i])
        np.testing.assert_array_equal(pre_rows[i], expected[0], err_msg=name)
        np.testing.assert_array_equal(post_rows[i], expected[1], err_msg=name)
    # the cases are what they say: the left-edge window starts left of the image, and the window
    # of the building touching x = 0 from outside reaches into the image (the check is the bbox)
    edge, touching = _building("", BUILDINGS[2][1]), _building("", BUILDINGS[4][1])
    assert chip_window(edge.centroid, edge.bbox, spec).col_off < 0
    assert covered_fraction(chip_window(touching.centroid, touching.bbox, spec), 40, 50) > 0
