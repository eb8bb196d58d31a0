"""`prepare xbd` on the seeded synthetic xBD data (and, marked realdata, on the xBD sample)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import shapely

from cli.main import main
from data_prep.engine import Engine
from data_prep.imagery import read_rgb
from data_prep.spec import CLASS_NAMES, ChipSpec
from data_prep.store import ChipReader, read_manifest, read_meta
from data_prep.synthetic import make_bad_xbd, make_xbd
from data_prep.windows import ChipWindow, crop_boundless, resize_chip
from data_prep.xbd import XbdOptions, prepare_xbd
from data_prep.xbd_tiles import XbdRootError, find_tiles
from tests.conftest import shared_data

SPEC = ChipSpec(chip_size=64, context=2.0, min_size=48)
RESUME = XbdOptions(resume=True)


def _valid_wkt(wkt) -> bool:
    try:
        return not shapely.from_wkt(wkt).is_empty
    except Exception:
        return False


def label_features(root: Path) -> list[tuple[str, dict]]:
    """(tile, feature) for every building of every post label below ``root``, in file order."""
    out = []
    for path in sorted(root.rglob("labels/*_post_disaster.json")):
        tile = path.name[: -len("_post_disaster.json")]
        out.extend((tile, f) for f in json.loads(path.read_text())["features"]["xy"])
    return out


def expected_counts(root: Path) -> Counter:
    """Per-class counts read straight from the label files (valid WKT, un-classified left out)."""
    return Counter(
        f["properties"]["subtype"]
        for _, f in label_features(root)
        if f["properties"]["subtype"] in CLASS_NAMES and _valid_wkt(f["wkt"])
    )


@pytest.fixture(scope="module")
def store(synthetic_xbd, tmp_path_factory):
    out = tmp_path_factory.mktemp("chips") / "store"
    report = prepare_xbd(synthetic_xbd, out, spec=SPEC, engine=Engine(workers=1))
    return out, report


def test_counts_per_class_match_labels(synthetic_xbd, store):
    out, report = store
    df = read_manifest(out)
    expected = expected_counts(synthetic_xbd)
    assert all(expected[name] >= 1 for name in CLASS_NAMES)  # the generator's promise
    assert Counter(df["label_name"]) == expected
    assert dict(report.per_class) == dict(expected)
    assert report.chips == len(df) == sum(expected.values())
    assert (df["label"] == df["label_name"].map(CLASS_NAMES.index)).all()
    unclassified = sum(
        f["properties"]["subtype"] == "un-classified" for _, f in label_features(synthetic_xbd)
    )
    assert report.excluded_unclassified == unclassified >= 1
    meta = read_meta(out)
    assert meta["source"] == "xbd" and meta["spec"] == SPEC.to_dict()
    assert meta["report"]["chips"] == len(df)


def test_manifest_rows_ids_order_and_geography(synthetic_xbd, store):
    out, _ = store
    df = read_manifest(out)
    features = [
        (tile, f)
        for tile, f in label_features(synthetic_xbd)
        if f["properties"]["subtype"] in CLASS_NAMES and _valid_wkt(f["wkt"])
    ]
    assert df["chip_id"].tolist() == [f"{t}:{f['properties']['uid']}" for t, f in features]
    assert df["tile"].tolist() == [t for t, _ in features]
    for tile, group in df.groupby("tile", sort=False):
        label = json.loads((synthetic_xbd / "labels" / f"{tile}_post_disaster.json").read_text())
        assert (group["event"] == label["metadata"]["disaster"]).all()
        assert group["index"].tolist() == list(range(len(group)))
        geo = {
            f["properties"]["uid"]: shapely.from_wkt(f["wkt"]) for f in label["features"]["lng_lat"]
        }
        xy = {f["properties"]["uid"]: f["wkt"] for f in label["features"]["xy"]}
        for rec in group.to_dict("records"):
            c = geo[rec["uid"]].centroid
            assert rec["lon"] == pytest.approx(c.x, abs=1e-7) and rec["lat"] == pytest.approx(
                c.y, abs=1e-7
            )
            minx, miny, maxx, maxy = shapely.from_wkt(xy[rec["uid"]]).bounds
            assert rec["bbox_minx"] == pytest.approx(minx, abs=1e-3)
            assert rec["bbox_maxy"] == pytest.approx(maxy, abs=1e-3)


def test_unclassified_kept_as_unlabelled(synthetic_xbd, tmp_path):
    report = prepare_xbd(synthetic_xbd, tmp_path / "c", SPEC, XbdOptions(include_unclassified=True))
    df = read_manifest(tmp_path / "c")
    unclassified = sum(
        f["properties"]["subtype"] == "un-classified" for _, f in label_features(synthetic_xbd)
    )
    assert (df["label"] == -1).sum() == unclassified == report.unlabelled
    assert (df.loc[df["label"] == -1, "label_name"] == "").all()
    assert report.excluded_unclassified == 0
    assert Counter(df.loc[df["label"] >= 0, "label_name"]) == expected_counts(synthetic_xbd)


def test_chips_are_cut_from_the_window(synthetic_xbd, store):
    out, _ = store
    df = read_manifest(out)
    reader = ChipReader(out)
    tiles = {t.name: t for t in find_tiles(synthetic_xbd)[0]}
    for rec in df.iloc[::5].to_dict("records"):
        window = ChipWindow(rec["win_col"], rec["win_row"], rec["win_size"])
        tile = tiles[rec["tile"]]
        pre, post = reader.pair(rec)
        np.testing.assert_array_equal(
            pre, resize_chip(crop_boundless(read_rgb(tile.pre), window), SPEC.chip_size)
        )
        np.testing.assert_array_equal(
            post, resize_chip(crop_boundless(read_rgb(tile.post), window), SPEC.chip_size)
        )


def test_edge_building_is_zero_filled_beyond_the_edge(store):
    out, _ = store
    df = read_manifest(out)
    edge = df[df["bbox_minx"] < 0]
    assert len(edge) >= 1
    rec = edge.iloc[0].to_dict()
    assert rec["win_col"] < 0
    pre, post = ChipReader(out).pair(rec)
    # chip columns whose source pixels all lie left of x = 0 (minus one column for interpolation)
    outside = int(np.floor(-rec["win_col"] * SPEC.chip_size / rec["win_size"])) - 1
    assert outside >= 1
    assert not pre[:, :outside].any() and not post[:, :outside].any()
    assert pre[:, outside + 2 :].min(axis=-1).all()  # real imagery (no zero pixels) inside


def test_no_damage_identical_destroyed_differs(store):
    out, _ = store
    df = read_manifest(out)
    reader = ChipReader(out)
    for rec in df.to_dict("records"):
        pre, post = reader.pair(rec)
        diff = np.abs(pre.astype(int) - post.astype(int)).mean()
        if rec["label_name"] == "no-damage":
            assert diff == 0, rec["chip_id"]
        elif rec["label_name"] == "destroyed":
            assert diff > 5, rec["chip_id"]
        else:
            assert diff > 0, rec["chip_id"]


@pytest.mark.slow
def test_two_workers_byte_identical(synthetic_xbd, store, tmp_path):
    out1, _ = store
    out2 = tmp_path / "w2"
    prepare_xbd(synthetic_xbd, out2, spec=SPEC, engine=Engine(workers=2))
    files1 = sorted(p.relative_to(out1) for p in out1.rglob("*") if p.is_file())
    files2 = sorted(p.relative_to(out2) for p in out2.rglob("*") if p.is_file())
    assert files1 == files2 and len(files1) >= 3
    for rel in files1:
        assert (out1 / rel).read_bytes() == (out2 / rel).read_bytes(), rel


def test_split_layout_and_several_roots(synthetic_xbd, tmp_path):
    root = tmp_path / "xbd"
    tiles = find_tiles(synthetic_xbd)[0]
    for i, tile in enumerate(tiles):
        split = ("train", "test", "hold")[i % 3]
        for sub, paths in (
            ("images", [tile.pre, tile.post]),
            ("labels", [tile.label, tile.label.with_name(tile.name + "_pre_disaster.json")]),
        ):
            (root / split / sub).mkdir(parents=True, exist_ok=True)
            for p in paths:
                shutil.copy(p, root / split / sub / p.name)
    found = find_tiles(root)[0]
    assert [t.name for t in found] == [t.name for t in tiles]
    report = prepare_xbd(root, tmp_path / "c", spec=SPEC)
    assert Counter(read_manifest(tmp_path / "c")["label_name"]) == expected_counts(synthetic_xbd)

    # two roots: the second copy of a tile name is reported, not cut twice
    report2 = prepare_xbd([root, synthetic_xbd], tmp_path / "c2", spec=SPEC)
    assert report2.chips == report.chips
    dupes = [s for s in report2.skipped if "already found" in s.reason]
    assert len(dupes) == len(tiles)


def test_bad_inputs_are_skipped_with_the_file_named(tmp_path):
    problems = make_bad_xbd(tmp_path / "bad")
    report = prepare_xbd(tmp_path / "bad", tmp_path / "c", spec=SPEC)
    keywords = {
        "outside": "outside",
        "bad_wkt": "WKT",
        "missing_post": "post-disaster partner image",
        "missing_pre": "pre-disaster partner image",
        "missing_label": "label file not found",
        "truncated": "truncated",
        "garbage": "cannot be read",
        "not_json": "JSON",
        "one_band": "band",
        "size_mismatch": "px",
    }
    for problem, word in keywords.items():
        hits = [s for s in report.skipped if str(problems[problem]) in s.item]
        assert hits, f"{problem}: no skip names {problems[problem]}"
        assert any(word in s.reason for s in hits), (problem, [s.reason for s in hits])
    assert len(report.skipped) == len(keywords)
    df = read_manifest(tmp_path / "c")
    # the good tile and the 16-bit tile (scaled to uint8 when read) are cut
    assert set(df["tile"]) == {"bad-good_00000000", "bad-uint16_00000001"}
    assert report.exit_code() == 0 and report.exit_code(strict=True) == 1
    summary = report.summary()
    for s in report.skipped:
        assert s.item in summary


@pytest.mark.slow
def test_cli_runs_and_prints_summary(synthetic_xbd, tmp_path, capsys):
    out = tmp_path / "chips"
    rc = main(
        [
            "prepare",
            "xbd",
            "--root",
            str(synthetic_xbd),
            "--out",
            str(out),
            "--chip-size",
            "32",
            "--workers",
            "2",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0
    n = len(read_manifest(out))
    assert f"chips written: {n}" in err
    assert "per class: no-damage" in err and "per event:" in err
    assert "invalid WKT" in err  # the synthetic data's bad building is listed
    assert read_meta(out)["spec"]["chip_size"] == 32
    # --strict: the skipped building makes the run fail
    rc = main(["prepare", "xbd", "--root", str(synthetic_xbd), "--out", str(out), "--strict"])
    assert rc == 1


def test_cli_exit_codes_for_bad_roots(tmp_path, capsys):
    rc = main(["prepare", "xbd", "--root", str(tmp_path / "missing"), "--out", str(tmp_path / "c")])
    assert rc == 2
    assert f"{tmp_path / 'missing'}: xBD root folder does not exist" in capsys.readouterr().err
    (tmp_path / "empty" / "images").mkdir(parents=True)
    rc = main(["prepare", "xbd", "--root", str(tmp_path / "empty"), "--out", str(tmp_path / "c")])
    assert rc == 2
    assert "no xBD tiles found" in capsys.readouterr().err
    with pytest.raises(XbdRootError, match="no xBD tiles"):
        prepare_xbd(tmp_path / "empty", tmp_path / "c")


@pytest.mark.slow
def test_nothing_produced_exits_non_zero(tmp_path, capsys):
    make_bad_xbd(tmp_path / "bad")
    for p in (tmp_path / "bad").rglob("bad-good_*"):
        p.unlink()
    for p in (tmp_path / "bad").rglob("bad-uint16_*"):
        p.unlink()
    rc = main(["prepare", "xbd", "--root", str(tmp_path / "bad"), "--out", str(tmp_path / "c")])
    assert rc == 1
    assert "chips written: 0" in capsys.readouterr().err


def test_generator_is_seeded(tmp_path):
    a, b, c = (
        make_xbd(tmp_path / "a", seed=3),
        make_xbd(tmp_path / "b", seed=3),
        make_xbd(tmp_path / "c", seed=4),
    )
    names = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert any(n.suffix == ".tif" for n in names) and any(n.suffix == ".png" for n in names)
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in names)
    assert any((a / n).read_bytes() != (c / n).read_bytes() for n in names)


@pytest.mark.realdata
def test_xbd_sample_counts_match_labels(tmp_path):
    root = shared_data("xbd_sample")
    report = prepare_xbd(root, tmp_path / "chips", engine=Engine(workers=2))
    df = read_manifest(tmp_path / "chips")
    assert Counter(df["label_name"]) == expected_counts(root)
    assert report.skipped == []
    events = {
        json.loads(p.read_text())["metadata"]["disaster"]
        for p in root.glob("labels/*_post_disaster.json")
    }
    assert set(df["event"]) == events
    assert df["tile"].nunique() == len(list(root.glob("labels/*_post_disaster.json")))
    assert df[["lon", "lat"]].notna().all().all()


@pytest.mark.slow
def test_synthetic_module_main_then_prepare(tmp_path, capsys):
    from data_prep.synthetic import main as synthetic_main

    assert synthetic_main(["--out", str(tmp_path)]) == 0
    said = capsys.readouterr().out
    assert "SYNTHETIC" in said and str(tmp_path / "xbd") in said
    assert (
        main(["prepare", "xbd", "--root", str(tmp_path / "xbd"), "--out", str(tmp_path / "chips")])
        == 0
    )
    assert Counter(read_manifest(tmp_path / "chips")["label_name"]) == expected_counts(
        tmp_path / "xbd"
    )


# --- --resume ---------------------------------------------------------------------------------


def store_files(store: Path) -> dict[str, bytes]:
    """Every file of a chip store (manifest, store.json, shards and sidecars) -> bytes."""
    return {
        str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()
    }


def test_resume_cuts_only_the_unfinished_tiles_and_gives_the_same_store(
    tmp_path, monkeypatch, capsys
):
    import data_prep.xbd as xbd

    root = make_xbd(tmp_path / "xbd", seed=5, n_tiles=6, size=256)
    prepare_xbd(root, tmp_path / "ref", spec=SPEC, engine=Engine(workers=1), progress=False)
    reference = store_files(tmp_path / "ref")
    out = tmp_path / "out"
    prepare_xbd(root, out, spec=SPEC, engine=Engine(workers=1), progress=False)
    shards = out / "shards"
    tiles = sorted(set(read_manifest(out)["tile"]))
    assert len(tiles) >= 4 and len(list(shards.glob("*.rows.json"))) == 6
    # an interrupted run: no manifest, two tiles without their sidecar, one without a shard
    (out / "manifest.csv").unlink()
    (shards / f"{tiles[0]}.rows.json").unlink()
    (shards / f"{tiles[0]}_pre.npy").unlink()
    (shards / f"{tiles[1]}.rows.json").unlink()
    (shards / f"{tiles[2]}_post.npy").unlink()
    before = {p.name: p.stat().st_mtime_ns for p in shards.iterdir()}
    cut = []
    cut_tile_rows = xbd.cut_tile_rows

    def counting(tile, *args):
        cut.append(tile.name)
        return cut_tile_rows(tile, *args)

    monkeypatch.setattr(xbd, "cut_tile_rows", counting)
    args = ["prepare", "xbd", "--root", root, "--out", out, "--chip-size", SPEC.chip_size,
            "--context", SPEC.context, "--min-size", SPEC.min_size, "--workers", "1"]  # fmt: skip
    assert main([str(a) for a in args] + ["--resume"]) == 0
    assert sorted(cut) == tiles[:3]
    assert "tiles taken from the earlier run (--resume): 3" in capsys.readouterr().err
    assert store_files(out) == reference
    for name, mtime in before.items():  # the finished tiles' files were left alone
        if not name.startswith((tiles[0], tiles[1], tiles[2])):
            assert (shards / name).stat().st_mtime_ns == mtime, name

    # a changed input file is cut again
    cut.clear()
    label = root / "labels" / f"{tiles[3]}_post_disaster.json"
    label.write_bytes(label.read_bytes())
    assert main([str(a) for a in args] + ["--resume"]) == 0
    assert cut == [tiles[3]]

    # without --resume every tile is cut again, and a sidecar's temporary that a worker killed
    # while writing it left behind is removed
    cut.clear()
    leftover = shards / f".{tiles[4]}.rows.json.k1ll3d.json"
    leftover.write_bytes(b"")
    assert main([str(a) for a in args]) == 0
    assert len(cut) == 6
    assert not leftover.exists()


def test_resume_with_other_options_is_refused(tmp_path, capsys):
    from data_prep.xbd_resume import ResumeError

    root = make_xbd(tmp_path / "xbd", seed=6, n_tiles=3, size=256)
    out = tmp_path / "out"
    prepare_xbd(root, out, spec=SPEC, engine=Engine(workers=1), progress=False)
    before = store_files(out)
    other = ChipSpec(chip_size=32, context=SPEC.context, min_size=SPEC.min_size)
    with pytest.raises(ResumeError, match="other options: spec"):
        prepare_xbd(root, out, other, RESUME, engine=Engine(workers=1), progress=False)
    assert store_files(out) == before  # nothing touched
    rc = main(["prepare", "xbd", "--root", str(root), "--out", str(out), "--workers", "1",
               "--resume"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "cannot resume" in err and "leave out --resume" in err
    assert "Traceback" not in err
    # an interrupted run has no store.json yet: the sidecars record the options
    (out / "store.json").unlink()
    (out / "manifest.csv").unlink()
    with pytest.raises(ResumeError, match="include_unclassified"):
        options = XbdOptions(include_unclassified=True, resume=True)
        prepare_xbd(root, out, SPEC, options, engine=Engine(workers=1), progress=False)
    # the same options resume
    report = prepare_xbd(root, out, SPEC, RESUME, engine=Engine(workers=1), progress=False)
    assert report.reused == 3 and read_manifest(out).shape[0] == report.chips > 0
