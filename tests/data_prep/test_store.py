"""The chip store: shards + manifest round trip, and atomic writes."""

from __future__ import annotations

import os

import numpy as np
import pytest

from data_prep.store import (
    MANIFEST,
    MANIFEST_COLUMNS,
    ChipReader,
    StoreError,
    StoreNotFoundError,
    atomic_file,
    atomic_path,
    read_manifest,
    read_meta,
    start_store,
    write_manifest,
    write_shard,
)


def _chips(rng, n, size=16):
    return rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def _row(tile, i, pre_file, post_file, label=0, lon=None):
    return {
        "chip_id": f"{tile}:{i}",
        "event": "ev",
        "tile": tile,
        "uid": str(i),
        "label": label,
        "label_name": "" if label < 0 else "no-damage",
        "bbox_minx": 1.5,
        "bbox_miny": 2.25,
        "bbox_maxx": 10.0,
        "bbox_maxy": 12.0,
        "win_col": -3,
        "win_row": 4,
        "win_size": 64,
        "lon": lon,
        "lat": None if lon is None else 30.5,
        "pre_file": pre_file,
        "post_file": post_file,
        "index": i,
    }


def test_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    root = start_store(tmp_path / "chips")
    arrays, rows = {}, []
    for tile, n in (("tile a/1", 3), ("tile_b", 2)):
        pre, post = _chips(rng, n), _chips(rng, n)
        pre_file, post_file = write_shard(root, tile, pre, post)
        assert (root / pre_file).is_file() and (root / post_file).is_file()
        arrays[tile] = (pre, post)
        for i in range(n):
            rows.append(
                _row(
                    tile,
                    i,
                    pre_file,
                    post_file,
                    label=-1 if i == 1 else 0,
                    lon=-90.25 if i == 0 else None,
                )
            )
    meta = {"source": "test", "spec": {"chip_size": 16}}
    write_manifest(root, rows, meta)

    df = read_manifest(root)
    assert list(df.columns) == list(MANIFEST_COLUMNS)
    assert len(df) == len(rows)
    assert df["label"].tolist() == [r["label"] for r in rows]
    assert df["chip_id"].tolist() == [r["chip_id"] for r in rows]
    assert df.loc[0, "lon"] == -90.25 and np.isnan(df.loc[1, "lon"])
    assert df.loc[1, "label_name"] == ""
    assert df["win_col"].tolist() == [-3] * len(rows)
    assert read_meta(root) == meta

    reader = ChipReader(root)
    for rec in df.to_dict("records"):
        pre, post = reader.pair(rec)
        expected_pre, expected_post = arrays[rec["tile"]]
        np.testing.assert_array_equal(pre, expected_pre[rec["index"]])
        np.testing.assert_array_equal(post, expected_post[rec["index"]])


def test_write_shard_rejects_mismatched_chips(tmp_path):
    rng = np.random.default_rng(1)
    with pytest.raises(ValueError, match="equal shape"):
        write_shard(tmp_path, "t", _chips(rng, 2), _chips(rng, 3))
    with pytest.raises(ValueError, match="uint8"):
        write_shard(tmp_path, "t", _chips(rng, 2).astype(np.float32), _chips(rng, 2))
    assert not list(tmp_path.rglob("*.npy"))


def test_atomic_path_failure_leaves_no_file_and_keeps_old(tmp_path):
    target = tmp_path / "out.txt"
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("partial")
        raise RuntimeError("boom")
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []

    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("new")
        raise RuntimeError("boom")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]

    with atomic_path(target) as tmp:
        tmp.write_text("new")
    assert target.read_text() == "new"


@pytest.mark.parametrize("text", [False, True])
def test_atomic_file_failure_leaves_no_file_and_keeps_old(tmp_path, text):
    target = tmp_path / "out.txt"
    data = "néw\n" if text else "néw\n".encode()
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_file(target, text=text) as fh:
        fh.write(data)
        raise RuntimeError("boom")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    with atomic_file(target, text=text) as fh:
        fh.write(data)
    assert target.read_bytes() == "néw\n".encode()  # UTF-8, newline as written
    mask = os.umask(0)
    os.umask(mask)
    assert (target.stat().st_mode & 0o777) == (0o666 & ~mask)
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_failing_manifest_write_keeps_previous_manifest(tmp_path):
    root = start_store(tmp_path)
    write_manifest(root, [_row("t", 0, "a", "b")])
    before = (root / MANIFEST).read_bytes()

    def rows():
        yield _row("t", 1, "a", "b")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_manifest(root, rows())
    assert (root / MANIFEST).read_bytes() == before
    assert sorted(p.name for p in root.iterdir()) == [MANIFEST, "shards"]


def test_start_store_removes_old_manifest(tmp_path):
    root = start_store(tmp_path / "chips")
    pre_file, post_file = write_shard(
        root, "t", np.zeros((1, 8, 8, 3), np.uint8), np.zeros((1, 8, 8, 3), np.uint8)
    )
    write_manifest(root, [_row("t", 0, pre_file, post_file)])
    assert (root / MANIFEST).is_file()
    start_store(root)
    assert not (root / MANIFEST).exists()
    assert (root / pre_file).is_file()  # shards stay until overwritten
    with pytest.raises(FileNotFoundError, match="no manifest"):
        read_manifest(root)


def test_atomic_path_gives_usual_permissions(tmp_path):
    target = tmp_path / "out.txt"
    with atomic_path(target) as tmp:
        tmp.write_text("x")
    mask = os.umask(0)
    os.umask(mask)
    assert (target.stat().st_mode & 0o777) == (0o666 & ~mask)


def test_rerun_over_fewer_tiles_removes_shards_the_manifest_no_longer_names(tmp_path):
    rng = np.random.default_rng(1)
    root = start_store(tmp_path / "chips")
    files = {t: write_shard(root, t, _chips(rng, 2), _chips(rng, 2)) for t in ("a", "b", "c")}
    write_manifest(root, [_row(t, i, *files[t]) for t in files for i in range(2)])
    assert len(list((root / "shards").glob("*.npy"))) == 6

    root = start_store(root)  # the rerun finds only tile a
    files = {"a": write_shard(root, "a", _chips(rng, 2), _chips(rng, 2))}
    write_manifest(root, [_row("a", i, *files["a"]) for i in range(2)])
    assert sorted(p.name for p in (root / "shards").glob("*.npy")) == ["a_post.npy", "a_pre.npy"]
    assert len(read_manifest(root)) == 2
    reader = ChipReader(root)
    for _, row in read_manifest(root).iterrows():
        assert reader.pair(row)[0].shape == (16, 16, 3)


def test_atomic_path_permissions_survive_a_writer_that_replaces_the_file(tmp_path):
    import torch
    from safetensors.torch import save_file

    target = tmp_path / "w.safetensors"
    with atomic_path(target, suffix=".safetensors") as tmp:
        save_file({"a": torch.zeros(2)}, str(tmp))
    mask = os.umask(0)
    os.umask(mask)
    assert (target.stat().st_mode & 0o777) == (0o666 & ~mask)


def test_a_damaged_manifest_or_description_is_a_clear_error(tmp_path, capsys):
    from cli.main import main
    from data_prep.store import MANIFEST, STORE_META, StoreError, read_manifest, read_meta

    (tmp_path / MANIFEST).write_text("chip_id,label\na,not-a-number\n")
    with pytest.raises(StoreError, match="not a readable chip-store manifest"):
        read_manifest(tmp_path)
    (tmp_path / STORE_META).write_text("{ not json")
    with pytest.raises(StoreError, match="not a readable chip-store description"):
        read_meta(tmp_path)
    assert main(["split", str(tmp_path)]) == 2
    assert "not a readable chip-store manifest" in capsys.readouterr().err


def _shard_maps() -> list[str]:
    with open("/proc/self/maps") as fh:
        return [line for line in fh if "_pre.npy" in line or "_post.npy" in line]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_reader_reads_every_chip_without_mapping_or_holding_the_shards(tmp_path):
    rng = np.random.default_rng(5)
    start_store(tmp_path)
    shards = {}
    for t in range(12):
        pre, post = _chips(rng, 7), _chips(rng, 7)
        shards[t] = (write_shard(tmp_path, f"t{t}", pre, post), pre, post)
    reader = ChipReader(tmp_path)
    reader.max_open = 5
    for (pre_file, post_file), pre, post in shards.values():
        for i in range(7):
            a, b = reader.pair({"pre_file": pre_file, "post_file": post_file, "index": i})
            np.testing.assert_array_equal(a, pre[i])
            np.testing.assert_array_equal(b, post[i])
            assert a.flags.writeable and a.flags.c_contiguous
    assert not _shard_maps()  # nothing of the shards stays mapped into memory
    assert len(reader._open) == 5  # at most max_open files open
    reader.close()
    assert not reader._open


def test_reader_names_the_shard_on_bad_reads(tmp_path):
    rng = np.random.default_rng(6)
    start_store(tmp_path)
    pre_file, post_file = write_shard(tmp_path, "t", _chips(rng, 3), _chips(rng, 3))
    reader = ChipReader(tmp_path)
    with pytest.raises(StoreError, match=r"t_pre\.npy: no chip 3 in a shard of 3"):
        reader.chip(pre_file, 3)
    path = tmp_path / post_file
    path.write_bytes(path.read_bytes()[:-100])  # cut short
    with pytest.raises(StoreError, match=r"t_post\.npy: truncated shard"):
        ChipReader(tmp_path).chip(post_file, 2)
    (tmp_path / "shards" / "bad_pre.npy").write_bytes(b"not numpy")
    with pytest.raises(StoreError, match=r"bad_pre\.npy: not a readable chip shard"):
        ChipReader(tmp_path).chip("shards/bad_pre.npy", 0)
    with pytest.raises(StoreNotFoundError, match=r"gone_pre\.npy: shard file not found"):
        ChipReader(tmp_path).chip("shards/gone_pre.npy", 0)
