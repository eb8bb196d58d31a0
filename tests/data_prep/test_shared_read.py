"""A small scene is read once: the alignment measurement cuts its blocks from the chips' own read
and the scene keeps that read for the chips (:func:`data_prep.scene.single_read`,
:meth:`data_prep.mosaic.Scene.read_pair` with ``keep``)."""

from __future__ import annotations

import numpy as np
import pytest
import rasterio
from affine import Affine

from data_prep.alignment import align_scene
from data_prep.footprints import load_footprints
from data_prep.mosaic import open_scene
from data_prep.scene import iter_building_chips, pixel_centroids, plan_reads, single_read
from data_prep.spec import ChipSpec
from data_prep.synthetic_scene import make_scene


def _count_post_reads(scene) -> list:
    calls = []
    read = scene.post.read

    def counted(*args):
        calls.append(args)
        return read(*args)

    scene.post.read = counted
    return calls


def _chips(scene, footprints, plan=None) -> list:
    return list(
        iter_building_chips(scene, footprints, ChipSpec(), progress=False, context=True, plan=plan)
    )


def _assert_same_chips(got, want) -> None:
    assert [b.uid for b in got] == [b.uid for b in want]
    for a, b in zip(got, want, strict=True):
        assert (a.status, a.reason) == (b.status, b.reason), a.uid
        if b.pre is None:
            assert a.pre is None, a.uid
            continue
        np.testing.assert_array_equal(a.pre, b.pre)
        np.testing.assert_array_equal(a.post, b.post)
        assert a.context_px == b.context_px, a.uid


def _shared_and_separate(fixture):
    """Chips and post reads of the scene read once (shared) and read as before (separate)."""
    out = {}
    for shared in (True, False):
        with open_scene(fixture.pre, fixture.post) as scene:
            footprints = load_footprints(fixture.buildings, scene.grid.crs)
            calls = _count_post_reads(scene)
            plan = plan_reads(scene, footprints, ChipSpec())
            window = single_read(scene, plan) if shared else None
            shift = align_scene(scene, pixel_centroids(scene.grid, footprints), read=window)
            chips = _chips(scene, footprints, None if shift.applied else plan)
            out[shared] = (window, shift, chips, len(calls), scene.post.offset)
    return out


def test_read_pair_keeps_one_read_for_the_same_window(synthetic_scene):
    with open_scene(synthetic_scene.pre, synthetic_scene.post) as scene:
        kept = scene.read_pair(3, 5, 120, 90, keep=True)
        still = scene.read_pair(3, 5, 120, 90, keep=True)  # asked to keep again: kept again
        again = scene.read_pair(3, 5, 120, 90)
        assert all(a is b for a, b in zip(kept, still, strict=True))
        assert all(a is b for a, b in zip(kept, again, strict=True))
        fresh = scene.read_pair(3, 5, 120, 90)  # handed over once, then read again
        assert not any(a is b for a, b in zip(kept, fresh, strict=True))
        for a, b in zip(kept, fresh, strict=True):
            np.testing.assert_array_equal(a, b)

        scene.read_pair(3, 5, 120, 90, keep=True)
        other = scene.read_pair(0, 0, 64, 64)  # another window: the kept read is forgotten
        assert other[0].shape == (64, 64, 3)
        assert not any(a is b for a, b in zip(kept, scene.read_pair(3, 5, 120, 90), strict=True))

        kept = scene.read_pair(3, 5, 120, 90, keep=True)
        scene.post.set_offset(1.5, -0.75)  # a moved post mosaic is read anew
        moved = scene.read_pair(3, 5, 120, 90)
        assert moved[2] is not kept[2]
        assert not np.array_equal(moved[2], kept[2])


def test_small_scene_is_read_once_and_cut_as_before(synthetic_scene):
    """No shift applied: the chips, their residual shifts and statuses are those of a second,
    separate read of the same window, and the post mosaic is read (warped) once, not twice."""
    out = _shared_and_separate(synthetic_scene)
    window, shift, chips, reads, _ = out[True]
    _, old_shift, want, old_reads, _ = out[False]
    assert window is not None
    assert not shift.applied and not old_shift.applied
    assert sum(b.status == "chip" for b in chips) == synthetic_scene.covered
    _assert_same_chips(chips, want)
    assert (reads, old_reads) == (1, 2)


def test_a_scene_whose_shift_is_applied_is_cut_from_a_new_read(tmp_path):
    """The kept read is of the imagery before the correction: once the shift is applied the chips
    come from a read of the moved post imagery, the same as on a scene moved by hand."""
    fixture = make_scene(tmp_path, seed=3)
    for path in fixture.post:
        with rasterio.open(path, "r+") as ds:
            ds.transform = ds.transform @ Affine.translation(2.6, -1.8)
    window, shift, chips, reads, offset = _shared_and_separate(fixture)[True]
    assert window is not None and shift.applied and offset == (shift.dx, shift.dy)
    assert reads == 2  # measured on the kept read, cut from a new one
    with open_scene(fixture.pre, fixture.post) as scene:
        footprints = load_footprints(fixture.buildings, scene.grid.crs)
        scene.post.set_offset(*offset)
        want = _chips(scene, footprints)
    _assert_same_chips(chips, want)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [64, 1024])
def test_single_read_is_the_window_cutting_reads(synthetic_scene, block_size):
    with open_scene(synthetic_scene.pre, synthetic_scene.post) as scene:
        footprints = load_footprints(synthetic_scene.buildings, scene.grid.crs)
        plan = plan_reads(scene, footprints, ChipSpec(), block_size)
        window = single_read(scene, plan)
        windows = []
        read_pair = scene.read_pair

        def recorded(col, row, width, height):
            windows.append((col, row, width, height))
            return read_pair(col, row, width, height)

        scene.read_pair = recorded
        _chips(scene, footprints, plan)
    assert len(windows) == len(plan.groups)
    if block_size == 64:
        assert len(windows) > 1 and window is None
    else:
        assert windows == [window]
