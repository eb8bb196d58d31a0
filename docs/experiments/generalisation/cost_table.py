"""Macro-F1 and intact buildings called damaged at several false-alarm costs, from predictions:

    python docs/experiments/generalisation/cost_table.py [--accuracy] RUN_DIR [RUN_DIR ...]

Each ``RUN_DIR`` holds a ``predictions.csv`` of ``cv`` (labels and probabilities of its test
buildings). The grade at cost ``c`` is the one ``score --false-alarm-cost c`` gives
(:func:`runtime.grading.grades`): the most probable damaged grade where it is at least ``c``
times as probable as no-damage, else no-damage. Macro-F1 as the cross-validation reports it
(:func:`runtime.metrics.macro_f1_present`); "intact called damaged" over every no-damage building
(the cross-validation's own cost table, :mod:`local_damage.experiments.cost_rule`, counts those on
intact tiles only). Prints one Markdown row per run; with ``--accuracy`` each cell starts with the
accuracy of those grades.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from runtime.grading import NO_DAMAGE, grades
from runtime.metrics import macro_f1_present

COSTS = (1.0, 2.0, 3.0, 5.0)


def cost_row(predictions: Path, accuracy: bool = False) -> list[str]:
    """``[accuracy, ]macro-F1, intact called damaged`` at each cost of :data:`COSTS`."""
    d = pd.read_csv(predictions)
    names = [c.removeprefix("p_") for c in d.columns if c.startswith("p_")]
    if NO_DAMAGE not in names or "label" not in d.columns:
        raise SystemExit(f"{predictions}: needs a label column and a p_{NO_DAMAGE} column")
    p = d[[f"p_{n}" for n in names]].to_numpy(np.float64)
    y = d.label.to_numpy(np.int64)
    intact = y == names.index(NO_DAMAGE)
    cells = []
    for cost in COSTS:
        g = grades(p, names, cost)
        f1 = macro_f1_present(y, g, names)
        head = f"{np.mean(g == y):.3f}, " if accuracy else ""
        cells.append(f"{head}{f1:.3f}, {100 * np.mean(g[intact] != y[intact]):.1f}%")
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="folders with a predictions.csv")
    ap.add_argument("--accuracy", action="store_true", help="the accuracy first in each cell")
    args = ap.parse_args()
    print("| run | " + " | ".join(f"cost {c:g}" for c in COSTS) + " |")
    print("|---" * (len(COSTS) + 1) + "|")
    for run in args.runs:
        path = run / "predictions.csv"
        if not path.is_file():
            raise SystemExit(
                f"{run}: no predictions.csv in this folder (a cv fold folder holds one)"
            )
        print(f"| {run} | " + " | ".join(cost_row(path, args.accuracy)) + " |")


if __name__ == "__main__":
    main()
