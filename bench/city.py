"""`local-damage bench city`: a whole city scored on one machine, against a scene a tenth its size.

Two synthetic scenes of the same density (:func:`data_prep.synthetic_scene.make_large_scene`,
one building per ``spacing`` px cell, written block by block) are scored end to end, GeoPackage
out: the city (default 40,000 buildings, 20,000 px a side) and a small scene (default 4,000).

- **One worker**: each scene is scored by :func:`app.scoring.scene.score_scene` in a fresh
  process of its own (ONNX Runtime and OpenCV on one thread, after a warm-up scene), which reports
  its scoring time and its peak resident memory (``ru_maxrss``: imports, the model and all).
- **Workers of the embedded Dask cluster**: the same scenes as ``score-batch`` jobs over the
  same imagery, their footprints cut into districts (strips of rows, two per worker) so that the
  workers share the scene; the cluster is started and warmed up before timing, and each worker
  reports its peak resident memory after the run.

The figures: seconds per building of each scene, their ratio (city over small: goal at most
1 + :data:`RATIO_GOAL`), and the peak memory of every process (goal: under :data:`RSS_GOAL_MB`).
Scoring reads one block of buildings at a time and keeps only the per-building results, so its
memory should not grow with the scene.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from app.scoring.batch import BatchPlan, SceneJob, score_batch
from app.scoring.common import ScoreOptions
from app.scoring.scene import score_scene
from bench.score_core import one_opencv_thread
from data_prep.engine import Engine, EngineError, open_client
from data_prep.errors import UsageError
from data_prep.mosaic import SceneError
from data_prep.synthetic_scene import make_large_scene
from runtime.contract import ModelError
from runtime.predictor import Predictor
from runtime.registry import default_model

#: Default buildings of the city and of the small scene.
CITY, SMALL = 40_000, 4_000
#: Goal: the city's seconds per building at most this much over the small scene's.
RATIO_GOAL = 0.15
#: Goal: peak resident memory of every scoring process, in MiB.
RSS_GOAL_MB = 1536
#: Side of the warm-up scene in pixels.
WARM_SIZE = 400


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB (Linux ``ru_maxrss`` is in KiB)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024 if sys.platform != "darwin" else kib / 2**20


def make_city(root: str | os.PathLike, buildings: int, spacing: int = 100) -> SceneJob:
    """A square synthetic scene of at least ``buildings`` buildings (``ceil(sqrt(n))`` cells a
    side, ``spacing`` px each), as a scene job; made once per folder."""
    root = Path(root)
    cells = max(math.ceil(math.sqrt(max(int(buildings), 1))), 1)
    if not (root / "buildings.geojson").exists():
        make_large_scene(root, cells * spacing, spacing=spacing)
    return SceneJob(
        name=root.name,
        pre=(str(root / "pre" / "pre.tif"),),
        post=(str(root / "post" / "post.tif"),),
        buildings=str(root / "buildings.geojson"),
    )


def districts(scene: SceneJob, parts: int) -> list[SceneJob]:
    """The scene's footprints cut into ``parts`` strips of rows (by each feature's first
    vertex), one GeoJSON each beside the scene's, as jobs over the same imagery."""
    source = Path(scene.buildings)
    collection = json.loads(source.read_text())
    features = collection["features"]
    top = [-f["geometry"]["coordinates"][0][0][1] for f in features]  # north first
    order = sorted(range(len(features)), key=top.__getitem__)
    size = math.ceil(len(features) / max(parts, 1))
    jobs = []
    for i in range(max(parts, 1)):
        part = [features[k] for k in order[i * size : (i + 1) * size]]
        if not part:
            continue
        path = source.with_name(f"{source.stem}.district{i:02d}.geojson")
        if not path.exists():
            path.write_text(json.dumps({**collection, "features": part}))
        jobs.append(SceneJob(f"{scene.name}-d{i:02d}", scene.pre, scene.post, str(path)))
    return jobs


def _score_alone(model: str, scene: SceneJob, warm: SceneJob, out: str) -> dict[str, Any]:
    """In a fresh process: score ``warm`` (untimed), then ``scene``; its figures."""
    predictor = Predictor(model, threads=1)
    options = ScoreOptions(progress=False, profile=True)
    with one_opencv_thread():
        score_scene(
            predictor, warm.pre, warm.post, warm.buildings, Path(out) / "warm.gpkg", options=options
        )
        before = peak_rss_mb()
        start = time.perf_counter()
        report = score_scene(
            predictor,
            scene.pre,
            scene.post,
            scene.buildings,
            Path(out) / f"{scene.name}.gpkg",
            options=options,
        )
        seconds = time.perf_counter() - start
    return {
        "buildings": report.buildings,
        "scored": report.scored,
        "seconds": seconds,
        "rss_before_mb": before,
        "peak_rss_mb": peak_rss_mb(),
        "stages": report.stages,
    }


def score_alone(model: str, scene: SceneJob, warm: SceneJob, out: str) -> dict[str, Any]:
    """:func:`_score_alone` in a fresh (spawned) process, so its peak memory is its own."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(_score_alone, model, scene, warm, out).result()


def score_workers(
    model: str, scenes: list[SceneJob], warm: SceneJob, out: Path, workers: int
) -> list[dict[str, Any]]:
    """Each scene cut into ``2 * workers`` districts and scored by ``score-batch`` on an
    embedded Dask cluster of ``workers`` processes (warmed up first); per scene: buildings,
    seconds, and the peak memory of every worker after it."""
    predictor = Predictor(model)
    rows = []
    with open_client(workers) as client:
        options = ScoreOptions(progress=False)
        warm_jobs = [
            SceneJob(f"warm{i}", warm.pre, warm.post, warm.buildings) for i in range(2 * workers)
        ]
        score_batch(
            predictor,
            warm_jobs,
            out / "warm",
            options=options,
            engine=Engine(workers, client=client),
        )
        for scene in scenes:
            jobs = districts(scene, 2 * workers)
            start = time.perf_counter()
            report = score_batch(
                predictor,
                jobs,
                out / scene.name,
                BatchPlan(fmt="gpkg"),
                options=options,
                engine=Engine(workers, client=client),
            )
            seconds = time.perf_counter() - start
            done = [s["report"] for s in report.scenes if s.get("status") == "scored"]
            if len(done) != len(jobs):
                raise SceneError(f"{len(jobs) - len(done)} district(s) of {scene.name} failed")
            rss = client.run(peak_rss_mb)
            rows.append(
                {
                    "buildings": sum(r["buildings"] for r in done),
                    "scored": sum(r["scored"] for r in done),
                    "seconds": seconds,
                    "peak_rss_mb": max(rss.values()),
                    "worker_rss_mb": sorted(rss.values()),
                }
            )
    return rows


def bench_city(
    model: str | os.PathLike,
    root: str | os.PathLike,
    city: int = CITY,
    small: int = SMALL,
    workers: int = 2,
    spacing: int = 100,
) -> dict[str, Any]:
    """Make the two scenes under ``root`` (kept there: made once), score them on one worker and
    on ``workers`` workers; the figures."""
    root = Path(root)
    start = time.perf_counter()
    scenes = [make_city(root / "small", small, spacing), make_city(root / "city", city, spacing)]
    warm = make_city(root / "warm", (WARM_SIZE // spacing) ** 2, spacing)
    made = time.perf_counter() - start
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-city-") as tmp:
        one = [score_alone(str(model), s, warm, tmp) for s in scenes]
        runs.append({"workers": 1, "where": "a fresh process each", "scenes": one})
        if workers > 1:
            many = score_workers(str(model), scenes, warm, Path(tmp), workers)
            runs.append({"workers": workers, "where": "embedded Dask cluster", "scenes": many})
    for run in runs:
        for row, name in zip(run["scenes"], ("small", "city"), strict=True):
            row["scene"] = name
            row["ms_per_building"] = 1000 * row["seconds"] / max(row["buildings"], 1)
        s, c = run["scenes"]
        run["ratio"] = c["ms_per_building"] / s["ms_per_building"]
        run["ratio_goal_met"] = bool(run["ratio"] <= 1 + RATIO_GOAL)
        run["rss_goal_met"] = bool(max(r["peak_rss_mb"] for r in run["scenes"]) < RSS_GOAL_MB)
    return {
        "model": str(model),
        "spacing_px": spacing,
        "cpu_count": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2),
        "make_seconds": round(made, 1),
        "runs": runs,
    }


def format_city(figures: dict[str, Any]) -> str:
    """The figures as a table."""
    lines = [
        f"city benchmark: model {figures['model']}, one building per {figures['spacing_px']} px "
        f"cell; {figures['cpu_count']} CPU cores, load average {figures['load_average']}",
        f"  {'workers':>7}  {'scene':<6}  {'bldg':>6}  {'seconds':>8}  {'ms/bldg':>8}  "
        f"{'peak RSS MiB':>12}",
    ]
    for run in figures["runs"]:
        for r in run["scenes"]:
            lines.append(
                f"  {run['workers']:>7}  {r['scene']:<6}  {r['buildings']:>6}  "
                f"{r['seconds']:>8.1f}  {r['ms_per_building']:>8.2f}  {r['peak_rss_mb']:>12.0f}"
            )
        lines.append(
            f"  {run['workers']:>7}  city/small ms per building {run['ratio']:.3f} "
            f"(goal <= {1 + RATIO_GOAL:.2f}: {'met' if run['ratio_goal_met'] else 'not met'}); "
            f"peak RSS goal < {RSS_GOAL_MB} MiB: {'met' if run['rss_goal_met'] else 'not met'} "
            f"({run['where']})"
        )
    lines.append(
        "  peak RSS: the scoring process's ru_maxrss (1 worker), the largest worker's (Dask); "
        f"the scenes took {figures['make_seconds']:.0f} s to make"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if min(args.buildings, args.small, args.workers, args.spacing) < 1:
        raise UsageError("--buildings, --small, --workers and --spacing must be positive")
    try:
        model = args.model or default_model()
        with tempfile.TemporaryDirectory(prefix="bench-city-scenes-") as tmp:
            root = Path(args.dir) if args.dir else Path(tmp)
            figures = bench_city(
                model, root, args.buildings, args.small, args.workers, args.spacing
            )
    except (ModelError, SceneError, EngineError, ValueError, OSError) as exc:
        raise UsageError(str(exc)) from exc
    print(json.dumps(figures, indent=2) if args.json else format_city(figures))
    return 0
