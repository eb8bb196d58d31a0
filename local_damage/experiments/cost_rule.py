"""What a false-alarm cost buys and costs, read on the out-of-fold predictions of a
cross-validation.

``score --false-alarm-cost C`` grades a building damaged only where that grade is at least ``C``
times as probable as no-damage (:mod:`runtime.grading`). The cost is the analyst's to set, not a
figure to fit; this module shows, for a few costs, the intact buildings still called damaged
against the macro-F1 given up, fold by fold, from the same probabilities the model gave.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from runtime.grading import grades
from runtime.metrics import macro_f1_present

#: The costs the table shows.
COSTS = (1.0, 2.0, 3.0, 5.0, 10.0)


def cost_curve(
    frame, class_names: Sequence[str], costs: Sequence[float] = COSTS
) -> list[dict[str, Any]] | None:
    """One row per cost: macro-F1 per fold (``fold_macro_f1``) and pooled, accuracy, and the
    buildings on intact tiles called damaged (``intact_damaged``, of ``intact``; ``destroyed``
    of them; ``worst_fold_share``). None without probabilities or intact tiles."""
    columns = [f"p_{c}" for c in class_names]
    if any(c not in frame.columns for c in columns) or not frame["intact_tile"].any():
        return None
    p = frame[columns].to_numpy(dtype=np.float64)
    y = frame["label"].to_numpy(dtype=np.int64)
    folds = frame["fold"].to_numpy(dtype=np.int64)
    intact = frame["intact_tile"].to_numpy(dtype=bool)
    destroyed = list(class_names).index("destroyed") if "destroyed" in class_names else None
    rows = []
    for cost in costs:
        g = grades(p, class_names, cost)
        shares = [
            float((g[(folds == f) & intact] > 0).mean())
            for f in np.unique(folds)
            if ((folds == f) & intact).any()
        ]
        rows.append(
            {
                "cost": float(cost),
                "fold_macro_f1": {
                    int(f): macro_f1_present(y[folds == f], g[folds == f], class_names)
                    for f in np.unique(folds)
                },
                "macro_f1": macro_f1_present(y, g, class_names),
                "accuracy": float((g == y).mean()),
                "intact": int(intact.sum()),
                "intact_damaged": int((g[intact] > 0).sum()),
                "destroyed": None if destroyed is None else int((g[intact] == destroyed).sum()),
                "worst_fold_share": max(shares),
            }
        )
    return rows


def cost_table(name: str, rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines of :func:`cost_curve`'s rows."""
    header = [
        "false-alarm cost",
        "macro-F1 over folds, mean (min-max)",
        "macro-F1 pooled",
        "accuracy pooled",
        "intact called damaged, pooled (destroyed)",
        "worst fold",
    ]
    lines = [
        f"### {name}: the false-alarm cost (`score --false-alarm-cost`)",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for r in rows:
        f1 = list(r["fold_macro_f1"].values())
        share = r["intact_damaged"] / r["intact"]
        lines.append(
            f"| {r['cost']:g} | {np.mean(f1):.3f} ({min(f1):.3f}-{max(f1):.3f}) | "
            f"{r['macro_f1']:.3f} | {r['accuracy']:.3f} | {share:.1%} ({r['intact_damaged']} of "
            f"{r['intact']}; {r['destroyed']}) | {r['worst_fold_share']:.1%} |"
        )
    return [*lines, ""]
