"""Window arithmetic at tile borders: property tests plus hand-computed cases."""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data_prep.spec import ChipSpec
from data_prep.windows import (
    ChipWindow,
    chip_window,
    covered_fraction,
    crop_boundless,
    resize_chip,
    window_overlap,
)

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
def test_resize_chip_matches_opencv_area_and_linear(side, chip_size, seed):
    chip = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = resize_chip(chip, chip_size)
    assert out.shape == (chip_size, chip_size, 3) and out.dtype == np.uint8
    if side > chip_size:
        expected = cv2.resize(chip, (chip_size, chip_size), interpolation=cv2.INTER_AREA)
    elif side < chip_size:
        expected = cv2.resize(chip, (chip_size, chip_size), interpolation=cv2.INTER_LINEAR)
    else:
        expected = chip
    np.testing.assert_array_equal(out, expected)


def test_resize_chip_area_average_by_hand():
    # 4x4 -> 2x2 area averaging: each output is the mean of a 2x2 block
    chip = np.zeros((4, 4, 3), np.uint8)
    chip[:2, :2] = 40
    chip[2:, 2:] = 200
    chip[0, 2] = 100
    out = resize_chip(chip, 2)
    assert out[0, 0, 0] == 40 and out[1, 1, 0] == 200 and out[0, 1, 0] == 25 and out[1, 0, 0] == 0
    # 3x3 -> 2x2 (non-integer ratio): output (0, 0) covers 1.5x1.5 source pixels
    chip = np.zeros((3, 3, 3), np.uint8)
    chip[0, 0] = 90
    chip[1, 1] = 90
    out = resize_chip(chip, 2)
    # weights: (1 * 1 * 90 + 0.5 * 0.5 * 90) / 2.25 = 50
    assert out[0, 0, 0] == 50
    assert math.isclose(float(out[1, 1, 0]), 0.25 * 90 / 2.25, abs_tol=0.5)


def test_resize_chip_float_path_is_exact_over_many_sizes():
    rng = np.random.default_rng(7)
    for side in range(129, 420, 7):
        chip = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
        expected = cv2.resize(chip, (128, 128), interpolation=cv2.INTER_AREA)
        np.testing.assert_array_equal(resize_chip(chip, 128), expected, err_msg=f"side {side}")
