"""`local-damage bench score`: `score-batch` throughput for 1 and 2 workers on the same scenes.

For each worker count the same batch is scored by :func:`app.scoring.batch.score_batch` into a temporary
folder, as `score-batch --workers N` does: one worker scores in this process, more run on an
embedded Dask cluster of that many single-threaded processes (:mod:`data_prep.engine`). The
cluster is started, and the model loaded in every worker, before anything is timed (a warm-up
batch), so the figures are the steady rate of a long batch; the cluster's start-up is reported
on its own. Scenes per second and buildings per second are printed with their ratio to the
1-worker run of the same invocation.

Default inputs: a synthetic batch (copies of the seeded synthetic scene,
:func:`data_prep.synthetic_scene.make_scene`), so the benchmark needs no data; ``--scenes``
takes a CSV or folder of real scenes as `score-batch` does.

Then, on one core (:mod:`bench.score_core`): the batch, and one large synthetic scene
(``--large`` px a side, :func:`data_prep.synthetic_scene.make_large_scene`), scored in this
process with ONNX Runtime and OpenCV on one thread, against the model's network alone in the same
run, with the time of every stage of scoring per building.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.scoring.batch import BatchPlan, read_scene_list, score_batch
from app.scoring.common import ScoreOptions
from bench.score_core import bench_one_core, format_one_core, large_scene
from data_prep.engine import Engine, EngineError, open_client
from data_prep.errors import UsageError
from data_prep.mosaic import SceneError
from data_prep.synthetic_scene import make_scene
from data_prep.text_table import Column, text_table
from runtime.contract import ModelError
from runtime.predictor import Predictor
from runtime.registry import default_model

#: Default side in pixels of the large synthetic scene scored on one core (64 x 64 buildings).
LARGE = 6400


def synthetic_batch(root: str | os.PathLike, scenes: int, seed: int = 0) -> Path:
    """A folder of ``scenes`` scene folders (``s000``, ...) sharing one seeded synthetic scene's
    files through symbolic links; returns the folder (a `score-batch --scenes` input)."""

    root = Path(root)
    scene = make_scene(root / "source", seed=seed)
    folder = root / "scenes"
    for i in range(int(scenes)):
        one = folder / f"s{i:03d}"
        for sub, paths in (("pre", scene.pre), ("post", scene.post)):
            (one / sub).mkdir(parents=True)
            for p in paths:
                (one / sub / p.name).symlink_to(Path(p).absolute())
        (one / "footprints.geojson").symlink_to(Path(scene.buildings).absolute())
    return folder


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def bench_score(
    model: str | os.PathLike,
    scenes: Sequence,
    workers: Sequence[int] = (1, 2),
    repeat: int = 1,
    raster: bool = False,
) -> dict[str, Any]:
    """Score the same scenes with each worker count; the figures as a dict.

    Args:
        model: the ONNX damage model.
        scenes: :class:`app.scoring.batch.SceneJob` entries (from :func:`app.scoring.batch.read_scene_list`).
        workers: worker counts to run; the first is the baseline of the ratios.
        repeat: timed batches per worker count; the fastest counts.
        raster: also write each scene's class raster, as `score-batch --raster`.

    Returns:
        ``{"model", "scenes", "buildings", "cpu_count", "load_average", "baseline_workers",
        "rows": [{"workers", "where", "startup_s", "seconds", "scenes_per_s",
        "buildings_per_s", "scenes_ratio", "buildings_ratio", "failed"}]}``.
    """

    scenes = list(scenes)
    if not scenes:
        raise ValueError("no scenes to score")
    predictor = Predictor(model)
    rows: list[dict[str, Any]] = []
    buildings = 0
    for w in workers:
        w = max(int(w), 1)
        start = time.perf_counter()
        with open_client(w) as client, tempfile.TemporaryDirectory(prefix="bench-score-") as tmp:
            run_args = dict(
                plan=BatchPlan(raster=raster),
                options=ScoreOptions(progress=False),
                engine=Engine(w, client=client),
            )
            # warm-up: start the workers and load the model in each before timing
            warm = scenes[: max(2 * w, 1)]
            score_batch(predictor, warm, Path(tmp) / "warm", **run_args)
            startup = time.perf_counter() - start
            best = float("inf")
            for r in range(max(int(repeat), 1)):
                t0 = time.perf_counter()
                report = score_batch(predictor, scenes, Path(tmp) / f"run{r}", **run_args)
                best = min(best, time.perf_counter() - t0)
        scored = [s for s in report.scenes if s.get("status") == "scored"]
        buildings = sum(s["report"]["buildings"] for s in scored)
        rows.append(
            {
                "workers": w,
                "where": "in this process" if client is None else "embedded Dask cluster",
                "startup_s": round(startup, 3),
                "seconds": round(best, 3),
                "scenes_per_s": round(len(scored) / best, 3),
                "buildings_per_s": round(buildings / best, 1),
                "failed": len(scenes) - len(scored),
            }
        )
    base = rows[0]
    for row in rows:
        row["scenes_ratio"] = round(row["scenes_per_s"] / base["scenes_per_s"], 3)
        row["buildings_ratio"] = round(row["buildings_per_s"] / base["buildings_per_s"], 3)
    return {
        "model": str(model),
        "scenes": len(scenes),
        "buildings": buildings,
        "cpu_count": os.cpu_count(),
        "load_average": _load_average(),
        "baseline_workers": base["workers"],
        "rows": rows,
    }


#: The table's columns, over the rows of :func:`bench_score`.
_COLUMNS = [
    Column("workers", "workers", width=7),
    Column("where", "where", align="<", width=21),
    Column("start s", "startup_s", ".2f", width=7),
    Column("batch s", "seconds", ".2f", width=8),
    Column("scenes/s", "scenes_per_s", ".2f", width=8),
    Column("bldg/s", "buildings_per_s", ".1f", width=8),
    Column("ratio", "buildings_ratio", ".2f", width=5),
]


def format_table(figures: dict[str, Any]) -> str:
    """The figures as a table, ratios against the baseline worker count."""
    lines = [
        f"score-batch: {figures['scenes']} scenes, {figures['buildings']} buildings, "
        f"model {figures['model']}",
        f"machine: {figures['cpu_count']} CPU cores, load average {figures['load_average']}",
        *text_table(_COLUMNS, figures["rows"], "  "),
    ]
    lines.append(
        f"ratio: buildings/s against {figures['baseline_workers']} worker(s) in the same run; "
        "start s: cluster start-up and model loads (not in batch s)"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        model = args.model if args.model is not None else default_model()
        with tempfile.TemporaryDirectory(prefix="bench-score-scenes-") as tmp:
            source = args.scenes or synthetic_batch(tmp, args.count)
            scenes, problems = read_scene_list(source)
            for p in problems:
                print(f"skipped {p.item}: {p.reason}", file=sys.stderr)
            figures = bench_score(model, scenes, args.workers, args.repeat, args.raster)
            if not args.no_one_core:
                name = "scenes given" if args.scenes else f"synthetic batch ({len(scenes)})"
                inputs = [(name, scenes)]
                if args.large > 0:
                    big = large_scene(Path(tmp) / "large", args.large)
                    inputs.append((f"synthetic scene {args.large} px", [big]))
                figures["one_core"] = bench_one_core(model, inputs, args.repeat)
    except (ModelError, SceneError, EngineError, ValueError, OSError) as exc:
        raise UsageError(str(exc)) from exc
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print(format_table(figures))
        if "one_core" in figures:
            print(format_one_core(figures["one_core"]))
    return 0
