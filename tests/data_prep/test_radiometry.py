"""The radiometric rule (data_prep.radiometry): an image grades the same however it is stored.

An 8-bit scene, its x257 uint16 copy and its /255 float32 copy (same transform and CRS) go
through the real pipeline: `prepare scene` / `prepare xbd` give byte-identical chips and `score`
with the bundled model gives identical grades and probabilities. The other rules (declared
NBITS, the joint stretch of pre and post) are checked on small arrays and files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from data_prep import radiometry
from data_prep.imagery import read_rgb, read_rgb_pair, to_uint8_rgb
from data_prep.scene_store import SceneOptions, prepare_scene
from data_prep.store import ChipReader, read_manifest, read_meta
from data_prep.xbd import prepare_xbd
from tests.conftest import REPO, shared_data

DEFAULT_MODEL = REPO / "models" / "default.onnx"
KINDS = ("uint16", "float32")


def copy_raster(src: Path, dst: Path, kind: str) -> Path:
    """Write ``src`` (uint8) as a x257 uint16 or a /255 float32 GeoTIFF, same grid and CRS."""
    import warnings

    import rasterio
    from rasterio.errors import NotGeoreferencedWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGeoreferencedWarning)
        with rasterio.open(src) as ds:
            assert ds.dtypes[0] == "uint8"
            data = ds.read()
            nodata = ds.nodata
            profile = {
                "driver": "GTiff",
                "width": ds.width,
                "height": ds.height,
                "count": ds.count,
                "crs": ds.crs,
                "transform": ds.transform,
            }
        if kind == "uint16":
            data, nodata = data.astype(np.uint16) * 257, None if nodata is None else nodata * 257
        else:
            data = data.astype(np.float32) / np.float32(255)
            nodata = None if nodata is None else nodata / 255.0
        profile.update(dtype=kind, nodata=nodata)
        if profile["crs"] is None:
            del profile["crs"], profile["transform"]
        dst.parent.mkdir(parents=True, exist_ok=True)
        with rasterio.open(dst, "w", **profile) as out:
            out.write(data)
    return dst


def copy_scene(paths, folder: Path, kind: str) -> list[Path]:
    return [copy_raster(Path(p), folder / f"{Path(p).stem}.tif", kind) for p in paths]


def shards_of(store: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    reader = ChipReader(store)
    return [reader.pair(row) for _, row in read_manifest(store).iterrows()]


def assert_same_store(a: Path, b: Path) -> None:
    fa, fb = read_manifest(a), read_manifest(b)
    assert list(fa["chip_id"]) == list(fb["chip_id"]) and len(fa) > 0
    for (p1, q1), (p2, q2) in zip(shards_of(a), shards_of(b), strict=True):
        np.testing.assert_array_equal(p1, p2)
        np.testing.assert_array_equal(q1, q2)


def scored_features(path: Path) -> list[dict]:
    return [f["properties"] for f in json.loads(path.read_text())["features"]]


@pytest.fixture(scope="module")
def default_predictor():
    from runtime.predictor import Predictor

    return Predictor(DEFAULT_MODEL)


# --- the rule on arrays -------------------------------------------------------------------------


def test_exact_copies_map_back_to_the_8bit_pixels():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (3, 40, 50), dtype=np.uint8)
    expected = np.moveaxis(img, 0, -1)
    for copy in (img.astype(np.uint16) * 257, img.astype(np.float32) / np.float32(255)):
        np.testing.assert_array_equal(to_uint8_rgb(copy, "copy"), expected)
    np.testing.assert_array_equal(to_uint8_rgb(img.astype(np.float64), "f255"), expected)


def test_choose_scaling_follows_the_rule():
    values16 = np.array([0, 257, 514, 65535], dtype=np.uint16)
    assert radiometry.choose_scaling(np.uint16, None, values16).rule == radiometry.MULTIPLE_OF_257
    assert radiometry.choose_scaling(np.uint16, 16, values16 + 1).rule == radiometry.DECLARED_BITS
    twelve = radiometry.choose_scaling(np.uint16, 12, values16)
    assert twelve.rule == radiometry.DECLARED_BITS and twelve.ratio == pytest.approx(255 / 4095)
    # 11-bit values in uint16 with nothing declared: the joint stretch
    assert radiometry.choose_scaling(np.uint16, None, np.array([0, 300, 2047])) is None
    assert radiometry.choose_scaling(np.int16, None, np.array([0, 257])) is None
    assert radiometry.choose_scaling(np.float32, None, np.array([0.0, 1.0])).rule == "float-0-1"
    assert radiometry.choose_scaling(np.float32, None, np.array([0.0, 200.0])).rule == (
        radiometry.FLOAT_255
    )
    assert radiometry.choose_scaling(np.float32, None, np.array([-1.0, 0.5])) is None
    assert radiometry.choose_scaling(np.float32, None, np.array([0.0, 4000.0])) is None


def test_scaling_rounds_half_up_and_clips():
    s = radiometry.Scaling(radiometry.DECLARED_BITS, 255 / 2047)
    got = s.apply(np.array([0, 1000, 2047, 3000, 65535], dtype=np.uint16))
    np.testing.assert_array_equal(got, [0, 125, 255, 255, 255])  # 1000 -> 124.57 -> 125
    half = radiometry.Scaling(radiometry.MULTIPLE_OF_257, 1 / 257)
    np.testing.assert_array_equal(half.apply(np.array([128, 129], dtype=np.uint16)), [0, 1])


def write_tif(path: Path, bands: np.ndarray, **extra) -> Path:
    import warnings

    import rasterio
    from rasterio.errors import NotGeoreferencedWarning

    c, h, w = bands.shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGeoreferencedWarning)
        with rasterio.open(
            path, "w", driver="GTiff", width=w, height=h, count=c, dtype=bands.dtype.name, **extra
        ) as ds:
            ds.write(bands)
    return path


def test_declared_nbits_scales_by_the_bit_depth(tmp_path):
    values = np.array([0, 1, 2048, 4095], dtype=np.uint16)
    bands = np.broadcast_to(values, (3, 4, 4)).copy()
    path = write_tif(tmp_path / "twelve.tif", bands, nbits=12)
    rgb = read_rgb(path)
    np.testing.assert_array_equal(rgb[0, :, 0], [0, 0, 128, 255])


def test_one_stretch_for_pre_and_post_keeps_a_darkening(tmp_path):
    """11-bit data without a declaration: one stretch over both dates, so a post image half as
    bright stays darker (a stretch per image would make the two look alike)."""
    rng = np.random.default_rng(1)
    pre = rng.integers(200, 2000, (3, 64, 64)).astype(np.uint16)
    post = pre // 2
    a = write_tif(tmp_path / "pre.tif", pre)
    b = write_tif(tmp_path / "post.tif", post)
    pre_rgb, post_rgb, scalings = read_rgb_pair(a, b)
    assert scalings[str(a)] == scalings[str(b)]
    assert scalings[str(a)].rule == radiometry.STRETCH
    assert post_rgb.mean() < 0.7 * pre_rgb.mean()
    # alone, each image would be stretched to the full range
    assert read_rgb(b).mean() > 0.9 * read_rgb(a).mean()


# --- the pipeline on exact copies -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_prepare_and_score_scene_are_the_same_on_copies(
    synthetic_scene, default_predictor, tmp_path, kind
):
    from app.scoring.common import ScoreOptions
    from app.scoring.scene import score_scene

    s = synthetic_scene
    pre = copy_scene(s.pre, tmp_path / "pre", kind)
    post = copy_scene(s.post, tmp_path / "post", kind)
    runs = {}
    for name, (p, q) in {"u8": (s.pre, s.post), kind: (pre, post)}.items():
        out = tmp_path / f"chips_{name}"
        options = SceneOptions(label_field=s.label_field)
        report = prepare_scene(p, q, s.buildings, out, options=options, progress=False)
        assert report.chips == s.covered and report.skipped == []
        scored = score_scene(
            default_predictor,
            p,
            q,
            s.buildings,
            tmp_path / f"{name}.geojson",
            options=ScoreOptions(progress=False),
        )
        runs[name] = (out, scored)
    assert_same_store(runs["u8"][0], runs[kind][0])
    rules = set(read_meta(runs[kind][0])["radiometry"].values())
    assert all(r.startswith("multiple-of-257" if kind == "uint16" else "float-0-1") for r in rules)
    a = scored_features(tmp_path / "u8.geojson")
    b = scored_features(tmp_path / f"{kind}.geojson")
    assert [f["status"] for f in a] == [f["status"] for f in b]
    assert sum(f["status"] == "scored" for f in a) == s.covered
    assert a == b  # grades and every probability, bit for bit


@pytest.mark.parametrize("kind", KINDS)
def test_prepare_and_score_xbd_are_the_same_on_copies(
    synthetic_xbd, default_predictor, tmp_path, kind
):
    from app.scoring.common import ScoreOptions
    from app.scoring.xbd import score_xbd

    labels = sorted((synthetic_xbd / "labels").glob("*_post_disaster.json"))[:2]
    roots = {"u8": tmp_path / "u8", kind: tmp_path / kind}
    for name, root in roots.items():
        (root / "labels").mkdir(parents=True)
        for label in labels:
            tile = label.name.replace("_post_disaster.json", "")
            for phase in ("pre", "post"):
                shutil.copy(label.with_name(f"{tile}_{phase}_disaster.json"), root / "labels")
                (src,) = (synthetic_xbd / "images").glob(f"{tile}_{phase}_disaster.*")
                dst = root / "images" / f"{tile}_{phase}_disaster{src.suffix}"
                if name == "u8":
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(src, dst)
                else:
                    copy_raster(src, dst.with_suffix(".tif"), kind)
    for name, root in roots.items():
        report = prepare_xbd(root, tmp_path / f"chips_{name}", progress=False)
        # the synthetic labels hold one polygon with broken WKT on purpose
        assert report.chips > 0 and all("WKT" in s.reason for s in report.skipped)
    assert_same_store(tmp_path / "chips_u8", tmp_path / f"chips_{kind}")

    tile = labels[0].name.replace("_post_disaster.json", "")
    outs = []
    for name, root in roots.items():
        pre, post = (
            next((root / "images").glob(f"{tile}_{p}_disaster.*")) for p in ("pre", "post")
        )
        out = tmp_path / f"{name}.gpkg"
        score_xbd(
            default_predictor,
            pre,
            post,
            root / "labels" / labels[0].name,
            out,
            options=ScoreOptions(progress=False),
        )
        outs.append(out)
    from pyogrio import read_dataframe

    a, b = (read_dataframe(o) for o in outs)
    assert (a["status"] == "scored").sum() > 0
    cols = [c for c in a.columns if c == "damage" or c.startswith("p_") or c == "status"]
    assert a[cols].equals(b[cols])


@pytest.mark.realdata
@pytest.mark.parametrize("kind", KINDS)
def test_joplin_copies_give_the_same_chips_and_grades(default_predictor, tmp_path, kind):
    from app.scoring.common import ScoreOptions
    from app.scoring.scene import score_scene

    root = shared_data("joplin_geotiff")
    pre = [root / "pre" / "tile_1361-9136.tif"]
    post = sorted((root / "post").glob("*.tif"))
    buildings = root / "footprints" / "joplin.geojson"
    copies = (
        copy_scene(pre, tmp_path / "pre", kind),
        copy_scene(post, tmp_path / "post", kind),
    )
    stores, features = [], []
    for name, (p, q) in (("u8", (pre, post)), (kind, copies)):
        out = tmp_path / f"chips_{name}"
        report = prepare_scene(p, q, buildings, out, progress=False)
        assert report.chips > 20
        stores.append(out)
        score_scene(
            default_predictor,
            p,
            q,
            buildings,
            tmp_path / f"{name}.geojson",
            options=ScoreOptions(progress=False),
        )
        features.append(scored_features(tmp_path / f"{name}.geojson"))
    assert_same_store(*stores)
    assert sum(f["status"] == "scored" for f in features[0]) > 20
    assert features[0] == features[1]
