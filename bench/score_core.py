"""Scoring on one core against its network alone, stage by stage: the part of `local-damage bench
score` that says how close scoring comes to the speed of its model.

Everything runs in this process with ONNX Runtime and OpenCV on one thread. For each input (the
benchmark's batch of scenes, and one large synthetic scene of
:func:`data_prep.synthetic_scene.make_large_scene`) the scenes are scored as `score-batch
--workers 1` does, with the stage profile on (:attr:`app.scoring.common.ScoreOptions.profile`),
and the same model's network is timed alone in the same run: the ONNX Runtime session on full
batches of uint8 chip pairs at the model's input size. The ratio of the two rates is the share
of its network's speed that scoring keeps (1.0: scoring costs nothing beyond the network).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from app.scoring.batch import SceneJob, score_batch
from app.scoring.common import STAGES, ScoreOptions
from data_prep.engine import Engine
from data_prep.synthetic_scene import make_large_scene
from data_prep.timing import StageTimes
from runtime.predictor import Predictor

#: Least chip pairs the network alone is timed on.
MIN_PAIRS = 256
#: The goal: scoring's buildings/s over its network's pairs/s.
GOAL = 0.5


@contextmanager
def one_opencv_thread():
    """OpenCV on one thread inside the block (restored after)."""
    import cv2

    before = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        yield
    finally:
        cv2.setNumThreads(before)


def network_rate(
    predictor: Predictor, pairs: int, batch_size: int = 32, repeat: int = 2, seed: int = 0
) -> float:
    """Pairs per second of the model alone: ``pairs`` (at least :data:`MIN_PAIRS`) random uint8
    chip pairs at the model's input size, in full batches of ``batch_size``; best of
    ``repeat`` passes after one warm-up batch."""
    rng = np.random.default_rng(seed)
    size = predictor.input_size
    n = max(int(pairs), MIN_PAIRS)
    n = -(-n // batch_size) * batch_size
    pre = rng.integers(0, 256, (batch_size, size, size, 3), dtype=np.uint8)
    post = rng.integers(0, 256, (batch_size, size, size, 3), dtype=np.uint8)
    predictor.predict(pre, post, batch_size=batch_size)
    best = float("inf")
    for _ in range(max(int(repeat), 1)):
        start = time.perf_counter()
        for _ in range(n // batch_size):
            predictor.predict(pre, post, batch_size=batch_size)
        best = min(best, time.perf_counter() - start)
    return n / best


def large_scene(root: str | os.PathLike, size: int) -> SceneJob:
    """A :func:`data_prep.synthetic_scene.make_large_scene` of ``size`` px, as a batch scene."""
    root = Path(root)
    make_large_scene(root, size)
    return SceneJob(
        name=f"large{size}",
        pre=(str(root / "pre" / "pre.tif"),),
        post=(str(root / "post" / "post.tif"),),
        buildings=str(root / "buildings.geojson"),
    )


def score_rate(predictor: Predictor, scenes: Sequence[SceneJob], repeat: int = 1) -> dict[str, Any]:
    """Score ``scenes`` in this process (as `score-batch --workers 1`) ``repeat`` times; the
    fastest run's buildings, seconds and stage seconds (summed over its scenes)."""
    best: dict[str, Any] = {}
    options = ScoreOptions(progress=False, profile=True)
    for r in range(max(int(repeat), 1)):
        with tempfile.TemporaryDirectory(prefix="bench-score-core-") as tmp:
            start = time.perf_counter()
            report = score_batch(
                predictor, scenes, Path(tmp) / f"run{r}", options=options, engine=Engine(1)
            )
            seconds = time.perf_counter() - start
        done = [s["report"] for s in report.scenes if s.get("status") == "scored"]
        if best and seconds >= best["seconds"]:
            continue
        stages = StageTimes()
        for rep in done:
            stages.merge(rep.get("stages", {}))
        best = {
            "scenes": len(done),
            "failed": len(scenes) - len(done),
            "buildings": sum(rep["buildings"] for rep in done),
            "scored": sum(rep["scored"] for rep in done),
            "seconds": seconds,
            "scene_seconds": sum(rep["seconds"] for rep in done),
            "stages": stages.as_dict(),
        }
    return best


def bench_one_core(
    model: str | os.PathLike,
    inputs: Sequence[tuple[str, Sequence[SceneJob]]],
    repeat: int = 1,
    batch_size: int = 32,
) -> dict[str, Any]:
    """Score each input on one core and time the network alone in the same run.

    Args:
        model: the ONNX damage model.
        inputs: ``(name, scenes)`` pairs; each is scored as one batch.
        repeat: timed runs of each input (the fastest counts) and passes of the network.
        batch_size: chips per inference batch, for scoring and the network alike.

    Returns:
        ``{"threads": 1, "network_pairs_per_s", "rows": [{"input", "scenes", "buildings",
        "scored", "seconds", "buildings_per_s", "ratio", "goal_met", "stages"}]}``.
    """
    predictor = Predictor(model, threads=1)
    rows = []
    with one_opencv_thread():
        first = inputs[0][1][:1]
        score_rate(predictor, first)  # warm-up: imports, the session's first runs
        for name, scenes in inputs:
            got = score_rate(predictor, scenes, repeat)
            got["input"] = name
            rows.append(got)
        pairs = max(r["buildings"] for r in rows)
        network = network_rate(predictor, pairs, batch_size, repeat)
    for r in rows:
        r["buildings_per_s"] = r["buildings"] / r["seconds"] if r["seconds"] > 0 else 0.0
        r["ratio"] = r["buildings_per_s"] / network
        r["goal_met"] = bool(round(r["ratio"], 3) >= GOAL)  # judged on the ratio reported
    return {
        "threads": 1,
        "batch_size": batch_size,
        "network_pairs_per_s": round(network, 1),
        "rows": [_rounded(r) for r in rows],
    }


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    for key in ("seconds", "scene_seconds"):
        out[key] = round(out[key], 3)
    out["buildings_per_s"] = round(out["buildings_per_s"], 1)
    out["ratio"] = round(out["ratio"], 3)
    return out


def format_one_core(figures: dict[str, Any]) -> str:
    """The one-core figures as two tables: rates and ratios, then ms per building by stage."""
    rows = figures["rows"]
    net = figures["network_pairs_per_s"]
    lines = [
        f"one core (this process; ONNX Runtime and OpenCV on 1 thread; batch "
        f"{figures['batch_size']}): the network alone {net:.1f} pairs/s",
        f"  {'input':<28}  {'scenes':>6}  {'bldg':>6}  {'seconds':>8}  {'bldg/s':>7}  "
        f"{'ratio':>5}  goal >= {GOAL}",
    ]
    for r in rows:
        lines.append(
            f"  {r['input']:<28}  {r['scenes']:>6}  {r['buildings']:>6}  {r['seconds']:>8.2f}  "
            f"{r['buildings_per_s']:>7.1f}  {r['ratio']:>5.2f}  {'met' if r['goal_met'] else 'not met'}"
        )
    lines.append("  ratio: scoring's buildings/s over the network's pairs/s, both in this run")
    names = [n for n in STAGES if any(n in r["stages"] for r in rows)]
    names += sorted({n for r in rows for n in r["stages"]} - set(names))
    lines.append("stages, ms per building (sum over the scenes of each input):")
    lines.append(f"  {'stage':<8}" + "".join(f"  {r['input'][:22]:>22}" for r in rows))
    for n in [*names, "other", "total"]:
        cells = []
        for r in rows:
            per = max(r["buildings"], 1)
            if n == "total":
                s = r["scene_seconds"]
            elif n == "other":
                s = max(r["scene_seconds"] - sum(r["stages"].values()), 0.0)
            else:
                s = r["stages"].get(n, 0.0)
            cells.append(f"  {1000 * s / per:>22.3f}")
        lines.append(f"  {n:<8}" + "".join(cells))
    lines.append(
        f"  network alone: {1000 / net:.3f} ms per pair; total: the scenes' own wall time "
        "(the batch's bookkeeping between scenes is left out)"
    )
    return "\n".join(lines)
