"""`prepare scene`: mosaicking, warping, footprints and chip cutting on the synthetic scene.

The synthetic scene (data_prep.synthetic_scene) knows by construction which buildings lie fully
inside both pre and post imagery and what class each has; the real-data tests check the same
behaviour and the pre/post alignment on the Joplin GeoTIFFs.
"""

from __future__ import annotations

import numpy as np
import pytest

from data_prep.footprint_cover import footprint_valid
from data_prep.scene import iter_building_chips, plan_reads
from data_prep.scene_store import SceneOptions, prepare_scene
from data_prep.spec import CLASS_NAMES, ChipSpec
from data_prep.store import MANIFEST, ChipReader, read_manifest, read_meta
from data_prep.windows import chip_window
from tests.conftest import shared_data


def edge_map(chip: np.ndarray) -> np.ndarray:
    """Sobel gradient magnitude of a lightly smoothed grey chip."""
    import cv2

    grey = cv2.GaussianBlur(cv2.cvtColor(chip, cv2.COLOR_RGB2GRAY).astype(np.float32), (0, 0), 1.0)
    return np.hypot(cv2.Sobel(grey, cv2.CV_32F, 1, 0), cv2.Sobel(grey, cv2.CV_32F, 0, 1))


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    a = a.ravel().astype(np.float64) - a.mean()
    b = b.ravel().astype(np.float64) - b.mean()
    return float((a * b).sum() / np.sqrt((a * a).sum() * (b * b).sum() + 1e-12))


def matched_vs_shuffled(
    pairs: list[tuple[np.ndarray, np.ndarray]], seed: int = 0
) -> tuple[float, float]:
    """Mean edge correlation of pre/post of the same building and of mismatched buildings."""
    edges = [(edge_map(p), edge_map(q)) for p, q in pairs]
    rng = np.random.default_rng(seed)
    n = len(edges)
    perm = rng.permutation(n)
    while n > 1 and (perm == np.arange(n)).any():
        perm = rng.permutation(n)
    matched = np.mean([correlation(a, b) for a, b in edges])
    shuffled = np.mean([correlation(edges[i][0], edges[j][1]) for i, j in enumerate(perm)])
    return float(matched), float(shuffled)


def load_pairs(root, frame):
    reader = ChipReader(root)
    return [reader.pair(row) for _, row in frame.iterrows()]


@pytest.fixture(scope="module")
def bad_inputs(synthetic_scene, tmp_path_factory):
    from data_prep.synthetic_scene import make_bad_scene_inputs

    return make_bad_scene_inputs(tmp_path_factory.mktemp("bad_scene"), synthetic_scene)


@pytest.fixture(scope="module")
def scene_store(synthetic_scene, tmp_path_factory):
    out = tmp_path_factory.mktemp("scene_chips")
    report = prepare_scene(
        synthetic_scene.pre,
        synthetic_scene.post,
        synthetic_scene.buildings,
        out,
        options=SceneOptions(label_field=synthetic_scene.label_field),
        progress=False,
    )
    return out, report


def run(tmp_path, scene, *, pre=None, post=None, buildings=None, label_field="damage", name="out"):
    out = tmp_path / name
    report = prepare_scene(
        list(pre if pre is not None else scene.pre),
        list(post if post is not None else scene.post),
        buildings if buildings is not None else scene.buildings,
        out,
        options=SceneOptions(label_field=label_field),
        progress=False,
    )
    return out, report


def messages(report) -> list[str]:
    return [str(s) for s in report.skipped]


# --- the scene grid and the mosaics ---------------------------------------------------------


def test_pre_grid_is_the_pre_crs_at_the_finest_pre_resolution(synthetic_scene):
    from data_prep.mosaic import open_scene

    with open_scene(synthetic_scene.pre, synthetic_scene.post) as scene:
        assert scene.grid.crs.to_epsg() == 32615
        assert scene.grid.res == pytest.approx(0.5)
        assert (scene.grid.width, scene.grid.height) == (512, 256)
        assert scene.skipped == []


def test_pre_mosaic_reads_the_tiles_unchanged_across_their_seam(synthetic_scene):
    import rasterio

    from data_prep.mosaic import open_scene

    with rasterio.open(synthetic_scene.pre[0]) as w, rasterio.open(synthetic_scene.pre[1]) as e:
        expected = np.concatenate([w.read(), e.read()], axis=2)  # [3, 256, 512]
    with open_scene(synthetic_scene.pre, synthetic_scene.post) as scene:
        rgb, valid = scene.pre.read(200, 40, 112, 100)  # crosses the seam at column 256
        outside, outside_valid = scene.pre.read(-30, -30, 40, 40)
    np.testing.assert_array_equal(rgb, np.moveaxis(expected[:, 40:140, 200:312], 0, -1))
    assert valid.all()
    assert not outside_valid[:30].any() and not outside_valid[:, :30].any()
    assert outside_valid[30:, 30:].all()
    assert (outside[:30] == 0).all()


def test_post_mosaic_is_invalid_outside_its_tiles_and_in_its_nodata_hole(synthetic_scene):
    from data_prep.mosaic import open_scene

    with open_scene(synthetic_scene.pre, synthetic_scene.post) as scene:
        _, valid = scene.post.read(0, 0, scene.grid.width, scene.grid.height)
    # post stops about 205 m (410 px) east of the pre origin and has a small nodata hole
    assert valid[:, :400].mean() > 0.99
    assert not valid[:, 420:].any()
    assert not valid[:, :400].all()


# --- chips ------------------------------------------------------------------------------------


def test_chips_for_exactly_the_covered_buildings(synthetic_scene, scene_store):
    out, report = scene_store
    frame = read_manifest(out)
    assert sorted(frame["uid"]) == sorted(synthetic_scene.covered_uids)
    assert report.chips == synthetic_scene.covered == len(frame)
    assert report.not_covered == synthetic_scene.not_covered
    assert report.skipped == []
    assert report.exit_code() == 0


def test_labels_come_from_the_attribute(synthetic_scene, scene_store):
    out, report = scene_store
    frame = read_manifest(out)
    assert dict(report.per_class) == {k: v for k, v in synthetic_scene.per_class.items() if v}
    counts = {name: int((frame["label"] == k).sum()) for k, name in enumerate(CLASS_NAMES)}
    assert counts == synthetic_scene.per_class
    assert (frame["label_name"] == [CLASS_NAMES[v] for v in frame["label"]]).all()


def test_manifest_and_shards_follow_the_store_format(synthetic_scene, scene_store):
    out, _ = scene_store
    frame = read_manifest(out)
    meta = read_meta(out)
    assert meta["source"] == "scene"
    assert ChipSpec.from_dict(meta["spec"]) == ChipSpec()
    assert meta["crs"] == "EPSG:32615"
    assert set(frame["tile"]) == set(frame["event"]) == {"buildings"}
    assert (frame["chip_id"] == "buildings:" + frame["uid"]).all()
    reader = ChipReader(out)
    for _, row in frame.iterrows():
        pre, post = reader.pair(row)
        assert pre.shape == post.shape == (128, 128, 3) and pre.dtype == np.uint8
        bbox = (row.bbox_minx, row.bbox_miny, row.bbox_maxx, row.bbox_maxy)
        centre = ((bbox[0] + bbox[2]) / 2, (bbox[1] + bbox[3]) / 2)
        assert row.win_size == chip_window(centre, bbox, ChipSpec()).size
        # the window is centred on the footprint
        assert abs(row.win_col + row.win_size / 2 - centre[0]) < row.win_size / 4
        assert abs(row.win_row + row.win_size / 2 - centre[1]) < row.win_size / 4
    assert list(frame["uid"]) == sorted(frame["uid"])  # footprint file order


def test_lon_lat_lie_within_the_scene(synthetic_scene, scene_store):
    out, _ = scene_store
    frame = read_manifest(out)
    west, south, east, north = synthetic_scene.lonlat_bounds
    assert frame["lon"].notna().all() and frame["lat"].notna().all()
    assert frame["lon"].between(west, east).all()
    assert frame["lat"].between(south, north).all()


def test_geopackage_in_another_crs_gives_the_same_chips(synthetic_scene, scene_store, tmp_path):
    out, _ = scene_store
    gpkg_out, report = run(tmp_path, synthetic_scene, buildings=synthetic_scene.buildings_gpkg)
    a, b = read_manifest(out), read_manifest(gpkg_out)
    assert report.chips == synthetic_scene.covered
    cols = ["uid", "label", "win_col", "win_row", "win_size"]
    assert a[cols].equals(b[cols])
    np.testing.assert_allclose(a[["lon", "lat"]], b[["lon", "lat"]], atol=1e-6)
    for (p1, q1), (p2, q2) in zip(load_pairs(out, a), load_pairs(gpkg_out, b), strict=True):
        np.testing.assert_array_equal(p1, p2)
        np.testing.assert_array_equal(q1, q2)


def test_pre_and_post_chips_line_up(synthetic_scene, scene_store):
    out, _ = scene_store
    frame = read_manifest(out)
    intact = frame[frame["uid"].isin(synthetic_scene.no_damage_uids)]
    pairs = load_pairs(out, intact)
    assert len(pairs) >= 4
    mad_same = np.mean([np.abs(p.astype(int) - q.astype(int)).mean() for p, q in pairs])
    mad_other = np.mean(
        [
            np.abs(p.astype(int) - pairs[(i + 1) % len(pairs)][1].astype(int)).mean()
            for i, (p, _) in enumerate(pairs)
        ]
    )
    assert mad_same < 12 and mad_same < 0.4 * mad_other
    matched, shuffled = matched_vs_shuffled(pairs)
    assert matched > 0.8 and matched > shuffled + 0.5
    # all classes, damaged roofs included (measured: matched 0.73, shuffled 0.17)
    matched, shuffled = matched_vs_shuffled(load_pairs(out, frame))
    assert matched > 0.6 and matched > shuffled + 0.3


def test_small_blocks_give_the_same_chips_and_never_read_the_whole_scene(synthetic_scene):
    """Reads of small blocks (and no margin around them) cut the chips of whole-scene blocks."""
    from data_prep.footprints import load_footprints
    from data_prep.mosaic import open_scene

    with open_scene(synthetic_scene.pre, synthetic_scene.post) as scene:
        footprints = load_footprints(
            synthetic_scene.buildings, scene.grid.crs, label_field="damage"
        )
        reference = {
            b.uid: (b.pre, b.post)
            for b in iter_building_chips(
                scene,
                footprints,
                ChipSpec(),
                progress=False,
                plan=plan_reads(scene, footprints, ChipSpec(), margin=0),
            )
            if b.status == "chip"
        }
        sizes = []
        read_pair = scene.read_pair

        def recording(col_off, row_off, width, height):
            sizes.append(width * height)
            return read_pair(col_off, row_off, width, height)

        scene.read_pair = recording
        chips = [
            b
            for b in iter_building_chips(
                scene,
                footprints,
                ChipSpec(),
                progress=False,
                plan=plan_reads(scene, footprints, ChipSpec(), 64, margin=0),
            )
            if b.status == "chip"
        ]
        area = scene.grid.width * scene.grid.height
    assert len(chips) == synthetic_scene.covered
    assert sorted(b.uid for b in chips) == sorted(reference)
    for b in chips:
        np.testing.assert_array_equal(b.pre, reference[b.uid][0])  # pre is on its own grid
        # warped post may differ by one grey level of resampling rounding, no more
        diff = np.abs(b.post.astype(int) - reference[b.uid][1])
        assert diff.max() <= 1 and diff.mean() < 0.05
    assert len(sizes) > 4 and max(sizes) < area / 4


def test_footprint_valid_needs_every_footprint_pixel():
    import shapely

    valid = np.ones((20, 20), dtype=bool)
    square = shapely.box(12.0, 12.0, 16.0, 16.0)  # pixels 12-15 of a block at (10, 10)
    assert footprint_valid(square, valid, 10, 10)
    valid[5, 5] = False  # pixel (15, 15) of the grid
    assert not footprint_valid(square, valid, 10, 10)
    valid[5, 5] = True
    assert not footprint_valid(
        shapely.box(8.0, 12.0, 12.0, 16.0), valid, 10, 10
    )  # leaves the block
    tiny = shapely.box(14.6, 14.6, 14.9, 14.9)  # holds no pixel centre: judged at its centroid
    assert footprint_valid(tiny, valid, 10, 10)
    valid[4, 4] = False
    assert not footprint_valid(tiny, valid, 10, 10)


# --- raster inputs that are not plain 3-band uint8 --------------------------------------------


def test_uint16_tile_is_stretched_once_per_mosaic(
    synthetic_scene, scene_store, bad_inputs, tmp_path
):
    from data_prep.mosaic import open_scene

    out, _ = scene_store
    west = synthetic_scene.pre[0]
    out16, report = run(tmp_path, synthetic_scene, pre=[west, bad_inputs.uint16])
    assert report.chips == synthetic_scene.covered and report.skipped == []
    a, b = read_manifest(out), read_manifest(out16)
    east = a["bbox_minx"] > 300  # chips entirely in the east (uint16) tile
    assert east.sum() >= 5
    pre8 = [p for p, _ in load_pairs(out, a[east])]
    pre16 = [p for p, _ in load_pairs(out16, b[east])]
    corr = [
        correlation(p[..., k], q[..., k])
        for p, q in zip(pre8, pre16, strict=True)
        for k in range(3)
    ]
    assert np.median(corr) > 0.95 and min(corr) > 0.7  # clipping at 2%/98% lowers a few

    with open_scene(synthetic_scene.pre, synthetic_scene.post) as scene8:
        x, _ = scene8.pre.read(256, 0, 256, 256)
    with open_scene([west, bad_inputs.uint16], synthetic_scene.post) as scene16:
        y, valid = scene16.pre.read(256, 0, 256, 256)
        small, _ = scene16.pre.read(300, 100, 40, 30)
    assert valid.all()
    # the same stretch whatever the window ...
    np.testing.assert_array_equal(small, y[100:130, 44:84])
    # ... and one increasing linear map per band from the uint8 original (clipped ends aside)
    x, y = x.reshape(-1, 3).astype(float), y.reshape(-1, 3).astype(float)
    for band in range(3):
        inside = (y[:, band] > 0) & (y[:, band] < 255)
        assert inside.mean() > 0.9
        slope, intercept = np.polyfit(x[inside, band], y[inside, band], 1)
        assert slope > 0.5
        assert np.abs(y[inside, band] - (slope * x[inside, band] + intercept)).max() < 1.0


@pytest.mark.parametrize("variant", ["rgba", "rgbn"])
def test_four_band_tiles_use_the_first_three_bands(
    synthetic_scene, scene_store, bad_inputs, tmp_path, variant
):
    out, _ = scene_store
    out4, report = run(
        tmp_path, synthetic_scene, pre=[synthetic_scene.pre[0], getattr(bad_inputs, variant)]
    )
    assert report.chips == synthetic_scene.covered and report.skipped == []
    for (p1, q1), (p2, q2) in zip(
        load_pairs(out, read_manifest(out)), load_pairs(out4, read_manifest(out4)), strict=True
    ):
        np.testing.assert_array_equal(p1, p2)
        np.testing.assert_array_equal(q1, q2)


# --- bad inputs -------------------------------------------------------------------------------


def test_raster_without_crs_is_refused_and_the_rest_goes_on(synthetic_scene, bad_inputs, tmp_path):
    _, report = run(tmp_path, synthetic_scene, pre=[synthetic_scene.pre[0], bad_inputs.no_crs])
    (msg,) = messages(report)
    assert str(bad_inputs.no_crs) in msg and "no CRS" in msg
    assert 0 < report.chips < synthetic_scene.covered  # the east half is not covered now
    assert report.chips + report.not_covered == synthetic_scene.n_buildings
    assert report.exit_code() == 0 and report.exit_code(strict=True) == 1


def test_corrupt_tile_is_skipped_with_its_name(synthetic_scene, bad_inputs, tmp_path):
    _, report = run(tmp_path, synthetic_scene, pre=[*synthetic_scene.pre, bad_inputs.corrupt])
    (msg,) = messages(report)
    assert str(bad_inputs.corrupt) in msg and "cannot be read" in msg
    assert report.chips == synthetic_scene.covered


def test_truncated_tile_is_skipped_with_its_name(synthetic_scene, bad_inputs, tmp_path):
    _, report = run(tmp_path, synthetic_scene, post=[bad_inputs.truncated, *synthetic_scene.post])
    (msg,) = messages(report)
    assert str(bad_inputs.truncated) in msg and "truncated" in msg
    assert report.chips == synthetic_scene.covered


def test_tile_failing_mid_run_is_dropped_and_the_run_goes_on(synthetic_scene, bad_inputs, tmp_path):
    # the overviews of this truncated COG read (so it opens), its full-resolution blocks do not
    _, report = run(
        tmp_path, synthetic_scene, pre=[synthetic_scene.pre[0], bad_inputs.truncated_cog]
    )
    (msg,) = messages(report)
    assert str(bad_inputs.truncated_cog) in msg and "read failed, tile dropped" in msg
    assert 0 < report.chips < synthetic_scene.covered
    assert report.chips + report.not_covered == synthetic_scene.n_buildings


def test_one_band_tile_is_refused(synthetic_scene, bad_inputs, tmp_path):
    _, report = run(tmp_path, synthetic_scene, pre=[synthetic_scene.pre[0], bad_inputs.one_band])
    (msg,) = messages(report)
    assert str(bad_inputs.one_band) in msg and "1 band" in msg


def test_no_usable_pre_tile_produces_nothing(synthetic_scene, bad_inputs, tmp_path):
    out, report = run(tmp_path, synthetic_scene, pre=[bad_inputs.corrupt, bad_inputs.one_band])
    (msg,) = messages(report)
    assert "pre" in msg and str(bad_inputs.corrupt) in msg and str(bad_inputs.one_band) in msg
    assert report.chips == 0 and report.exit_code() == 1
    assert not (out / MANIFEST).exists()


def test_footprints_outside_the_imagery_are_a_clear_error(synthetic_scene, bad_inputs, tmp_path):
    out, report = run(tmp_path, synthetic_scene, buildings=bad_inputs.outside)
    (msg,) = messages(report)
    assert str(bad_inputs.outside) in msg and "overlaps" in msg
    assert report.chips == 0 and report.exit_code() == 1
    assert not (out / MANIFEST).exists()


def test_bad_label_value_skips_that_building(synthetic_scene, bad_inputs, tmp_path):
    out, report = run(tmp_path, synthetic_scene, buildings=bad_inputs.bad_label)
    (msg,) = messages(report)
    assert str(bad_inputs.bad_label) in msg and "b000" in msg and "wrecked" in msg
    assert report.chips == synthetic_scene.covered - 1
    assert "b000" not in set(read_manifest(out)["uid"])


def test_unknown_label_field_names_the_file_and_its_attributes(synthetic_scene, tmp_path):
    _, report = run(tmp_path, synthetic_scene, label_field="grade")
    (msg,) = messages(report)
    assert str(synthetic_scene.buildings) in msg and "'grade'" in msg and "damage" in msg
    assert report.exit_code() == 1


@pytest.mark.parametrize(
    ("variant", "words"), [("empty", "no features"), ("unreadable", "cannot be read")]
)
def test_empty_or_unreadable_footprint_file(synthetic_scene, bad_inputs, tmp_path, variant, words):
    path = getattr(bad_inputs, variant)
    _, report = run(tmp_path, synthetic_scene, buildings=path)
    (msg,) = messages(report)
    assert str(path) in msg and words in msg
    assert report.exit_code() == 1


def test_without_label_field_chips_are_unlabelled(synthetic_scene, tmp_path):
    out, report = run(tmp_path, synthetic_scene, label_field=None)
    frame = read_manifest(out)
    assert report.unlabelled == report.chips == synthetic_scene.covered
    assert (frame["label"] == -1).all() and (frame["label_name"] == "").all()


# --- the command line -------------------------------------------------------------------------


def test_cli_prepare_scene(synthetic_scene, tmp_path, capsys):
    from cli.main import main

    out = tmp_path / "cli"
    args = [
        "prepare",
        "scene",
        "--pre",
        *map(str, synthetic_scene.pre),
        "--post",
        *map(str, synthetic_scene.post),
    ]
    args += [
        "--buildings",
        str(synthetic_scene.buildings),
        "--label-field",
        "damage",
        "--event",
        "synthetic-storm",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert f"chips written: {synthetic_scene.covered}" in err
    assert f"not covered by both pre and post imagery: {synthetic_scene.not_covered}" in err
    frame = read_manifest(out)
    assert set(frame["event"]) == {"synthetic-storm"} and len(frame) == synthetic_scene.covered


def test_cli_strict_fails_on_a_skipped_tile(synthetic_scene, bad_inputs, tmp_path, capsys):
    from cli.main import main

    args = ["prepare", "scene", "--pre", *map(str, synthetic_scene.pre), str(bad_inputs.corrupt)]
    args += [
        "--post",
        *map(str, synthetic_scene.post),
        "--buildings",
        str(synthetic_scene.buildings),
        "--out",
        str(tmp_path / "o"),
    ]
    assert main(args) == 0
    assert main([*args, "--strict"]) == 1
    assert str(bad_inputs.corrupt) in capsys.readouterr().err


# --- real data --------------------------------------------------------------------------------


@pytest.mark.realdata
def test_joplin_geotiff_chips_the_covered_buildings_and_lines_them_up(tmp_path):
    root = shared_data("joplin_geotiff")
    import pyogrio

    footprints = root / "footprints" / "joplin.geojson"
    total = pyogrio.read_info(footprints)["features"]
    report = prepare_scene(
        sorted((root / "pre").glob("*.tif")),
        sorted((root / "post").glob("*.tif")),
        footprints,
        tmp_path / "joplin",
        progress=False,
    )
    assert report.skipped == []
    assert 100 < report.chips < total
    assert report.chips + report.not_covered + len(report.skipped) == total
    frame = read_manifest(tmp_path / "joplin")
    assert len(frame) == report.chips and frame["uid"].is_unique
    assert frame["lon"].between(-94.51, -94.47).all() and frame["lat"].between(37.05, 37.09).all()
    matched, shuffled = matched_vs_shuffled(load_pairs(tmp_path / "joplin", frame))
    # Measured: 363 chips, matched 0.129, shuffled 0.016 (tornado damage lowers both).
    assert matched > 0.08 and matched > 4 * max(shuffled, 0.01)


@pytest.mark.realdata
def test_joplin_geopackage_footprints(tmp_path):
    root = shared_data("joplin_geotiff")
    import pyogrio

    footprints = root / "footprints" / "bldg_polys.gpkg"
    total = pyogrio.read_info(footprints)["features"]
    report = prepare_scene(
        sorted((root / "pre").glob("*.tif")),
        sorted((root / "post").glob("*.tif")),
        footprints,
        tmp_path / "gpkg",
        progress=False,
    )
    assert report.chips + report.not_covered + len(report.skipped) == total


def test_large_synthetic_scene_is_written_block_by_block(tmp_path):
    import geopandas as gpd
    import rasterio

    from data_prep.synthetic_scene import make_large_scene

    n = make_large_scene(tmp_path / "s", 600, spacing=100)
    assert n == 36
    for name in ("pre/pre.tif", "post/post.tif"):
        with rasterio.open(tmp_path / "s" / name) as src:
            assert (src.width, src.height, src.count) == (600, 600, 3)
            assert src.crs.to_epsg() == 32615 and src.block_shapes[0] == (512, 512)
    with (
        rasterio.open(tmp_path / "s/pre/pre.tif") as a,
        rasterio.open(tmp_path / "s/post/post.tif") as b,
    ):
        assert (a.read() != b.read()).any()  # damage drawn in post
    assert len(gpd.read_file(tmp_path / "s" / "buildings.geojson")) == n


def test_unusable_pre_and_post_are_each_named_under_their_own_date(synthetic_scene, tmp_path):
    """Each date's unusable files are listed under that date, never the post under "pre"."""
    from data_prep.errors import LocalDamageError
    from data_prep.mosaic import open_scene

    missing_pre, missing_post = tmp_path / "gone_pre.tif", tmp_path / "gone_post.tif"
    with pytest.raises(LocalDamageError) as both:
        open_scene([missing_pre], [missing_post])
    text = str(both.value)
    pre_part, post_part = text.split("none of the 1 post tile(s)")
    assert "gone_pre.tif" in pre_part and "gone_post.tif" not in pre_part
    assert "gone_post.tif" in post_part
    with pytest.raises(LocalDamageError) as post_only:
        open_scene(synthetic_scene.pre, [missing_post])
    assert "post imagery" in str(post_only.value) and "gone_pre" not in str(post_only.value)
    assert "pre tile(s)" not in str(post_only.value)
