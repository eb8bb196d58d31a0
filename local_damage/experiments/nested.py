"""Recipe choice on inner folds: nested cross-validation for `local-damage cv --inner K`.

For an outer test fold, the training tiles (every other outer fold) are dealt into ``K`` inner
folds (:func:`data_prep.split.inner_folds`, every event round the folds), or, by event, the
``K`` training events with the most labelled buildings are held out in turn
(:func:`data_prep.split.inner_event_folds`: a choice on disasters the inner models never saw). Each candidate recipe
is trained on ``K - 1`` inner folds and evaluated on the last, ``K`` times, and the recipe with
the highest mean inner macro-F1 (ties: the first given) is the one trained on all the training
tiles and scored on the outer test fold. The test fold is never seen by the choice.

With a false-alarm ceiling (``cv --max-false-alarm F``) only the recipes whose mean inner share
of intact buildings called damaged is at most ``F`` compete on macro-F1; when none is, the one
with the fewest false alarms is chosen. A responder reads a map on which one intact house in four
is flagged as useless, whatever its macro-F1, so the ceiling makes that part of the choice.

A candidate is a recipe and a grade rule. With several false-alarm costs (``cv --costs``) every
recipe is tried under each (``<recipe>@cost<C>``): the weights do not depend on the cost, so
each inner model is trained once and its probabilities graded again (:mod:`runtime.grading`);
the chosen cost becomes the outer run's ``grade.false_alarm_cost``, so its figures, and the model
``export`` writes from it, carry that rule.

Runs live in ``OUT/inner/outer<F>/<recipe>/fold<J>`` (``OUT/inner-event/...`` by event) and are
reused when finished; ``selection.json`` beside them records every candidate's inner scores and the choice.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from data_prep.spec import CLASS_NAMES
from data_prep.split import inner_event_folds, inner_folds, load_splits
from data_prep.store import read_manifest, write_json
from local_damage.evaluation.torch_scorer import TorchScorer
from local_damage.train.config import GradeConfig
from local_damage.train.loaders import ChipSplit
from local_damage.train.loop import SUMMARY, train
from runtime.evaluation.evaluate import (
    METRICS_JSON,
    PREDICTIONS_CSV,
    EvaluationOptions,
    evaluate,
)
from runtime.grading import grades
from runtime.metrics import classification_metrics

log = logging.getLogger(__name__)

SELECTION_JSON = "selection.json"
#: How inner folds are made (:class:`InnerChoice`).
INNER_BY = ("area", "event")
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


def inner_root(out: str | Path, by: str = "area") -> Path:
    """Where the inner runs of a cross-validation in ``out`` live: ``OUT/inner`` for inner folds
    by area, ``OUT/inner-event`` by event (they train other models)."""
    return Path(out) / ("inner" if by == "area" else f"inner-{by}")


def graded_metrics(
    run: Path, class_names: Sequence[str], costs: Sequence[float]
) -> dict[float, dict[str, Any]]:
    """Cost -> macro-F1 and confusion matrix of an inner run's predictions (``predictions.csv``,
    read once) graded under each false-alarm cost (:func:`runtime.grading.grades`)."""
    frame = pd.read_csv(run / PREDICTIONS_CSV)
    p = frame[[f"p_{c}" for c in class_names]].to_numpy(dtype=np.float64)
    y = frame["label"].to_numpy(dtype=np.int64)
    return {c: classification_metrics(y, grades(p, class_names, c), class_names) for c in costs}


def candidate_name(recipe: str, cost: float, costs: Sequence[float] | None) -> str:
    """A candidate's name: the recipe's, with ``@cost<C>`` when several costs are tried."""
    return recipe if costs is None else f"{recipe}@cost{cost:g}"


def with_cost(cfg, cost: float):
    """``cfg`` with the grade rule of false-alarm cost ``cost``."""
    return dataclasses.replace(cfg, grade=GradeConfig(false_alarm_cost=cost))


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


@dataclass(frozen=True)
class InnerChoice:
    """How a recipe is chosen on inner folds (``cv --inner K``'s options).

    Attributes:
        inner: ``K``, the number of inner folds (at least 2).
        seed: seed of the inner folds' dealing.
        progress: show training progress.
        max_false_alarm: None, or the ceiling on the mean inner share of intact buildings
            called damaged (:func:`pick`).
        costs: None (each recipe graded with its own ``grade.false_alarm_cost``), or the
            false-alarm costs every recipe is tried under (``<name>@cost<C>``).
        by: ``"area"``: the inner folds deal the outer split's units (tiles, or spatial
            blocks: :func:`data_prep.split.inner_folds`); ``"event"``: inner fold ``j`` holds out
            the ``j``-th training event by labelled buildings
            (:func:`data_prep.split.inner_event_folds`), so the choice is made on disasters the
            inner models never saw.
    """

    inner: int = 2
    seed: int = 0
    progress: bool = True
    max_false_alarm: float | None = None
    costs: Sequence[float] | None = None
    by: str = "area"

    def __post_init__(self) -> None:
        if self.by not in INNER_BY:
            raise ValueError(f"inner folds by {self.by!r}: expected one of {', '.join(INNER_BY)}")


def choose_recipe(
    candidates: Sequence[tuple[str, Any]],
    chips: str | Path,
    out: str | Path,
    outer_fold: int,
    choice: InnerChoice | None = None,
) -> tuple[str, Any, dict[str, Any]]:
    """Choose among ``candidates`` (``(name, config)`` pairs) on inner folds of ``outer_fold``,
    as ``choice`` says (:class:`InnerChoice`).

    Returns:
        ``(chosen name, its config, selection)``: the config carries the chosen grade rule;
        ``selection`` (also written to ``out/inner/outer<F>/selection.json``) holds the inner
        folds' tiles, every candidate's recipe, cost, per-inner-fold and mean macro-F1 and
        intact buildings called damaged, the rule and the choice.
    """
    choice = choice or InnerChoice()
    inner, seed, progress = choice.inner, choice.seed, choice.progress
    max_false_alarm, costs = choice.max_false_alarm, choice.costs
    chips = Path(chips)
    where = inner_root(out, choice.by) / f"outer{outer_fold}"
    manifest = read_manifest(chips)
    if choice.by == "event":
        folds = inner_event_folds(load_splits(chips), manifest, outer_fold, inner)
    else:
        folds = inner_folds(load_splits(chips), manifest, outer_fold, inner, seed=seed)
    labelled = set(manifest.loc[manifest["label"] >= 0, "chip_id"])
    scores: dict[str, dict[str, Any]] = {}
    configs: dict[str, Any] = {}
    for name, cfg in candidates:
        names = list(CLASS_NAMES[: cfg.model.num_classes])
        tried = [float(cfg.grade.false_alarm_cost)] if costs is None else list(costs)
        per_fold = {c: {} for c in tried}
        alarms = {c: {} for c in tried}
        for j in range(inner):
            in_fold = folds["fold"] == j
            train_ids = folds.loc[~in_fold, "chip_id"].tolist()
            test_ids = [c for c in folds.loc[in_fold, "chip_id"] if c in labelled]
            run = where / name / f"fold{j}"
            log.info(f"[outer {outer_fold}, {name}, inner fold {j}] {run}")
            inner_run(cfg, chips, run, train_ids, test_ids, progress)
            for cost, metrics in graded_metrics(run, names, tried).items():
                per_fold[cost][str(j)] = metrics[SELECT_ON]
                alarms[cost][str(j)] = intact_called_damaged(metrics)
        for cost in tried:
            key = candidate_name(name, cost, costs)
            known = [a for a in alarms[cost].values() if a is not None]
            configs[key] = with_cost(cfg, cost)
            scores[key] = {
                "recipe": name,
                "false_alarm_cost": cost,
                "folds": per_fold[cost],
                "mean": float(np.mean(list(per_fold[cost].values()))),
                "false_alarm_folds": alarms[cost],
                "false_alarm": float(np.mean(known)) if known else None,
            }
    chosen, rule = pick(scores, max_false_alarm)
    selection = {
        "outer_fold": outer_fold,
        "inner_folds": inner,
        "inner_by": choice.by,
        "seed": seed,
        "select_on": SELECT_ON,
        "max_false_alarm": max_false_alarm,
        "costs": None if costs is None else [float(c) for c in costs],
        "rule": rule,
        "tiles": {
            str(j): sorted(folds.loc[folds["fold"] == j, "tile"].unique()) for j in range(inner)
        },
        "events": {
            str(j): sorted(folds.loc[folds["fold"] == j, "event"].unique()) for j in range(inner)
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
    return chosen, configs[chosen], selection
