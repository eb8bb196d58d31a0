"""Recipe choice on inner folds: nested cross-validation for `local-damage cv --inner K`.

For an outer test fold, the training tiles (every other outer fold) are dealt into ``K`` inner
folds (:func:`data_prep.split.inner_folds`, every event round the folds). Each candidate recipe
is trained on ``K - 1`` inner folds and evaluated on the last, ``K`` times, and the recipe with
the highest mean inner macro-F1 (ties: the first given) is the one trained on all the training
tiles and scored on the outer test fold. The test fold is never seen by the choice.

With a false-alarm ceiling (``cv --max-false-alarm F``) only the recipes whose mean inner share
of intact buildings called damaged is at most ``F`` compete on macro-F1; when none is, the one
with the fewest false alarms is chosen. A responder reads a map on which one intact house in four
is flagged as useless, whatever its macro-F1, so the ceiling makes that part of the choice.

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
#: Index of the intact grade in the confusion matrix (rows: true grade).
INTACT = 0


def intact_called_damaged(metrics: dict[str, Any]) -> float | None:
    """Share of the intact buildings graded damaged, from an evaluation's confusion matrix
    (None when no intact building was evaluated)."""
    row = np.asarray(metrics["confusion_matrix"], dtype=float)[INTACT]
    total = row.sum()
    return None if total == 0 else float(1.0 - row[INTACT] / total)


def pick(
    scores: dict[str, dict[str, Any]], max_false_alarm: float | None = None
) -> tuple[str, str]:
    """The chosen candidate of ``scores`` (name -> ``mean`` macro-F1 and ``false_alarm`` mean, in
    the order given) and the rule that chose it."""
    order = list(scores)

    def best_f1(names):
        return max(names, key=lambda n: (scores[n]["mean"], -order.index(n)))

    if max_false_alarm is None:
        return best_f1(order), "highest mean inner macro-F1"
    under = [n for n in order if (scores[n]["false_alarm"] or 0.0) <= max_false_alarm]
    if under:
        return best_f1(under), (
            f"highest mean inner macro-F1 among the candidates calling at most "
            f"{max_false_alarm:.0%} of intact buildings damaged"
        )
    fewest = min(order, key=lambda n: (scores[n]["false_alarm"] or 0.0, order.index(n)))
    return fewest, (
        f"no candidate called at most {max_false_alarm:.0%} of intact buildings damaged: "
        "the one calling the fewest"
    )


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
    max_false_alarm: float | None = None,
) -> tuple[str, dict[str, Any]]:
    """Choose among ``candidates`` (``(name, config)`` pairs) on inner folds of ``outer_fold``.

    Args:
        max_false_alarm: None, or the ceiling on the mean inner share of intact buildings
            called damaged (:func:`pick`).

    Returns:
        ``(chosen name, selection)``; ``selection`` (also written to
        ``out/inner/outer<F>/selection.json``) holds the inner folds' tiles, every candidate's
        per-inner-fold and mean macro-F1 and intact buildings called damaged, the rule and the
        choice.
    """
    chips = Path(chips)
    where = Path(out) / "inner" / f"outer{outer_fold}"
    manifest = read_manifest(chips)
    folds = inner_folds(load_splits(chips), manifest, outer_fold, inner, seed=seed)
    labelled = set(manifest.loc[manifest["label"] >= 0, "chip_id"])
    scores: dict[str, dict[str, Any]] = {}
    for name, cfg in candidates:
        per_fold, alarms = {}, {}
        for j in range(inner):
            in_fold = folds["fold"] == j
            train_ids = folds.loc[~in_fold, "chip_id"].tolist()
            test_ids = [c for c in folds.loc[in_fold, "chip_id"] if c in labelled]
            run = where / name / f"fold{j}"
            log.info(f"[outer {outer_fold}, {name}, inner fold {j}] {run}")
            metrics = inner_run(cfg, chips, run, train_ids, test_ids, progress)
            per_fold[str(j)] = metrics[SELECT_ON]
            alarms[str(j)] = intact_called_damaged(metrics)
        known = [a for a in alarms.values() if a is not None]
        scores[name] = {
            "folds": per_fold,
            "mean": float(np.mean(list(per_fold.values()))),
            "false_alarm_folds": alarms,
            "false_alarm": float(np.mean(known)) if known else None,
        }
    chosen, rule = pick(scores, max_false_alarm)
    selection = {
        "outer_fold": outer_fold,
        "inner_folds": inner,
        "seed": seed,
        "select_on": SELECT_ON,
        "max_false_alarm": max_false_alarm,
        "rule": rule,
        "tiles": {
            str(j): sorted(folds.loc[folds["fold"] == j, "tile"].unique()) for j in range(inner)
        },
        "candidates": scores,
        "chosen": chosen,
    }
    write_json(where / SELECTION_JSON, selection)
    log.info(
        f"[outer {outer_fold}] chose {chosen} on {inner} inner folds ("
        + ", ".join(
            f"{n} macro-F1 {s['mean']:.4f}"
            + (
                f", intact called damaged {s['false_alarm']:.1%}"
                if s["false_alarm"] is not None
                else ""
            )
            for n, s in scores.items()
        )
        + f"; {rule})"
    )
    return chosen, selection
