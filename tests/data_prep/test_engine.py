"""Scoring and preparation on Dask: embedded cluster, a separately started scheduler with two
workers, a worker killed mid-batch, the client killed mid-batch and resumed.

Every cluster here is real: ``LocalCluster`` worker processes, or ``dask scheduler`` and
``dask worker`` processes started on localhost.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.timeout(300)

BIN = Path(sys.executable).parent


def scene_folders(root: Path, s, n: int) -> Path:
    """``n`` scene folders linking to the synthetic scene's files (named s00, s01, ...)."""
    for i in range(n):
        folder = root / f"s{i:02d}"
        for sub, paths in (("pre", s.pre), ("post", s.post)):
            (folder / sub).mkdir(parents=True)
            for p in paths:
                (folder / sub / p.name).symlink_to(p)
        (folder / "footprints.geojson").symlink_to(s.buildings)
    return root


def outputs(folder: Path) -> dict[str, bytes]:
    """Final output files (not temporaries, not the summary) by name -> bytes."""
    return {
        p.name: p.read_bytes()
        for p in sorted(folder.iterdir())
        if not p.name.startswith(".") and not p.name.startswith("summary")
    }


def temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def store_bytes(store: Path) -> dict[str, bytes]:
    """Manifest and shard bytes of a chip store (store.json holds run details: left out)."""
    files = [store / "manifest.csv", *sorted((store / "shards").iterdir())]
    return {str(p.relative_to(store)): p.read_bytes() for p in files}


def wait_for(condition, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def scenes(tmp_path_factory, synthetic_scene) -> Path:
    return scene_folders(tmp_path_factory.mktemp("scenes"), synthetic_scene, 12)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, scenes, score_model) -> dict[str, bytes]:
    """The batch scored in one process: what every other way of running it must write."""
    out = tmp_path_factory.mktemp("reference")
    assert run_cli("score-batch", "--scenes", scenes, "--model", score_model, "--out", out,
                   "--workers", "1", "--raster", "--quiet") == 0  # fmt: skip
    return outputs(out)


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory):
    """A `dask scheduler` and two `dask worker` processes on localhost; yields the address."""
    folder = tmp_path_factory.mktemp("dask")
    info = folder / "scheduler.json"
    env = {**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
    common = {"cwd": folder, "env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [
        subprocess.Popen(
            [
                BIN / "dask",
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--no-dashboard",
                "--scheduler-file",
                info,
            ],
            start_new_session=True,
            **common,
        )  # fmt: skip
    ]
    try:

        def written() -> bool:  # the file appears before its contents
            try:
                return bool(json.loads(info.read_text()).get("address"))
            except (OSError, ValueError):
                return False

        assert wait_for(written, 60), "dask scheduler did not start"
        address = json.loads(info.read_text())["address"]
        for _ in range(2):
            procs.append(
                subprocess.Popen(
                    [
                        BIN / "dask",
                        "worker",
                        address,
                        "--nworkers",
                        "1",
                        "--nthreads",
                        "1",
                        "--no-dashboard",
                        "--host",
                        "127.0.0.1",
                    ],
                    start_new_session=True,
                    **common,
                )  # fmt: skip
            )
        from distributed import Client

        with Client(address, timeout=30) as client:
            client.wait_for_workers(2, timeout=120)
        yield address
    finally:
        for proc in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# --- the same command, embedded and on an existing cluster ----------------------------------


@pytest.mark.slow
def test_score_batch_on_embedded_and_remote_clusters_writes_what_one_process_writes(
    scenes, score_model, reference, scheduler, tmp_path, capsys
):
    embedded = tmp_path / "embedded"
    argv = ["score-batch", "--scenes", scenes, "--model", score_model, "--raster"]
    assert run_cli(*argv, "--out", embedded, "--workers", "2") == 0
    assert outputs(embedded) == reference and not temporaries(embedded)
    summary = json.loads((embedded / "summary.json").read_text())
    assert summary["totals"]["scored"] == 12 and summary["totals"]["failed"] == 0
    assert "on Dask scheduler" in capsys.readouterr().err

    remote = tmp_path / "remote"
    from distributed import Client

    with Client(scheduler, timeout=30) as client:
        workers = set(client.scheduler_info()["workers"])
        client.get_task_stream()  # the scheduler records the tasks from now on
        start = time.time()
        assert run_cli(*argv, "--out", remote, "--scheduler", scheduler) == 0
        ran = client.get_task_stream(start=start)
    assert outputs(remote) == reference and not temporaries(remote)
    # both workers took part: each ran some of the batch's tasks
    assert len(workers) == 2
    assert {r["worker"] for r in ran} == workers, [(r["worker"], r["key"]) for r in ran]

    # the DASK_SCHEDULER_ADDRESS convention, and --resume on the cluster
    os.environ["DASK_SCHEDULER_ADDRESS"] = scheduler
    try:
        assert run_cli(*argv, "--out", remote, "--resume", "--quiet") == 0
    finally:
        del os.environ["DASK_SCHEDULER_ADDRESS"]
    summary = json.loads((remote / "summary.json").read_text())
    assert summary["totals"]["done_before"] == 12 and summary["totals"]["scored"] == 0


@pytest.mark.slow
def test_prepare_xbd_embedded_and_remote_build_the_same_store(synthetic_xbd, scheduler, tmp_path):
    args = ["prepare", "xbd", "--root", synthetic_xbd, "--chip-size", "32"]
    assert run_cli(*args, "--out", tmp_path / "one", "--workers", "1") == 0
    assert run_cli(*args, "--out", tmp_path / "two", "--workers", "2") == 0
    assert run_cli(*args, "--out", tmp_path / "remote", "--scheduler", scheduler) == 0
    one = store_bytes(tmp_path / "one")
    assert len(one) > 2
    assert store_bytes(tmp_path / "two") == one
    assert store_bytes(tmp_path / "remote") == one


@pytest.mark.slow
def test_an_unreachable_scheduler_is_a_clear_error(scenes, score_model, tmp_path, capsys):
    dead = "tcp://127.0.0.1:9"  # the discard port: nothing answers there
    rc = run_cli("score-batch", "--scenes", scenes, "--model", score_model,
                 "--out", tmp_path / "o", "--scheduler", dead, "--quiet")  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and f"Dask scheduler {dead} did not answer" in err and "dask scheduler" in err
    assert "Traceback" not in err
    rc = run_cli("prepare", "xbd", "--root", tmp_path, "--out", tmp_path / "c", "--scheduler", dead)
    assert rc == 2


@pytest.mark.slow
def test_relative_paths_reach_workers_in_another_directory(
    scenes, score_model, reference, scheduler, tmp_path, monkeypatch
):
    """The scheduler's workers run in their own working directory: a scene folder, model and
    output folder given relative to the command's are still found and written."""
    monkeypatch.chdir(tmp_path)
    os.symlink(scenes, "scenes")
    os.symlink(score_model, "model.onnx")
    assert run_cli("score-batch", "--scenes", "scenes", "--model", "model.onnx", "--out", "rel",
                   "--raster", "--quiet", "--scheduler", scheduler) == 0  # fmt: skip
    assert outputs(tmp_path / "rel") == reference


# --- fault tolerance --------------------------------------------------------------------------


@pytest.mark.slow
def test_a_worker_killed_mid_batch_changes_nothing(
    tmp_path, synthetic_scene, score_model, reference, scheduler
):
    """SIGKILL one of the two workers while it scores: its scenes are scored again on the other
    (or on the worker its nanny restarts), the batch completes, and every output is byte for byte
    what one process writes; nothing half-written is left."""
    from distributed import Client

    from app.scoring.batch import BatchPlan, read_scene_list, score_batch
    from app.scoring.common import ScoreOptions
    from data_prep.engine import Engine
    from runtime.predictor import Predictor

    folder = scene_folders(tmp_path / "scenes", synthetic_scene, 36)
    jobs, problems = read_scene_list(folder)
    out = tmp_path / "out"
    predictor = Predictor(score_model)
    with Client(scheduler, timeout=30) as client:
        pids = client.run(os.getpid)
        assert len(pids) == 2
        result: dict = {}

        def run() -> None:
            result["report"] = score_batch(
                predictor,
                jobs,
                out,
                BatchPlan(raster=True),
                options=ScoreOptions(progress=False),
                engine=Engine(client=client),
            )

        thread = threading.Thread(target=run)
        thread.start()
        assert wait_for(lambda: out.is_dir() and any(out.glob("s*.geojson")), 120)
        busy = [w for w, tasks in client.processing().items() if tasks]
        victim = pids[busy[0]] if busy else next(iter(pids.values()))
        os.kill(victim, signal.SIGKILL)
        done_at_kill = len(list(out.glob("s*.geojson")))
        thread.join(timeout=240)
        assert not thread.is_alive()
        # the worker was killed mid-batch: it held scenes, some were written before and some after
        assert busy and 1 <= done_at_kill < 36, "the batch ended before a worker could be killed"
        assert victim not in client.run(os.getpid).values()
    report = result["report"]
    assert report.count("scored") == 36 and report.count("failed") == 0
    assert not temporaries(out)
    got = outputs(out)
    assert len(got) == 72
    for i in range(36):
        for suffix in (".geojson", ".tif"):
            # the 12 reference scenes share their inputs with these: same bytes under each name
            assert got[f"s{i:02d}{suffix}"] == reference[f"s{i % 12:02d}{suffix}"]


@pytest.mark.slow
def test_a_worker_killed_mid_preparation_changes_nothing(tmp_path, scheduler):
    """`prepare xbd` on the two workers, one SIGKILLed after the first tile's shards appear: the
    store is byte for byte the one a single process writes, with no temporary left."""
    from distributed import Client

    from data_prep.engine import Engine
    from data_prep.spec import ChipSpec
    from data_prep.synthetic import make_xbd
    from data_prep.xbd import prepare_xbd

    root = make_xbd(tmp_path / "xbd", seed=3, n_tiles=24, size=512)
    spec = ChipSpec(chip_size=64, min_size=32)
    prepare_xbd(root, tmp_path / "one", spec=spec, engine=Engine(workers=1), progress=False)
    out = tmp_path / "killed"
    with Client(scheduler, timeout=30) as client:
        pids = client.run(os.getpid)
        result: dict = {}

        def run() -> None:
            engine = Engine(client=client)
            result["report"] = prepare_xbd(root, out, spec=spec, engine=engine, progress=False)

        thread = threading.Thread(target=run)
        thread.start()
        assert wait_for(lambda: any((out / "shards").glob("*.npy")), 120)
        busy = [w for w, tasks in client.processing().items() if tasks]
        os.kill(pids[busy[0]] if busy else next(iter(pids.values())), signal.SIGKILL)
        done_at_kill = len(list((out / "shards").glob("*.npy")))
        thread.join(timeout=240)
        assert not thread.is_alive()
    assert busy and done_at_kill < 48, "the preparation ended before a worker could be killed"
    report = result["report"]
    assert not [s for s in report.skipped if "not prepared" in s.reason]
    assert store_bytes(out) == store_bytes(tmp_path / "one")
    assert not [p.name for p in (out / "shards").iterdir() if p.name.startswith(".")]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["embedded", "remote"])
def test_a_client_killed_mid_batch_resumes(
    where, tmp_path, synthetic_scene, score_model, reference, scheduler
):
    """SIGKILL the `score-batch` process (with its embedded cluster, or leaving the remote
    cluster running) after its first scene; `--resume` finishes the batch, and the outputs are
    those of an uninterrupted run, with no temporary left."""
    folder = scene_folders(tmp_path / "scenes", synthetic_scene, 36)
    out = tmp_path / "out"
    argv = [
        sys.executable, "-m", "cli.main", "score-batch", "--scenes", str(folder),
        "--model", str(score_model), "--out", str(out), "--raster", "--quiet",
    ]  # fmt: skip
    argv += ["--workers", "2"] if where == "embedded" else ["--scheduler", scheduler]
    proc = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        assert wait_for(lambda: out.is_dir() and any(out.glob("s*.geojson")), 120), (
            proc.communicate()[1][-2000:]
        )
        if where == "embedded":  # the client and the cluster it started die together
            os.killpg(proc.pid, signal.SIGKILL)
        else:  # the client alone; the cluster lives on
            proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    finished = len(list(out.glob("s*.geojson")))
    assert 1 <= finished < 36, "the batch ended before it could be interrupted"
    resume = subprocess.run(
        [*argv, "--resume"], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert resume.returncode == 0, resume.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["totals"]["done_before"] >= finished
    assert summary["totals"]["done_before"] + summary["totals"]["scored"] == 36
    assert not temporaries(out)
    got = outputs(out)
    assert len(got) == 72
    for i in range(36):
        for suffix in (".geojson", ".tif"):
            assert got[f"s{i:02d}{suffix}"] == reference[f"s{i % 12:02d}{suffix}"]


# --- prepare scene: one job per part of the scene ---------------------------------------------


def prepare_small_parts(s, out, **engine):
    """`prepare scene` on the synthetic scene in parts of about 6 buildings, 4 chips a shard;
    ``engine``: the :class:`data_prep.engine.Engine` settings."""
    from data_prep.engine import Engine
    from data_prep.scene_store import SceneOptions, prepare_scene

    options = SceneOptions(label_field=s.label_field, block_size=128, part_size=6, shard_size=4)
    return prepare_scene(s.pre, s.post, s.buildings, out, options=options,
                         engine=Engine(**engine), progress=False)  # fmt: skip


def scene_store_bytes(store: Path) -> dict[str, bytes]:
    """Manifest, shards and store.json (which holds no timings) of a scene's chip store."""
    return {**store_bytes(store), "store.json": (store / "store.json").read_bytes()}


@pytest.mark.slow
def test_prepare_scene_in_process_embedded_and_remote_build_the_same_store(
    synthetic_scene, scheduler, tmp_path
):
    """The parts of a scene cut in this process, on two embedded workers and on the two workers
    of an existing scheduler give the same store byte for byte, with the same chips as one
    part holding the whole scene."""
    from data_prep.scene_store import SceneOptions, prepare_scene
    from data_prep.store import ChipReader, read_manifest

    s = synthetic_scene
    reports = {
        "one": prepare_small_parts(s, tmp_path / "one", workers=1),
        "two": prepare_small_parts(s, tmp_path / "two", workers=2),
        "remote": prepare_small_parts(s, tmp_path / "remote", scheduler=scheduler),
    }
    one = scene_store_bytes(tmp_path / "one")
    shards = [name for name in one if name.startswith("shards/")]
    parts = {name.split("-p")[1][:4] for name in shards}
    assert len(parts) >= 3 and len(shards) > 2 * len(parts)  # several parts, several shards each
    assert scene_store_bytes(tmp_path / "two") == one
    assert scene_store_bytes(tmp_path / "remote") == one
    for report in reports.values():
        assert report.chips == s.covered and report.not_covered == s.not_covered
        assert not report.skipped

    # the parts change where the chips are stored, not the chips (the same reads, in one part)
    whole_scene = SceneOptions(label_field=s.label_field, block_size=128, part_size=10**6)
    prepare_scene(
        s.pre, s.post, s.buildings, tmp_path / "whole", options=whole_scene, progress=False
    )
    whole, parted = read_manifest(tmp_path / "whole"), read_manifest(tmp_path / "one")
    assert list(whole["chip_id"]) == list(parted["chip_id"])
    a, b = ChipReader(tmp_path / "whole"), ChipReader(tmp_path / "one")
    for (_, x), (_, y) in zip(whole.iterrows(), parted.iterrows(), strict=True):
        for cx, cy in zip(a.pair(x), b.pair(y), strict=True):
            assert (cx == cy).all()

    # the command line reaches the cluster too
    args = ["prepare", "scene", "--pre", *s.pre, "--post", *s.post, "--buildings", s.buildings,
            "--label-field", s.label_field]  # fmt: skip
    assert run_cli(*args, "--out", tmp_path / "cli1", "--workers", "1") == 0
    assert run_cli(*args, "--out", tmp_path / "cli2", "--scheduler", scheduler) == 0
    assert scene_store_bytes(tmp_path / "cli2") == scene_store_bytes(tmp_path / "cli1")


def test_a_failed_part_of_a_scene_is_reported_and_the_others_are_written(
    synthetic_scene, tmp_path, monkeypatch
):
    import data_prep.scene_store as scene_module
    from data_prep.store import read_manifest

    s = synthetic_scene
    prepare_small_parts(s, tmp_path / "ok", workers=1)
    cut_part = scene_module.cut_part

    def failing(job):
        if job.part == 1:
            raise OSError("disk on fire")
        return cut_part(job)

    monkeypatch.setattr(scene_module, "cut_part", failing)
    report = prepare_small_parts(s, tmp_path / "bad", workers=1)
    failed = [x for x in report.skipped if " part 1" in x.item]
    assert len(failed) == 1 and "not prepared: OSError: disk on fire" in failed[0].reason
    assert report.exit_code() == 0 and report.chips < s.covered
    ok, bad = read_manifest(tmp_path / "ok"), read_manifest(tmp_path / "bad")
    assert not bad["pre_file"].str.contains("-p0001-").any()
    kept = ok[~ok["pre_file"].str.contains("-p0001-")].reset_index(drop=True)
    assert len(bad) == report.chips == len(kept) > 0
    assert bad.equals(kept)
    shards = sorted(p.name for p in (tmp_path / "bad" / "shards").iterdir())
    assert shards == sorted(
        p.name for p in (tmp_path / "ok" / "shards").iterdir() if "-p0001-" not in p.name
    )
