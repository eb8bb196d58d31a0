"""Input guards: pixel limits before decoding, truncated files, blank imagery, band counts.

Every bad input is a small file made here: a PNG whose header declares 40000 x 40000 pixels, a
truncated PNG and GeoTIFF, an all-zero GeoTIFF, a sparse 200000 x 200000 GeoTIFF, a 5-band
raster. Each goes through `prepare xbd`, `prepare scene`, `score` and the app's assess_tile, and
must give a clear error (or status) naming the file, with nothing partial written.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from data_prep import quality
from data_prep.mosaic import SceneError
from data_prep.scene_store import SceneOptions, prepare_scene
from data_prep.store import MANIFEST, SHARDS, read_manifest
from data_prep.xbd import prepare_xbd
from tests.conftest import REPO

TILE = "guard-event_00000000"


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def huge_png(path: Path, width: int = 40000, height: int = 40000) -> Path:
    """A complete PNG of a few dozen bytes whose IHDR declares ``width`` x ``height`` RGB pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" + b"\x00" * 3 * 16)  # one filtered row of 16 pixels
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", idat)
        + png_chunk(b"IEND", b"")
    )
    return path


def write_raster(path: Path, bands: np.ndarray, like: Path | None = None, **extra) -> Path:
    """Write band-first ``bands`` as a GeoTIFF, on the grid of ``like`` when given."""
    import warnings

    import rasterio
    from rasterio.errors import NotGeoreferencedWarning

    profile = {"driver": "GTiff", "count": bands.shape[0], "dtype": bands.dtype.name}
    profile.update(height=bands.shape[1], width=bands.shape[2])
    if like is not None:
        with rasterio.open(like) as ds:
            profile.update(crs=ds.crs, transform=ds.transform)
    profile.update(extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGeoreferencedWarning)
        with rasterio.open(path, "w", **profile) as ds:
            ds.write(bands)
    return path


def read_bands(path: Path) -> np.ndarray:
    import warnings

    import rasterio
    from rasterio.errors import NotGeoreferencedWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGeoreferencedWarning)
        with rasterio.open(path) as ds:
            return ds.read()


def truncate(src: Path, dst: Path, fraction: float = 0.5) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data[: int(len(data) * fraction)])
    return dst


@pytest.fixture
def xbd_tile(tmp_path) -> dict[str, Path]:
    """One good synthetic xBD tile under a fresh root: its pre, post and post label paths."""
    from data_prep.synthetic import make_xbd, tile_name

    src = tmp_path / "src"
    make_xbd(src, seed=0, n_tiles=1)
    root = tmp_path / "xbd"
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    name = tile_name(0)
    for phase in ("pre", "post"):
        shutil.copy(
            src / "labels" / f"{name}_{phase}_disaster.json",
            root / "labels" / f"{TILE}_{phase}_disaster.json",
        )
        (img,) = (src / "images").glob(f"{name}_{phase}_disaster.*")
        shutil.copy(img, root / "images" / f"{TILE}_{phase}_disaster{img.suffix}")
    images = root / "images"
    return {
        "root": root,
        "pre": next(images.glob(f"{TILE}_pre_disaster.*")),
        "post": next(images.glob(f"{TILE}_post_disaster.*")),
        "labels": root / "labels" / f"{TILE}_post_disaster.json",
    }


def replace_image(tile: dict, phase: str, make) -> Path:
    """Replace the tile's ``phase`` image by ``make(path_without_suffix)``; returns the new file."""
    old = tile[phase]
    old_bytes = old
    new = make(old.with_suffix(""), old_bytes)
    if new != old:
        old.unlink()
    tile[phase] = new
    return new


def image_problems(report) -> list:
    """Skipped items other than the polygon with broken WKT the synthetic labels hold on purpose."""
    return [x for x in report.skipped if "WKT" not in x.reason]


def assert_nothing_written(out: Path) -> None:
    # no shard; a finished tile's sidecar (shards/<tile>.rows.json, for --resume) may be there
    shards = list((out / SHARDS).glob("*.npy")) if (out / SHARDS).exists() else []
    assert shards == []
    if (out / MANIFEST).exists():
        assert len(read_manifest(out)) == 0


@pytest.fixture(scope="module")
def predictor():
    from runtime.predictor import Predictor

    return Predictor(REPO / "models" / "default.onnx")


# --- pure checks ------------------------------------------------------------------------------


def test_is_blank_flags_flat_chips_only():
    rng = np.random.default_rng(0)
    chip = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    assert not quality.is_blank(chip)
    assert quality.is_blank(np.zeros_like(chip))
    assert quality.is_blank(np.full_like(chip, 200))
    edge = chip.copy()
    edge[:48, :] = 0  # 75% zero fill past the raster edge: still imagery
    assert not quality.is_blank(edge)
    edge[:, :] = 0
    edge[0, :3] = 9  # a few stray pixels on a flat chip do not make it imagery
    assert quality.is_blank(edge)
    assert quality.blank_reason(chip, np.zeros_like(chip)).startswith("blank imagery (the post")


def test_is_constant_reads_past_a_constant_sample():
    """The sample shortcut only settles images it proves non-constant: an image that is flat on
    every sampled value but differs elsewhere (one pixel, or one band) is not constant."""
    image = np.zeros((1024, 1024, 3), dtype=np.uint8)
    assert quality.is_constant(image)
    assert quality.is_constant(np.full((7, 5, 3), 200, dtype=np.uint8))
    assert quality.is_constant(np.zeros((0, 4, 3), dtype=np.uint8))
    for index in (1, 4098, 4100, image.size - 1):  # next to and between sampled positions
        odd = image.copy()
        odd.reshape(-1)[index] = 1
        assert not quality.is_constant(odd), index
    banded = image.copy()
    banded[..., 2] = 5  # flat per band but not one value
    assert not quality.is_constant(banded)
    assert not quality.is_constant(np.random.default_rng(0).integers(0, 256, (64, 64, 3)))


def test_blank_check_of_a_batch_equals_the_full_count():
    """The strided-sample shortcut must never change a decision: chips near the threshold (a
    flat share just under and just over 95%, flat areas placed so the sample over- or
    under-represents them) are decided as the exact pixel count decides them."""
    rng = np.random.default_rng(1)
    size = 32
    chips = []
    for share in (0.0, 0.5, 0.8, 0.93, 0.945, 0.949, 0.951, 0.96, 1.0):
        for layout in ("rows", "sampled", "unsampled", "random"):
            chip = rng.integers(1, 256, (size, size, 3), dtype=np.uint8)
            flat = np.zeros(size * size, dtype=bool)
            k = int(round(share * size * size))
            on_sample = np.zeros((size, size), dtype=bool)
            on_sample[::4, ::4] = True
            if layout == "rows":
                order = np.arange(size * size)
            elif layout == "sampled":  # the sampled pixels flat first
                order = np.argsort(~on_sample.ravel(), kind="stable")
            elif layout == "unsampled":  # the sampled pixels flat last
                order = np.argsort(on_sample.ravel(), kind="stable")
            else:
                order = rng.permutation(size * size)
            flat[order[:k]] = True
            chip.reshape(-1, 3)[flat] = 0
            chips.append(chip)
    chips = np.stack(chips)
    expected = [
        np.unique(c.reshape(-1, 3), axis=0, return_counts=True)[1].max() >= 0.95 * size * size
        for c in chips
    ]
    assert any(expected) and not all(expected)
    assert [quality.is_blank(c) for c in chips] == expected
    reasons = quality.blank_reasons(chips, chips[::-1].copy())
    assert reasons == [quality.blank_reason(a, b) for a, b in zip(chips, chips[::-1], strict=True)]
    assert [r is not None for r in reasons] == [
        a or b for a, b in zip(expected, expected[::-1], strict=True)
    ]
    with pytest.raises(ValueError, match="3 pre chips but 2 post"):
        quality.blank_reasons(chips[:3], chips[:2])


def test_max_pixels_from_argument_environment_and_default(monkeypatch):
    monkeypatch.delenv(quality.MAX_PIXELS_ENV, raising=False)
    assert quality.max_pixels() == quality.MAX_PIXELS
    assert quality.max_pixels(1234) == 1234
    monkeypatch.setenv(quality.MAX_PIXELS_ENV, "5_000")
    assert quality.max_pixels() == 5000
    monkeypatch.setenv(quality.MAX_PIXELS_ENV, "many")
    with pytest.raises(ValueError, match=quality.MAX_PIXELS_ENV):
        quality.max_pixels()


# --- prepare xbd and score in xBD mode ------------------------------------------------------------


def test_huge_png_header_is_refused_before_decoding(xbd_tile, tmp_path, predictor):
    from app.scoring.common import ScoreOptions
    from app.scoring.xbd import score_xbd

    huge = replace_image(xbd_tile, "pre", lambda stem, _: huge_png(stem.with_suffix(".png")))
    assert huge.stat().st_size < 200
    out = tmp_path / "chips"
    report = prepare_xbd(xbd_tile["root"], out, progress=False)
    (skip,) = image_problems(report)
    assert skip.item == str(huge) and "40000x40000" in skip.reason and "exceeds" in skip.reason
    assert report.chips == 0 and report.exit_code() == 1
    assert_nothing_written(out)

    vector = tmp_path / "scored.gpkg"
    with pytest.raises(SceneError, match="40000x40000") as info:
        score_xbd(
            predictor, huge, xbd_tile["post"], xbd_tile["labels"], vector,
            options=ScoreOptions(progress=False),
        )  # fmt: skip
    assert str(huge) in str(info.value)
    assert not vector.exists()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_huge_png_peak_memory_stays_under_1_gb(xbd_tile, tmp_path):
    """The figure quoted in docs/data-formats.md: peak RSS of `prepare xbd` on the tile."""
    replace_image(xbd_tile, "pre", lambda stem, _: huge_png(stem.with_suffix(".png")))
    # VmHWM is the peak of this process's own memory; ru_maxrss would also count the RSS of the
    # (large) test process that forked it, which Linux carries across exec
    code = (
        "import sys\n"
        "from data_prep.xbd import prepare_xbd\n"
        "r = prepare_xbd(sys.argv[1], sys.argv[2], progress=False)\n"
        "assert r.chips == 0 and any('exceeds' in s.reason for s in r.skipped), r.skipped\n"
        "status = open('/proc/self/status').read()\n"
        "print(next(l.split()[1] for l in status.splitlines() if l.startswith('VmHWM')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(xbd_tile["root"]), str(tmp_path / "chips")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    peak_kib = int(done.stdout.split()[-1])
    assert peak_kib < 1024 * 1024, f"peak RSS {peak_kib / 1024:.0f} MiB"


def test_truncated_png_is_refused_by_score_xbd(xbd_tile, tmp_path, predictor):
    from app.scoring.common import ScoreOptions
    from app.scoring.xbd import score_xbd

    post = xbd_tile["post"]
    cut = truncate(post, tmp_path / f"cut{post.suffix}")
    with pytest.raises(SceneError, match="truncated") as info:
        score_xbd(
            predictor,
            xbd_tile["pre"],
            cut,
            xbd_tile["labels"],
            tmp_path / "o.gpkg",
            options=ScoreOptions(progress=False),
        )
    assert str(cut) in str(info.value)
    assert not (tmp_path / "o.gpkg").exists()


def test_truncated_geotiff_tile_is_refused_by_prepare_xbd(xbd_tile, tmp_path):
    def make(stem, old):
        full = write_raster(tmp_path / "full.tif", read_bands(old))
        return truncate(full, stem.with_suffix(".tif"))

    cut = replace_image(xbd_tile, "post", make)
    out = tmp_path / "chips"
    report = prepare_xbd(xbd_tile["root"], out, progress=False)
    (skip,) = image_problems(report)
    assert skip.item == str(cut) and ("truncated" in skip.reason or "cannot be read" in skip.reason)
    assert_nothing_written(out)


@pytest.mark.parametrize("kind", ["zeros", "five_bands", "one_band"])
def test_blank_or_wrong_band_count_tile_writes_nothing(xbd_tile, tmp_path, predictor, kind):
    from app.scoring.common import ScoreOptions
    from app.scoring.xbd import score_xbd

    def make(stem, old):
        bands = read_bands(old)
        if kind == "zeros":
            bands = np.zeros_like(bands)
        elif kind == "five_bands":
            bands = np.concatenate([bands, bands[:2]])
        else:
            bands = bands[:1]
        return write_raster(stem.with_suffix(".tif"), bands)

    bad = replace_image(xbd_tile, "pre", make)
    words = {"zeros": "blank imagery", "five_bands": "5 band", "one_band": "1 band"}[kind]
    out = tmp_path / "chips"
    report = prepare_xbd(xbd_tile["root"], out, progress=False)
    (skip,) = image_problems(report)
    assert skip.item == str(bad) and words in skip.reason
    assert_nothing_written(out)
    with pytest.raises(SceneError, match=words):
        score_xbd(
            predictor,
            bad,
            xbd_tile["post"],
            xbd_tile["labels"],
            tmp_path / "o.gpkg",
            options=ScoreOptions(progress=False),
        )
    assert not (tmp_path / "o.gpkg").exists()


def test_blank_chips_inside_a_tile_are_skipped_and_the_rest_keep_their_chips(xbd_tile, tmp_path):
    """A flat patch under a few buildings of the post image: those buildings are skipped as blank,
    in label order, and every other building keeps exactly the chips it had before."""
    before = tmp_path / "before"
    prepare_xbd(xbd_tile["root"], before, progress=False)
    rows = read_manifest(before).reset_index(drop=True)
    assert len(rows) >= 4
    target = rows.iloc[len(rows) // 2]  # a building in the middle of the label file

    def make(stem, old):
        bands = read_bands(old)
        c0, r0, size = int(target.win_col), int(target.win_row), int(target.win_size)
        bands[:, max(r0, 0) : r0 + size, max(c0, 0) : c0 + size] = 0
        return write_raster(stem.with_suffix(".tif"), bands)

    replace_image(xbd_tile, "post", make)
    after = tmp_path / "after"
    report = prepare_xbd(xbd_tile["root"], after, progress=False)
    blank = [s for s in report.skipped if s.reason.startswith("blank imagery (the post chip")]
    assert any(s.item.endswith(f"building {target.uid}") for s in blank)
    kept = read_manifest(after).reset_index(drop=True)
    gone = {s.item.rsplit("building ", 1)[1] for s in blank}
    assert list(kept.uid) == [u for u in rows.uid if u not in gone]  # label order kept
    old_pre = np.load(before / rows.pre_file[0])
    new_pre = np.load(after / kept.pre_file[0])
    where = dict(zip(rows.uid, rows["index"], strict=True))
    for i, uid in enumerate(kept.uid):
        assert kept["index"][i] == i
        np.testing.assert_array_equal(new_pre[i], old_pre[where[uid]])


def test_cli_max_pixels_flag_and_environment(xbd_tile, tmp_path, capsys, monkeypatch):
    from cli.main import main

    root, out = str(xbd_tile["root"]), str(tmp_path / "chips")
    assert main(["prepare", "xbd", "--root", root, "--out", out, "--max-pixels", "1000"]) == 1
    err = capsys.readouterr().err
    assert str(xbd_tile["pre"]) in err and "limit of 1,000 pixels" in err
    monkeypatch.setenv(quality.MAX_PIXELS_ENV, "2000")
    assert main(["prepare", "xbd", "--root", root, "--out", out]) == 1
    assert "limit of 2,000 pixels" in capsys.readouterr().err
    assert main(["prepare", "xbd", "--root", root, "--out", out, "--max-pixels", "10_000_000"]) == 0
    monkeypatch.setenv(quality.MAX_PIXELS_ENV, "lots")
    assert main(["prepare", "xbd", "--root", root, "--out", out]) == 2
    assert quality.MAX_PIXELS_ENV in capsys.readouterr().err


# --- prepare scene and score on georeferenced scenes -------------------------------------------


def zero_copies(paths, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    return [
        write_raster(folder / Path(p).name, np.zeros_like(read_bands(p)), like=p) for p in paths
    ]


def test_all_zero_pre_imagery_is_blank_not_graded(synthetic_scene, tmp_path, predictor):
    from app.scoring.common import ScoreOptions
    from app.scoring.scene import score_scene

    s = synthetic_scene
    zeros = zero_copies(s.pre, tmp_path / "zeros")
    out = tmp_path / "chips"
    options = SceneOptions(label_field=s.label_field)
    report = prepare_scene(zeros, s.post, s.buildings, out, options=options, progress=False)
    assert report.chips == 0 and report.exit_code() == 1
    blank = [x for x in report.skipped if x.reason.startswith("blank imagery (the pre chip")]
    assert len(blank) == s.covered
    assert not out.exists() or not any(out.iterdir())  # nothing at all written

    vector = tmp_path / "scored.geojson"
    scored = score_scene(
        predictor, zeros, s.post, s.buildings, vector, options=ScoreOptions(progress=False)
    )
    assert scored.scored == 0
    import json

    statuses = [f["properties"]["status"] for f in json.loads(vector.read_text())["features"]]
    assert sum(st.startswith("skipped: blank imagery") for st in statuses) == s.covered
    assert all(
        f["properties"]["damage"] is None for f in json.loads(vector.read_text())["features"]
    )


@pytest.mark.slow
def test_huge_sparse_geotiff_is_read_in_windows_and_found_blank(synthetic_scene, tmp_path):
    """200000 x 200000 px (uint16, no block written): not refused for its size; its buildings
    are read in windows and skipped as blank imagery."""
    import rasterio

    s = synthetic_scene
    with rasterio.open(s.pre[0]) as ds:
        crs, transform = ds.crs, ds.transform
    sparse = tmp_path / "sparse.tif"
    with rasterio.open(
        sparse,
        "w",
        driver="GTiff",
        width=200_000,
        height=200_000,
        count=3,
        dtype="uint16",
        crs=crs,
        transform=transform,
        tiled=True,
        blockxsize=512,
        blockysize=512,
        sparse_ok=True,
        BIGTIFF="YES",
    ):
        pass
    assert sparse.stat().st_size < 20 * 2**20
    out = tmp_path / "chips"
    report = prepare_scene([sparse], s.post, s.buildings, out, progress=False)
    assert not any(str(sparse) == x.item for x in report.skipped)  # the tile itself is used
    blank = [x for x in report.skipped if x.reason.startswith("blank imagery")]
    assert blank and report.chips == 0
    assert not (out / MANIFEST).exists()


def test_read_window_over_the_limit_skips_the_building(synthetic_scene, tmp_path):
    from data_prep.spec import ChipSpec

    s = synthetic_scene
    out = tmp_path / "chips"
    report = prepare_scene(
        s.pre,
        s.post,
        s.buildings,
        out,
        spec=ChipSpec(chip_size=32, min_size=128),  # windows of 128 px at least
        options=SceneOptions(
            label_field=s.label_field,
            max_pixels=64 * 64,  # above the tiles' internal blocks, below any window
        ),
        progress=False,
    )
    assert report.chips == 0
    reasons = {x.reason for x in report.skipped}
    assert any("read window" in r and "exceeds the limit of 4,096 pixels" in r for r in reasons)
    assert not (out / MANIFEST).exists()


@pytest.mark.parametrize("kind", ["truncated", "five_bands"])
def test_bad_only_post_tile_is_a_clear_score_error(synthetic_scene, tmp_path, predictor, kind):
    from app.scoring.common import ScoreOptions
    from app.scoring.scene import score_scene

    s = synthetic_scene
    post = Path(s.post[0])
    if kind == "truncated":
        bad = truncate(post, tmp_path / "cut.tif")
    else:
        bands = read_bands(post)
        bad = write_raster(tmp_path / "five.tif", np.concatenate([bands, bands[:2]]), like=post)
    vector = tmp_path / "o.geojson"
    with pytest.raises(SceneError) as info:
        score_scene(
            predictor, s.pre, [bad], s.buildings, vector, options=ScoreOptions(progress=False)
        )
    text = str(info.value)
    assert str(bad) in text
    assert ("truncated" in text) if kind == "truncated" else ("5 band" in text)
    assert not vector.exists()


# --- the app ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["huge", "truncated", "zeros"])
def test_app_refuses_bad_uploads_with_a_clear_message(xbd_tile, tmp_path, predictor, kind):
    from app.web.app import AppError, assess_tile

    if kind == "huge":
        bad = huge_png(tmp_path / "huge.png")
        words = "40000x40000"
    elif kind == "truncated":
        bad = truncate(xbd_tile["pre"], tmp_path / f"cut{xbd_tile['pre'].suffix}")
        words = "truncated"
    else:
        bad = write_raster(tmp_path / "zeros.tif", np.zeros_like(read_bands(xbd_tile["pre"])))
        words = "blank imagery"
    with pytest.raises(AppError, match=words) as info:
        assess_tile(predictor, bad, xbd_tile["post"], xbd_tile["labels"], tmp_path / "session")
    assert bad.name in str(info.value)


def test_split_file_message_names_the_file_at_fault():
    from data_prep.imagery import split_file_message

    pre, post = Path("/data/a_pre.png"), Path("/data/a_post.png")
    assert split_file_message(f"{post}: truncated PNG", (pre, post)) == (str(post), "truncated PNG")
    assert split_file_message("no file named", (pre, post)) == (None, "no file named")
    # a path that merely starts like another is not taken for it
    assert split_file_message(f"{pre}x: odd", (pre, post)) == (None, f"{pre}x: odd")
