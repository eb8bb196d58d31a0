"""Recipe choice on inner folds: nested cross-validation for `local-damage cv --inner K`.

For an outer test fold, the training tiles (every other outer fold) are dealt into ``K`` inner
folds (:func:`data_prep.split.inner_folds`, every event round the folds). Each candidate recipe
is trained on ``K - 1`` inner folds and evaluated on the last, ``K`` times, and the recipe with
the highest mean inner macro-F1 (ties: the first given) is the one trained on all the training
tiles and scored on the outer test fold. The test fold is never seen by the choice.

Runs live in ``OUT/inner/outer<F>/<recipe>/fold<J>`` and are reused when finished;
``OUT/inner/outer<F>/selection.json`` records every candidate's inner scores and the choice.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.split import inner_folds, load_splits
from data_prep.store import read_manifest, write_json
from local_damage.evaluation.torch_scorer import TorchScorer
from local_damage.train.loaders import ChipSplit
from local_damage.train.loop import SUMMARY, train
from runtime.evaluation.evaluate import METRICS_JSON, EvaluationOptions, evaluate

log = logging.getLogger(__name__)

SELECTION_JSON = "selection.json"
#: What the inner folds choose on.
SELECT_ON = "macro_f1"


def inner_run(
    cfg,
    chips: str | Path,
    run: Path,
    train_ids: list[str],
    test_ids: list[str],
    progress: bool = True,
) -> dict[str, Any]:
    """Train ``cfg`` on ``train_ids`` without validation and evaluate on ``test_ids``; a run
    folder with summary.json and metrics.json is reused."""
    if (run / SUMMARY).is_file() and (run / METRICS_JSON).is_file():
        return json.loads((run / METRICS_JSON).read_text())
    if not (run / SUMMARY).is_file():
        train(cfg, chips, run, ChipSplit(ids=(train_ids, [])), progress=progress)
    options = EvaluationOptions(
        views=1, tsne=False, batch_size=cfg.train.eval_batch_size, seed=cfg.train.seed
    )
    return evaluate(TorchScorer(run), chips, test_ids, run, options)


def choose_recipe(
    candidates: Sequence[tuple[str, Any]],
    chips: str | Path,
    out: str | Path,
    outer_fold: int,
    inner: int,
    seed: int = 0,
    progress: bool = True,
) -> tuple[str, dict[str, Any]]:
    """Choose among ``candidates`` (``(name, config)`` pairs) on inner folds of ``outer_fold``.

    Returns:
        ``(chosen name, selection)``; ``selection`` (also written to
        ``out/inner/outer<F>/selection.json``) holds the inner folds' tiles, every candidate's
        per-inner-fold and mean macro-F1, and the choice.
    """
    chips = Path(chips)
    where = Path(out) / "inner" / f"outer{outer_fold}"
    manifest = read_manifest(chips)
    folds = inner_folds(load_splits(chips), manifest, outer_fold, inner, seed=seed)
    labelled = set(manifest.loc[manifest["label"] >= 0, "chip_id"])
    scores: dict[str, dict[str, Any]] = {}
    for name, cfg in candidates:
        per_fold = {}
        for j in range(inner):
            in_fold = folds["fold"] == j
            train_ids = folds.loc[~in_fold, "chip_id"].tolist()
            test_ids = [c for c in folds.loc[in_fold, "chip_id"] if c in labelled]
            run = where / name / f"fold{j}"
            log.info(f"[outer {outer_fold}, {name}, inner fold {j}] {run}")
            metrics = inner_run(cfg, chips, run, train_ids, test_ids, progress)
            per_fold[str(j)] = metrics[SELECT_ON]
        scores[name] = {"folds": per_fold, "mean": float(np.mean(list(per_fold.values())))}
    chosen = max(scores, key=lambda n: (scores[n]["mean"], -list(scores).index(n)))
    selection = {
        "outer_fold": outer_fold,
        "inner_folds": inner,
        "seed": seed,
        "select_on": SELECT_ON,
        "tiles": {
            str(j): sorted(folds.loc[folds["fold"] == j, "tile"].unique()) for j in range(inner)
        },
        "candidates": scores,
        "chosen": chosen,
    }
    write_json(where / SELECTION_JSON, selection)
    log.info(
        f"[outer {outer_fold}] chose {chosen} on {inner} inner folds ("
        + ", ".join(f"{n} {s['mean']:.4f}" for n, s in scores.items())
        + ")"
    )
    return chosen, selection
