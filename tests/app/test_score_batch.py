"""`local-damage score-batch`: many scenes, one model load, resumable and sharded."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli


def scene_folder(root: Path, name: str, s, buildings: Path | None = None) -> Path:
    """A scene folder (pre/, post/, one footprint file) linking to the synthetic scene's files."""
    folder = root / name
    for sub, paths in (("pre", s.pre), ("post", s.post)):
        (folder / sub).mkdir(parents=True)
        for p in paths:
            (folder / sub / p.name).symlink_to(p)
    fp = buildings or s.buildings
    (folder / f"footprints{fp.suffix}").symlink_to(fp)
    return folder


def broken_scene(root: Path, name: str, s) -> Path:
    """A scene folder whose only post tile is not an image."""
    folder = root / name
    (folder / "pre").mkdir(parents=True)
    (folder / "post").mkdir()
    (folder / "pre" / s.pre[0].name).symlink_to(s.pre[0])
    (folder / "post" / "post.tif").write_bytes(b"this is not a GeoTIFF")
    (folder / "footprints.geojson").symlink_to(s.buildings)
    return folder


def finals(folder: Path, suffix: str) -> list[Path]:
    """Files with a final name (temporaries start with a dot) and this suffix, sorted."""
    return sorted(p for p in folder.glob(f"*{suffix}") if not p.name.startswith("."))


def n_features(path: Path) -> int:
    import geopandas as gpd

    return len(gpd.read_file(path))


@pytest.mark.slow
def test_csv_batch_with_a_bad_scene(tmp_path, synthetic_scene, score_model, capsys):
    s = synthetic_scene
    rel = Path(os.path.relpath(s.root, tmp_path))
    (tmp_path / "broken.tif").write_bytes(b"corrupt")
    csv = tmp_path / "scenes.csv"
    pre = ";".join(str(rel / "pre" / p.name) for p in s.pre)
    post = ";".join(str(rel / "post" / p.name) for p in s.post)
    csv.write_text(
        "name,pre,post,buildings\n"
        f"alpha,{pre},{post},{rel / 'buildings.geojson'}\n"
        f"beta,{pre},{post},{s.buildings_gpkg}\n"
        f"broken,{pre},broken.tif,{rel / 'buildings.geojson'}\n"
        f"empty,{pre},,{rel / 'buildings.geojson'}\n"
    )
    out = tmp_path / "out"
    rc = run_cli("score-batch", "--scenes", csv, "--model", score_model, "--out", out, "--quiet")
    assert rc == 0
    err = capsys.readouterr().err
    assert n_features(out / "alpha.geojson") == s.n_buildings
    assert n_features(out / "beta.geojson") == s.n_buildings
    assert not (out / "broken.geojson").exists()
    summary = json.loads((out / "summary.json").read_text())
    by_name = {e["name"]: e for e in summary["scenes"]}
    assert by_name["alpha"]["status"] == by_name["beta"]["status"] == "scored"
    assert by_name["alpha"]["report"]["scored"] == s.covered
    assert by_name["broken"]["status"] == "failed"
    assert "broken.tif" in by_name["broken"]["error"]
    assert summary["totals"]["failed"] == 1 and summary["totals"]["scored"] == 2
    assert [p["item"] for p in summary["problems"]] == [f"{csv} line 5"]
    assert "broken.tif" in err and "line 5" in err  # the printed summary lists the problems
    assert sorted(p.name for p in out.iterdir()) == [
        "alpha.geojson",
        "beta.geojson",
        "summary.json",
    ]


@pytest.mark.slow
def test_folder_batch_gpkg_raster_overlay(tmp_path, synthetic_scene, score_model):
    import geopandas as gpd
    import rasterio

    s = synthetic_scene
    scenes = tmp_path / "scenes"
    scene_folder(scenes, "north", s)
    scene_folder(scenes, "south", s, s.buildings_gpkg)
    out = tmp_path / "out"
    rc = run_cli(
        "score-batch", "--scenes", scenes, "--model", score_model, "--out", out,
        "--format", "gpkg", "--raster", "--overlay", "--quiet",
    )  # fmt: skip
    assert rc == 0
    for name in ("north", "south"):
        df = gpd.read_file(out / f"{name}.gpkg")
        assert df.crs.to_epsg() == 32615 and len(df) == s.n_buildings
        with rasterio.open(out / f"{name}.tif") as ds:
            assert ds.crs.to_epsg() == 32615
        assert (out / f"{name}.png").stat().st_size > 0


@pytest.mark.slow
def test_model_is_loaded_once(tmp_path, synthetic_scene, score_model, monkeypatch):
    import cli.score
    import runtime.predictor

    loads = []

    class Counting(runtime.predictor.Predictor):
        def __init__(self, *args, **kwargs):
            loads.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(cli.score, "Predictor", Counting)
    scenes = tmp_path / "scenes"
    for name in ("a", "b", "c"):
        scene_folder(scenes, name, synthetic_scene)
    rc = run_cli(
        "score-batch", "--scenes", scenes, "--model", score_model, "--out", tmp_path / "o",
        "--quiet",
    )  # fmt: skip
    assert rc == 0
    assert len(loads) == 1
    assert len(finals(tmp_path / "o", ".geojson")) == 3


@pytest.mark.slow
def test_resume_rescores_only_missing_outputs(tmp_path, synthetic_scene, score_model):
    scenes = tmp_path / "scenes"
    for name in ("a", "b", "c"):
        scene_folder(scenes, name, synthetic_scene)
    out = tmp_path / "out"
    argv = ["score-batch", "--scenes", scenes, "--model", score_model, "--out", out, "--quiet"]
    assert run_cli(*argv) == 0
    before = {p.name: p.stat().st_mtime_ns for p in finals(out, ".geojson")}
    (out / "b.geojson").unlink()
    (out / ".a.geojson.stale.geojson").write_text("{")  # a temporary an earlier kill left
    assert run_cli(*argv, "--resume") == 0
    after = {p.name: p.stat().st_mtime_ns for p in finals(out, ".geojson")}
    assert after["a.geojson"] == before["a.geojson"]
    assert after["c.geojson"] == before["c.geojson"]
    assert n_features(out / "b.geojson") == synthetic_scene.n_buildings
    summary = json.loads((out / "summary.json").read_text())
    assert {e["name"]: e["status"] for e in summary["scenes"]} == {
        "a": "done",
        "b": "scored",
        "c": "done",
    }
    # asking for more outputs than a finished scene has scores it again
    assert run_cli(*argv, "--resume", "--raster") == 0
    assert sorted(p.name for p in finals(out, ".tif")) == ["a.tif", "b.tif", "c.tif"]


def _scene_counts(report: dict) -> tuple:
    return report["buildings"], report["scored"], report["per_class"], report["not_covered"]


@pytest.mark.slow
@pytest.mark.parametrize("earlier_summary", [True, False], ids=["from-summary", "from-outputs"])
def test_resumed_summary_covers_scenes_done_before(
    tmp_path, synthetic_scene, score_model, earlier_summary
):
    """A resumed summary counts every scene: those done before keep their report (from the
    earlier summary, or read back from their outputs when there is none)."""
    scenes = tmp_path / "scenes"
    for name in ("a", "b"):
        scene_folder(scenes, name, synthetic_scene)
    out = tmp_path / "out"
    argv = ["score-batch", "--scenes", scenes, "--model", score_model, "--out", out, "--quiet"]
    assert run_cli(*argv, "--format", "gpkg") == 0
    first = json.loads((out / "summary.json").read_text())
    reports = {e["name"]: e["report"] for e in first["scenes"]}
    (out / "b.gpkg").unlink()
    if not earlier_summary:
        (out / "summary.json").unlink()
    assert run_cli(*argv, "--format", "gpkg", "--resume") == 0
    resumed = json.loads((out / "summary.json").read_text())
    by_name = {e["name"]: e for e in resumed["scenes"]}
    assert by_name["a"]["status"] == "done"
    assert by_name["a"]["report_from"] == ("summary" if earlier_summary else "outputs")
    assert _scene_counts(by_name["a"]["report"]) == _scene_counts(reports["a"])
    assert by_name["a"]["report"]["alignment"] == reports["a"]["alignment"]
    assert resumed["totals"]["buildings"] == first["totals"]["buildings"] == 2 * 40
    # resuming once more, with nothing left to score, still counts both scenes
    assert run_cli(*argv, "--format", "gpkg", "--resume") == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["totals"]["buildings"] == 80
    assert again["totals"]["done_before"] == 2


def _wait_for(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.005)
    return False


def _release(fifo: Path) -> None:
    """Let a reader still blocked on ``fifo`` go on (it reads an empty file)."""
    with contextlib.suppress(OSError):  # no reader left
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_batch_resumes(tmp_path, synthetic_scene, score_model, sig):
    """Kill a batch after its first scene: no partial outputs, resume finishes the rest.

    The footprint file of the second scene (s01) is a named pipe nothing writes to, so that scene
    waits, and the batch cannot end, until the signal: the kill lands mid-batch whatever the
    machine's speed. Before the resume the pipe is replaced by the scene's footprint file.
    """
    s = synthetic_scene
    names = [f"s{i:02d}" for i in range(24)]
    waits = tmp_path / "waits.geojson"
    os.mkfifo(waits)
    scenes = tmp_path / "scenes.csv"
    pre, post = ";".join(map(str, s.pre)), ";".join(map(str, s.post))
    scenes.write_text(
        "name,pre,post,buildings\n"
        + "".join(f"{n},{pre},{post},{waits if n == 's01' else s.buildings}\n" for n in names)
    )
    out = tmp_path / "out"
    argv = [
        sys.executable, "-m", "cli.main", "score-batch", "--scenes", str(scenes),
        "--model", str(score_model), "--out", str(out), "--raster", "--overlay", "--quiet",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert _wait_for(lambda: any(finals(out, ".geojson")), 120), proc.communicate()[1][-2000:]
        assert proc.poll() is None, "the batch ended while a scene's footprints could not be read"
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _release(waits)
    finished = sorted(p.stem for p in finals(out, ".geojson"))
    assert 1 <= len(finished) < len(names) and "s01" not in finished, finished
    if sig == signal.SIGTERM:
        assert proc.returncode == 130, proc.stderr.read().decode()[-2000:]
        leftovers = [p.name for p in out.iterdir() if p.name.startswith(".")]
        assert not leftovers, f"temporaries left after SIGTERM: {leftovers}"
    else:
        assert proc.returncode == -signal.SIGKILL
    # whatever carries a final name is complete
    for stem in finished:
        assert n_features(out / f"{stem}.geojson") == synthetic_scene.n_buildings
        assert (out / f"{stem}.tif").is_file() and (out / f"{stem}.png").is_file()
    for path in out.iterdir():
        if not path.name.startswith(".") and path.suffix in (".tif", ".png"):
            assert path.stat().st_size > 0

    waits.unlink()
    waits.symlink_to(s.buildings)
    rc = run_cli(
        "score-batch", "--scenes", scenes, "--model", score_model, "--out", out, "--raster",
        "--overlay", "--resume", "--quiet",
    )  # fmt: skip
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    status = {e["name"]: e["status"] for e in summary["scenes"]}
    assert {n for n, st in status.items() if st == "done"} == set(finished)
    assert all(st in ("done", "scored") for st in status.values())
    assert sorted(p.stem for p in finals(out, ".geojson")) == names
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_shards_partition_the_scenes(tmp_path, synthetic_scene, score_model):
    from app.scoring.batch import parse_shard, read_scene_list, shard_of

    scenes = tmp_path / "scenes"
    names = [f"scene-{i}" for i in range(7)]
    for name in names:
        scene_folder(scenes, name, synthetic_scene)
    jobs, problems = read_scene_list(scenes)
    assert [j.name for j in jobs] == names and not problems
    parts = {i: {j.name for j in jobs if shard_of(j.name, 3) == i} for i in (1, 2, 3)}
    assert set().union(*parts.values()) == set(names)
    assert sum(len(p) for p in parts.values()) == len(names)
    # the assignment depends on the name only, the same on every machine and in every process
    # (pinned: sha256 of the UTF-8 name, not Python's per-process string hash)
    assert [shard_of(n, 3) for n in names] == [2, 2, 1, 2, 3, 1, 1]
    pinned = {"joplin": 4, "puerto-rico/tile_0_107": 3, "Ünïcode": 2, "a": 3}
    assert {n: shard_of(n, 4) for n in pinned} == pinned
    assert parse_shard("2/3") == (2, 3)
    for bad in ("0/3", "4/3", "1/0", "x", "1-3"):
        with pytest.raises(ValueError, match="shard"):
            parse_shard(bad)

    out = tmp_path / "out"
    rc = run_cli(
        "score-batch", "--scenes", scenes, "--model", score_model, "--out", out,
        "--shard", "2/3", "--quiet",
    )  # fmt: skip
    assert rc == 0
    assert {p.stem for p in finals(out, ".geojson")} == parts[2]
    summary = json.loads((out / "summary-2-of-3.json").read_text())
    assert summary["shard"] == "2/3"
    assert {e["name"] for e in summary["scenes"]} == parts[2]
    assert not (out / "summary.json").exists()


@pytest.mark.slow
def test_all_scenes_bad_exits_non_zero(tmp_path, synthetic_scene, score_model, capsys):
    scenes = tmp_path / "scenes"
    broken_scene(scenes, "bad1", synthetic_scene)
    broken_scene(scenes, "bad2", synthetic_scene)
    (scenes / "nofootprints" / "pre").mkdir(parents=True)
    out = tmp_path / "out"
    rc = run_cli("score-batch", "--scenes", scenes, "--model", score_model, "--out", out, "--quiet")
    assert rc == 1
    err = capsys.readouterr().err
    assert "bad1" in err and "bad2" in err and "nofootprints" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["totals"]["failed"] == 2 and summary["totals"]["problems"] == 1
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


def test_scene_list_errors(tmp_path, synthetic_scene, score_model, capsys):
    from app.scoring.batch import read_scene_list
    from data_prep.mosaic import SceneError

    csv = tmp_path / "scenes.csv"
    csv.write_text("pre,post\na.tif,b.tif\n")
    rc = run_cli("score-batch", "--scenes", csv, "--model", score_model, "--out", tmp_path / "o")
    assert rc == 2
    err = capsys.readouterr().err
    assert str(csv) in err and "buildings" in err
    with pytest.raises(SceneError, match="not found"):
        read_scene_list(tmp_path / "absent")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(SceneError, match="no scene folders"):
        read_scene_list(tmp_path / "emptydir")
    # names default to the footprint stem, or its path when stems repeat; duplicates are refused
    s = synthetic_scene
    csv.write_text(
        "pre,post,buildings,name\n"
        f"{s.pre[0]},{s.post[0]},{s.buildings},\n"
        f"{s.pre[0]},{s.post[0]},{s.buildings_gpkg},\n"
        f"{s.pre[0]},{s.post[0]},{s.buildings},twice\n"
        f"{s.pre[0]},{s.post[0]},{s.buildings},twice\n"
    )
    jobs, problems = read_scene_list(csv)
    assert [j.name for j in jobs] == [f"{s.root.name}/buildings", "twice"]
    assert [p.item for p in problems] == [f"{csv} line 3", f"{csv} line 5"]
    assert all("name column" in p.reason for p in problems)
