"""Training at scale: a simulated chip store, a dataset whose per-chip state is compact, and
`local-damage bench train --chips` at a tiny size (it runs and its figures add up; not timed)."""

from __future__ import annotations

import json
import os
import tracemalloc

import numpy as np
import pytest

from bench.train_scale import MAX_STEPS, PER_SHARD, UNIQUE_SHARDS, make_sim_store
from data_prep.store import ChipReader, read_manifest
from data_prep.windows import resize_chip
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def sim_root(tmp_path_factory):
    return tmp_path_factory.mktemp("sim")


@pytest.mark.slow
def test_sim_store_links_tiles_to_few_unique_shards(sim_root):
    store = make_sim_store(sim_root, 5_050)
    frame = read_manifest(store)
    assert len(frame) == 5_050 and frame["chip_id"].is_unique
    assert frame["tile"].nunique() == 51  # 50 full tiles and one of 50 chips
    assert set(frame["label"]) <= {0, 1, 2, 3}
    shards = sorted((store / "shards").glob("*.npy"))
    assert len(shards) == 2 * 51
    inodes = {os.stat(p).st_ino for p in shards}
    assert len(inodes) == 2 * UNIQUE_SHARDS  # every tile a link to one of the unique shards
    reader = ChipReader(store)
    row = frame.iloc[PER_SHARD * UNIQUE_SHARDS + 7].to_dict()  # the tile after the last unique
    again = frame.iloc[7].to_dict()
    for a, b in zip(reader.pair(row), reader.pair(again), strict=True):
        np.testing.assert_array_equal(a, b)
    assert make_sim_store(sim_root, 5_050) == store  # made once


def _retained(make) -> int:
    tracemalloc.start()
    try:
        kept = make()
        size = tracemalloc.get_traced_memory()[0]
        del kept
    finally:
        tracemalloc.stop()
    return size


@pytest.mark.slow
def test_dataset_keeps_per_chip_numbers_not_rows(sim_root):
    pytest.importorskip("torch")
    from local_damage.data import ChipPairDataset

    store = make_sim_store(sim_root, 5_050)
    frame = _retained(lambda: read_manifest(store))
    dataset = _retained(lambda: ChipPairDataset(store, None, 32))
    assert (dataset - frame) / 5_050 < 200  # bytes per chip beyond the manifest itself
    ds = ChipPairDataset(store, None, 32)
    rows = read_manifest(store).to_dict("records")
    reader = ChipReader(store)
    for i in (0, 4_321, 5_049):
        pre, post, label = ds[i]
        a, b = reader.pair(rows[i])
        assert label == rows[i]["label"] and pre.shape == (3, 32, 32)
        np.testing.assert_array_equal(pre.numpy().transpose(1, 2, 0), resize_chip(a, 32))
        np.testing.assert_array_equal(post.numpy().transpose(1, 2, 0), resize_chip(b, 32))
    assert list(ds.chip_ids[:2]) == [rows[0]["chip_id"], rows[1]["chip_id"]]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_train_chips_tiny(sim_root, capsys):
    pytest.importorskip("torch")
    argv = ["bench", "train", "--chips", "200,5050", "--timed-batches", "3"]
    assert run_cli(*argv, "--loader-workers", "1", "--dir", sim_root, "--json") == 0
    figures = json.loads(capsys.readouterr().out)
    assert [r["chips"] for r in figures["rows"]] == [200, 5_050]
    for r in figures["rows"]:
        assert r["workers"] == 1 and r["batch_size"] == 16 and r["device"] == "cpu"
        for key in ("loader_chips_per_s", "step_chips_per_s", "loop_chips_per_s"):
            assert r[key] > 0, key
        assert r["loader_over_step"] == pytest.approx(
            r["loader_chips_per_s"] / r["step_chips_per_s"], rel=0.02
        )
        assert r["main_rss_mb"] > 50 and r["worker_rss_mb"] > 10 and r["train_rss_mb"] > 50
    assert figures["unique_mb"] > 0
    assert run_cli("bench", "train", "--chips", "0") == 2


@pytest.mark.slow
def test_bench_train_chips_overrides_and_one_pass(sim_root, capsys):
    """`--set` changes the measured config, and the timed batches never run past one pass over
    the store (which stopped the loader with StopIteration on a small store)."""
    pytest.importorskip("torch")
    argv = ["bench", "train", "--chips", "200", "--timed-batches", "500", "--dir", sim_root]
    assert run_cli(*argv, "--loader-workers", "0", "--set", "train.batch_size=8", "--json") == 0
    figures = json.loads(capsys.readouterr().out)
    (row,) = figures["rows"]
    assert figures["overrides"] == ["train.batch_size=8"] and row["batch_size"] == 8
    assert 1 <= row["timed_batches"] <= 200 // 8 - 1 - MAX_STEPS
    assert run_cli(*argv, "--set", "model.no_such_key=1") == 2
    assert "no_such_key" in capsys.readouterr().err
    assert run_cli("bench", "train", "--chips", "40", "--dir", sim_root) == 2  # 2 batches of 16
    assert "at least 64 chips" in capsys.readouterr().err


class _OpenCVThreads:
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        import cv2

        return cv2.getNumThreads()


@pytest.mark.slow
def test_loader_workers_run_opencv_on_one_thread(sim_root):
    """Each of N workers starting OpenCV's pool of one thread per core oversubscribes the
    cores; the training loader's workers run it on one thread, the process itself keeps its own."""
    pytest.importorskip("torch")
    import cv2
    import torch
    from torch.utils.data import DataLoader

    from local_damage.config import load_yaml
    from local_damage.train.config import Config
    from local_damage.train.distributed import DistInfo
    from local_damage.train.loaders import build_loaders, one_thread_worker

    store = make_sim_store(sim_root, 200)
    ids = read_manifest(store)["chip_id"].tolist()
    for workers, init in ((2, one_thread_worker), (0, None)):
        cfg = load_yaml(Config, None, [f"data.num_workers={workers}"])
        loader = build_loaders(cfg, store, ids, [], DistInfo(), torch.device("cpu")).train
        assert loader.worker_init_fn is init
    before = cv2.getNumThreads()
    seen = DataLoader(_OpenCVThreads(), num_workers=1, worker_init_fn=one_thread_worker)
    assert [int(n) for n in seen] == [1, 1]
    assert cv2.getNumThreads() == before


def _start_method() -> str:
    import multiprocessing

    return multiprocessing.get_start_method()


def test_measuring_process_starts_loader_workers_as_train_does():
    """`bench train --chips` measures in a process started by spawn; without resetting it, that
    process's loader workers are spawned too (half to a fifth of the forked rate), where
    `local-damage train` uses the platform's default."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from bench.train_scale import platform_start_method

    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        assert pool.submit(_start_method).result() == "spawn"  # what the fix undoes
    with ProcessPoolExecutor(1, mp_context=spawn, initializer=platform_start_method) as pool:
        assert pool.submit(_start_method).result() == multiprocessing.get_all_start_methods()[0]
