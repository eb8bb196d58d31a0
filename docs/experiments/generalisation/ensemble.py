"""Two recipes' networks averaged, on events they never saw: grades and calibration
(generalisation.md, "Two networks instead of one"; their disagreement: ``disagreement.py``).

Reads only predictions the cross-validations wrote (``predictions.csv`` of each fold), no model:

- ``held-out``: the general recipe (20 epochs), the 40-epoch recipe, and the mean of their
  probabilities, on each event both were held out from (leave one event out).
- ``choice``: the choice on inner folds that hold out whole events (``cv --inner-by event``),
  with the means of two recipes (and of more) added to the single recipes as candidates, at the
  false-alarm costs of that choice and the same ceiling (at most 10% of intact buildings called
  damaged, the mean over the inner events); then what the chosen candidate does on the outer
  event.

    python docs/experiments/generalisation/ensemble.py [RUNS]

RUNS: ``docs/experiments/generalisation/runs`` by default.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from data_prep.spec import CLASS_NAMES as CLASSES
from local_damage.experiments.nested import pick
from runtime.grading import grades
from runtime.metrics import classification_metrics, present_class_f1
from runtime.metrics.calibration import expected_calibration_error

P = [f"p_{c}" for c in CLASSES]
COSTS = (1.0, 2.0, 3.0, 5.0)
MAX_FALSE_ALARM = 0.10
#: Leave-one-event-out folds (``split --by event``) of both recipes, and their events.
HELD_OUT = {1: "Florence", 2: "Michael", 4: "Santa Rosa"}
#: The inner choices: outer event, its inner folds' recipes, and each recipe's outer run.
CHOICES = {
    "Michael": (
        "inner-event-michael",
        {
            "general-64": "loeo-general-cpu/fold2",
            "general-long-64": "loeo-general-long-cpu/fold2",
            "general-128": "loeo-general-128/fold2",
            "general-long-128": "loeo-general-long-128/fold2",
        },
    ),
    "Santa Rosa": (
        "inner-event-santarosa",
        {"general": "loeo-general-cpu/fold4", "general-long": "loeo-general-long-cpu/fold4"},
    ),
}
#: Block folds where both recipes ran: new areas of the events they trained on.
BLOCK_FOLDS = (0, 1, 2, 3, 4)


def load(path: Path) -> pd.DataFrame:
    return pd.read_csv(path / "predictions.csv").set_index("chip_id").sort_index()


def mean_of(frames: list[pd.DataFrame]) -> np.ndarray:
    for f in frames[1:]:
        if not f.index.equals(frames[0].index):
            raise ValueError("the runs graded different buildings")
    return np.mean([f[P].to_numpy(dtype=np.float64) for f in frames], axis=0)


def figures(p: np.ndarray, y: np.ndarray, cost: float = 1.0) -> dict[str, float]:
    g = grades(p, CLASSES, cost)
    f1 = present_class_f1(classification_metrics(y, g, list(CLASSES)), y, CLASSES)
    present = [v for v in f1.values() if v is not None]
    return {
        "f1": [float("nan") if v is None else v for v in f1.values()],
        "accuracy": float((g == y).mean()),
        "macro_f1": float(np.mean(present)) if present else None,
        "false_alarm": float((g[y == 0] > 0).mean()),
        "ece": expected_calibration_error(p, y),
        "confidence": float(p.max(axis=1).mean()),
    }


def pair_rows(label: str, a: pd.DataFrame, b: pd.DataFrame) -> None:
    y = a["label"].to_numpy()
    for name, p in (
        ("20 epochs", mean_of([a])),
        ("40 epochs", mean_of([b])),
        ("**both, mean**", mean_of([a, b])),
    ):
        f, f2 = figures(p, y), figures(p, y, 2.0)
        print(
            f"| {label} ({len(y):,}) | {name} | {f['accuracy']:.3f} | {f['macro_f1']:.3f} | "
            f"{f['false_alarm']:.1%} | {f['ece']:.3f} | {f['confidence']:.2f} | "
            f"{f2['macro_f1']:.3f}, {f2['false_alarm']:.1%} |"
        )


def held_out(runs: Path) -> None:
    print("## Each event held out, and new areas of known events: the two recipes and their mean\n")
    print(
        "| buildings | network | accuracy | macro-F1 | intact called damaged | ECE | mean top "
        "probability | at cost 2: macro-F1, intact called damaged |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for fold, event in HELD_OUT.items():
        pair_rows(
            event,
            *(
                load(runs / f"{r}/fold{fold}")
                for r in ("loeo-general-cpu", "loeo-general-long-cpu")
            ),
        )
    for fold in BLOCK_FOLDS:
        paths = [runs / f"{r}/fold{fold}" for r in ("block-general", "block-general-long")]
        if all((p / "predictions.csv").is_file() for p in paths):
            pair_rows(f"block fold {fold}", *(load(p) for p in paths))
    print()


def choice(runs: Path) -> None:
    print("## Chosen on inner folds that hold out whole events, pairs among the candidates\n")
    print(
        "| outer event | candidates | chosen | inner macro-F1, intact called damaged | on the "
        "outer event: accuracy, macro-F1, intact called damaged, ECE |"
    )
    print("|---|---|---|---|---|")
    for event, (inner_dir, outer_runs) in CHOICES.items():
        recipes = list(outer_runs)
        inner = [{r: load(runs / inner_dir / r / f"fold{j}") for r in recipes} for j in (0, 1)]
        outer = {r: load(runs / outer_runs[r]) for r in recipes}
        for largest in sorted({1, 2, len(recipes)}):
            sizes = range(1, largest + 1)
            scored = {}  # (members, cost) -> mean inner macro-F1 and false alarms, as cv's
            for members in (c for n in sizes for c in itertools.combinations(recipes, n)):
                for cost in COSTS:
                    per = [
                        figures(
                            mean_of([f[m] for m in members]),
                            f[recipes[0]]["label"].to_numpy(),
                            cost,
                        )
                        for f in inner
                    ]
                    scored[members, cost] = {
                        "mean": float(np.mean([x["macro_f1"] for x in per])),
                        "false_alarm": float(np.mean([x["false_alarm"] for x in per])),
                    }
            (members, cost), _ = pick(scored, MAX_FALSE_ALARM)  # the rule of `cv --inner`
            f1, fa = scored[members, cost]["mean"], scored[members, cost]["false_alarm"]
            y = outer[recipes[0]]["label"].to_numpy()
            o = figures(mean_of([outer[m] for m in members]), y, cost)
            what = {1: "single recipes", 2: "single recipes and pairs"}.get(
                largest, "every mean of up to all the recipes"
            )
            print(
                f"| {event} | {what} ({len(scored)}) | {' + '.join(members)} at cost "
                f"{cost:g} | {f1:.3f}, {fa:.1%} | {o['accuracy']:.3f}, {o['macro_f1']:.3f}, "
                f"{o['false_alarm']:.1%}, {o['ece']:.3f} |"
            )
    print()


def main(argv: list[str]) -> None:
    runs = Path(argv[0]) if argv else Path(__file__).parent / "runs"
    held_out(runs)
    choice(runs)


if __name__ == "__main__":
    main(sys.argv[1:])
