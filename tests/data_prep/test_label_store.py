"""The analysts' label store: concurrent saves from threads and processes, history, the import of
old ``corrections.json``, a process killed mid-burst, a full disk and an unwritable folder."""

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

from data_prep.spec import CLASS_NAMES
from tests.conftest import REPO

#: A child process that saves corrections to an assessment and prints each acknowledged one.
SAVER = """
import sys, time
from pathlib import Path
from app.web.sessions import save_correction
session, who, start, n, rows, names = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6].split(",")
while not Path(start).exists():
    time.sleep(0.005)
for i in range(n):
    save_correction(session, i % rows, names[i % len(names)], analyst=f"{who}-{i}")
    print(f"{who}-{i}", flush=True)
"""


@pytest.fixture(scope="module")
def xbd_tile(synthetic_xbd):
    from data_prep.synthetic import tile_name

    name = tile_name(0)
    images = synthetic_xbd / "images"
    label = synthetic_xbd / "labels" / f"{name}_post_disaster.json"
    return images / f"{name}_pre_disaster.png", images / f"{name}_post_disaster.png", label


def _assess(predictor, xbd_tile, work: Path, name: str = "s1") -> Path:
    """A fresh assessment of the synthetic tile in the app's layout, ``work/sessions/name``."""
    from app.web.app import assess_tile

    return assess_tile(predictor, *xbd_tile, work / "sessions" / name).session


def _saver(session: Path, who: str, start: Path, n: int, rows: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-c", SAVER, str(session), who, str(start), str(n), str(rows)]
    return subprocess.Popen(
        [*args, ",".join(CLASS_NAMES)], env=env, cwd=REPO, stdout=subprocess.PIPE, text=True
    )


@contextlib.contextmanager
def _small_work(predictor, xbd_tile, tmp_path: Path, size: str):
    """A work folder on a small tmpfs of ``size`` holding one assessment (its imagery and map
    left out): yields ``(mount point, assessment folder)``; skips where mounting is not allowed."""
    import shutil

    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small file system here ({done.stderr.strip()})")
    try:
        session = _assess(predictor, xbd_tile, tmp_path)
        target = mnt / "sessions" / "s1"
        target.parent.mkdir()
        shutil.copytree(session, target, ignore=shutil.ignore_patterns("*.png", "*.html", "*.jpg"))
        yield mnt, target
    except BaseException:
        subprocess.run(["umount", str(mnt)], check=False)
        raise
    done = subprocess.run(["umount", str(mnt)], capture_output=True, text=True)
    assert done.returncode == 0, f"a file of the store is still open: {done.stderr}"


def _analysts(work: Path) -> list[str]:
    from data_prep.label_store import STORE_NAME, LabelStore

    return sorted(c.analyst for c in LabelStore(work / STORE_NAME).rows())


@pytest.mark.slow
def test_120_corrections_from_4_threads_all_kept(predictor, xbd_tile, tmp_path):
    from app.web.sessions import read_corrections_json, read_session, save_correction

    session = _assess(predictor, xbd_tile, tmp_path)
    rows = len(read_session(session)["uids"])
    go = threading.Barrier(4)
    failures = []

    def worker(t: int) -> None:
        go.wait()
        for i in range(30):
            try:
                save_correction(session, (t * 30 + i) % rows, CLASS_NAMES[i % 4], f"t{t}-{i}")
            except Exception as exc:  # noqa: BLE001  (reported below)
                failures.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    expected = sorted(f"t{t}-{i}" for t in range(4) for i in range(30))
    assert _analysts(tmp_path) == expected  # 120 rows, none lost, none doubled
    latest = read_corrections_json(session)
    assert len(latest) == min(rows, 120)  # every corrected building, with one latest grade
    # the label file written after the saves holds the latest grade of every building
    label = (
        session / "corrections" / "labels" / f"{read_session(session)['scene']}_post_disaster.json"
    )
    written = {
        f["properties"]["uid"]: f["properties"]["subtype"]
        for f in json.loads(label.read_text())["features"]["xy"]
    }
    assert written == {e["uid"]: e["damage"] for e in latest.values()}  # fmt: skip


@pytest.mark.slow
def test_120_corrections_from_4_processes_all_kept(predictor, xbd_tile, tmp_path):
    from app.web.sessions import read_session

    session = _assess(predictor, xbd_tile, tmp_path)
    rows = len(read_session(session)["uids"])
    start = tmp_path / "go"
    procs = [_saver(session, f"p{k}", start, 30, rows) for k in range(4)]
    time.sleep(1.0)  # every child imported and waiting
    start.touch()
    acknowledged = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0
        acknowledged += out.split()
    assert len(acknowledged) == 120
    assert _analysts(tmp_path) == sorted(acknowledged)


def test_history_latest_wins_and_is_shared_by_assessments(predictor, xbd_tile, tmp_path):
    from app.web.sessions import building_history, read_corrections_json, save_correction

    first = _assess(predictor, xbd_tile, tmp_path, "a")
    save_correction(first, 0, "minor-damage", analyst="ana")
    save_correction(first, 0, "destroyed", analyst="ben")  # a correction of a correction
    second = _assess(predictor, xbd_tile, tmp_path, "b")  # the same tile, assessed again
    assert read_corrections_json(second)["0"]["damage"] == "destroyed"
    assert read_corrections_json(second)["0"]["analyst"] == "ben"
    save_correction(second, 0, "major-damage", analyst="cat")
    history = building_history(first, 0)
    assert [(c.analyst, c.grade) for c in history] == [
        ("ana", "minor-damage"), ("ben", "destroyed"), ("cat", "major-damage"),
    ]  # fmt: skip
    assert read_corrections_json(first)["0"]["damage"] == "major-damage"
    # the map of an assessment made after a correction shows it, with who set it
    import html
    import re

    from app.web.tile_views import map_frame

    third = _assess(predictor, xbd_tile, tmp_path, "c")
    page = html.unescape(re.search(r'srcdoc="(.*?)" style', map_frame(third), re.S).group(1))
    data = json.loads(re.search(r'type="application/json">(.*?)</script>', page, re.S).group(1))
    marks = {f["properties"]["n"]: (f["properties"]["corrected"], f["properties"]["corrected_by"])
             for f in data["buildings"]["features"]}  # fmt: skip
    assert marks[0] == ("major-damage", "cat") and marks[1] == (None, None)
    assert history[0].predicted and history[0].model_sha256 and len(history[0].probabilities) == 4
    assert history[0].pixel_wkt.startswith("POLYGON")


def test_store_opens_as_a_geopackage_layer(predictor, xbd_tile, tmp_path):
    import pyogrio

    from app.web.campaign import export_store
    from app.web.sessions import save_correction
    from data_prep.label_store import LAYER, STORE_NAME

    session = _assess(predictor, xbd_tile, tmp_path)
    save_correction(session, 1, "destroyed", analyst="ana")
    save_correction(session, 1, "major-damage", analyst="ben")
    info = pyogrio.read_info(tmp_path / STORE_NAME, layer=LAYER)
    assert info["features"] == 2 and info["crs"] == "EPSG:4326"
    assert {"event", "uid", "grade", "predicted", "analyst", "time"} <= set(info["fields"])
    done = export_store(tmp_path / STORE_NAME, tmp_path / "out")
    assert done.buildings == 1 and done.xbd_tiles == 1
    table = pyogrio.read_dataframe(done.vector)
    assert list(table["damage"]) == ["major-damage"] and list(table["analyst"]) == ["ben"]


def test_old_corrections_json_imported_once(predictor, xbd_tile, tmp_path):
    from app.web.sessions import import_work, read_corrections_json, read_session
    from data_prep.label_store import STORE_NAME, LabelStore

    session = _assess(predictor, xbd_tile, tmp_path)
    uids = read_session(session)["uids"]
    old = {str(r): {"uid": uids[r], "damage": "destroyed", "predicted": "no-damage",
                    "time": f"2026-01-0{r + 1}T00:00:00Z"} for r in range(3)}  # fmt: skip
    (session / "corrections.json").write_text(json.dumps(old))
    assert import_work(tmp_path) == (3, [])
    assert import_work(tmp_path) == (0, [])  # once
    assert len(LabelStore(tmp_path / STORE_NAME).rows()) == 3
    got = read_corrections_json(session)
    assert {k: (v["uid"], v["damage"], v["time"]) for k, v in got.items()} == {
        k: (v["uid"], v["damage"], v["time"]) for k, v in old.items()
    }


@pytest.mark.slow
def test_kill_9_during_a_burst_loses_nothing_acknowledged(predictor, xbd_tile, tmp_path):
    from app.web.sessions import read_session
    from data_prep.label_store import STORE_NAME, LabelStore

    session = _assess(predictor, xbd_tile, tmp_path)
    rows = len(read_session(session)["uids"])
    start = tmp_path / "go"
    start.touch()
    for attempt in range(3):
        proc = _saver(session, f"k{attempt}", start, 10_000, rows)
        acknowledged = []
        while len(acknowledged) < 10 + 7 * attempt:
            acknowledged.append(proc.stdout.readline().strip())
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        store = LabelStore(tmp_path / STORE_NAME)
        assert store.check() == "ok"
        kept = {c.analyst for c in store.rows()}
        assert set(acknowledged) <= kept, set(acknowledged) - kept


def test_write_failure_is_a_clear_error_and_keeps_the_store(predictor, xbd_tile, tmp_path):
    """A file-size limit makes the writes fail as a full disk does: the save is refused with
    the store's name, and every earlier correction is still there."""
    session = _assess(predictor, xbd_tile, tmp_path)
    code = (
        "import resource, signal, sys\n"
        "from app.web.sessions import AppError, save_correction\n"
        "save_correction(sys.argv[1], 0, 'destroyed', analyst='before')\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "size = __import__('os').path.getsize(sys.argv[2])\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))\n"
        "for i in range(500):\n"
        "    try:\n"
        "        save_correction(sys.argv[1], 1, 'minor-damage', analyst=f'after-{i}')\n"
        "    except AppError as exc:\n"
        "        if 'NOT saved' in str(exc):\n"
        "            print('ERROR', exc)\n"
        "            break\n"
        "        assert 'is saved in' in str(exc), exc  # the map or label file beside it\n"
        "    print('after', i, flush=True)\n"
    )
    store = tmp_path / "labels.gpkg"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # the store exists before the limit is set (the first save creates it)
    from app.web.sessions import save_correction

    save_correction(session, 2, "destroyed", analyst="first")
    out = subprocess.run(
        [sys.executable, "-c", code, str(session), str(store)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    error = [line for line in out.stdout.splitlines() if line.startswith("ERROR")]
    assert error, out.stdout + out.stderr
    assert "was NOT saved" in error[0] and str(store) in error[0]
    from data_prep.label_store import LabelStore

    kept = {c.analyst for c in LabelStore(store).rows()}
    acknowledged = {f"after-{line.split()[1]}" for line in out.stdout.splitlines() if line.startswith("after")}  # fmt: skip
    assert {"first", "before"} | acknowledged <= kept
    assert LabelStore(store).check() == "ok"


@pytest.mark.slow
def test_full_disk_is_a_clear_error(predictor, xbd_tile, tmp_path):
    """A real full file system (a 1 MiB tmpfs): the save is refused as such, nothing lost."""
    from app.web.sessions import AppError, save_correction
    from data_prep.label_store import LabelStore

    with _small_work(predictor, xbd_tile, tmp_path, "1m") as (mnt, target):
        saved, refused = [], None
        for i in range(5000):
            try:
                save_correction(target, i % 3, "destroyed", analyst=f"a{i}")
                saved.append(f"a{i}")
            except AppError as exc:  # the label file beside the store may fail first
                if "NOT saved" in str(exc):
                    refused = str(exc)
                    break
                assert "is saved in" in str(exc) and "No space left" in str(exc)
                saved.append(f"a{i}")
        assert refused and "disk is full" in refused, refused
        store = LabelStore(mnt / "labels.gpkg")
        assert set(saved) <= {c.analyst for c in store.rows()}
        assert store.check() == "ok"


def test_unwritable_store_is_a_clear_error(predictor, xbd_tile, tmp_path):
    from app.web.sessions import AppError, save_correction

    session = _assess(predictor, xbd_tile, tmp_path)
    (tmp_path / "labels.gpkg").mkdir()  # the store's name taken by a folder
    with pytest.raises(AppError, match="NOT saved.*labels.gpkg"):
        save_correction(session, 0, "destroyed")


def test_commands_read_the_store(predictor, score_model, xbd_tile, tmp_path, capsys):
    """`labels show/export`, `prepare xbd --xbd STORE` and `adapt --corrections STORE`."""
    import pandas as pd

    from app.web.sessions import save_correction
    from tests.conftest import run_cli

    session = _assess(predictor, xbd_tile, tmp_path / "work")
    grades = ["destroyed", "no-damage", "destroyed", "no-damage", "major-damage"]
    for row, grade in enumerate(grades):
        save_correction(session, row, "minor-damage", analyst="ana")
        save_correction(session, row, grade, analyst="ben")  # the latest wins everywhere
    store = tmp_path / "work" / "labels.gpkg"
    assert run_cli("labels", "show", tmp_path / "work") == 0
    out = capsys.readouterr().out
    assert "10 corrections of 5 buildings" in out and "ben 5" in out and "destroyed 2" in out
    scene = json.loads((session / "session.json").read_text())["scene"]
    uid = json.loads((session / "session.json").read_text())["uids"][0]
    assert run_cli("labels", "show", store, "--history", scene, uid) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1:3] for line in lines] == [["ana", "minor-damage"], ["ben", "destroyed"]]

    assert run_cli("labels", "export", store, "--out", tmp_path / "export", "--name", "c.gpkg") == 0
    import pyogrio

    layer = pyogrio.read_dataframe(tmp_path / "export" / "c.gpkg")
    assert sorted(layer["damage"]) == sorted(grades) and set(layer["analyst"]) == {"ben"}

    assert run_cli("prepare", "xbd", "--xbd", store, "--out", tmp_path / "chips", "--quiet") == 0
    manifest = pd.read_csv(tmp_path / "chips" / "manifest.csv")
    assert sorted(manifest["label"].map(dict(enumerate(CLASS_NAMES)))) == sorted(grades)

    out_model = tmp_path / "adapted.onnx"
    args = ["adapt", "--model", score_model, "--corrections", store, "--out", out_model, "--quiet"]
    assert run_cli(*args) == 0
    from runtime.predictor import Predictor

    labels = Predictor(out_model).metadata["adaptation"]["labels"]
    assert labels["n"] == 5
    assert labels["per_class"] == {n: grades.count(n) for n in CLASS_NAMES}


def test_read_only_folder_is_a_clear_error(predictor, xbd_tile, tmp_path):
    """The work folder's file system turned read-only (a remounted tmpfs): the save is refused
    as such; once writable again the earlier corrections are all there."""
    from app.web.sessions import AppError, save_correction
    from data_prep.label_store import LabelStore

    with _small_work(predictor, xbd_tile, tmp_path, "8m") as (mnt, target):
        save_correction(target, 0, "destroyed", analyst="before")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with pytest.raises(AppError, match="NOT saved.*(cannot write there|read-only)"):
            save_correction(target, 1, "destroyed", analyst="during")
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
        assert [c.analyst for c in LabelStore(mnt / "labels.gpkg").rows()] == ["before"]


def test_georeferenced_corrections_export_for_prepare_scene(predictor, synthetic_scene, tmp_path):
    """A georeferenced tile's corrections: exported with lon/lat footprints and `damage`, which
    `prepare scene --label-field damage` cuts on the scene's GeoTIFFs."""
    import pandas as pd

    from app.web.app import assess_tile
    from app.web.sessions import save_correction
    from tests.conftest import run_cli

    s = synthetic_scene
    result = assess_tile(predictor, s.pre[0], s.post[0], s.buildings, tmp_path / "sessions" / "g")
    rows = [r["#"] for r in result.rows if r["status"] == "scored"][:3]
    for row, grade in zip(rows, ["destroyed", "minor-damage", "no-damage"], strict=True):
        save_correction(result.session, row, grade, analyst="ana")
    assert run_cli("labels", "export", tmp_path, "--out", tmp_path / "export") == 0
    export = tmp_path / "export" / "corrections.geojson"
    assert not (tmp_path / "export" / "xbd").exists()  # no xBD tile among them
    args = ["prepare", "scene", "--pre", s.pre[0], "--post", s.post[0], "--buildings", export,
            "--label-field", "damage", "--out", tmp_path / "chips", "--quiet"]  # fmt: skip
    assert run_cli(*args) == 0
    manifest = pd.read_csv(tmp_path / "chips" / "manifest.csv", dtype={"uid": str})
    assert sorted(manifest["label"].map(dict(enumerate(CLASS_NAMES)))) == sorted(
        ["destroyed", "minor-damage", "no-damage"]
    )
