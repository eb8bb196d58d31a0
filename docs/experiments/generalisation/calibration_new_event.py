"""Whether a temperature holds on a new event, from the predictions in the repository (no model):

    python docs/experiments/generalisation/calibration_new_event.py

Reads the ``predictions.csv`` (raw logits) of the runs in docs/experiments/generalisation/runs
and docs/experiments/cv/cpu-local. Prints:

1. **Without a label of the event**: the leave-one-event-out models (Michael: bundled and
   general recipes; Santa Rosa and Joplin: the general recipe; trained on the CPU:
   :data:`LOEO`) with a temperature fitted on out-of-area
   predictions of the general recipe's five spatial-block folds (:data:`BLOCK_FOLDS`, all
   folds trained without the loader defect of generalisation.md): of the other events only
   (the honest case: a new event has no labels), and of every event, the event's own other
   blocks included (an event already in the training data, new areas of it); beside the raw
   probabilities and the oracle (fitted on the held-out event itself).
2. **With k labels of the event**: `adapt`'s recalibration rule (:func:`app.adapt.recalibrate.
   recalibrate`) on k random buildings (40 draws per k, seed 0), judged on the others: ECE raw
   and recalibrated (mean, maximum), the draws made worse, and how often the temperature was
   kept; on each held-out event, on the out-of-area buildings of the events other than Michael,
   and on the tile
   folds of the bundled recipe (imagery like the training's, at the temperature of 1.45 the tile
   folds call for, i.e. already calibrated: the rule must leave it alone).

ECE: top-label, 15 equal-width bins (runtime.metrics.calibration).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from app.adapt.recalibrate import recalibrate
from runtime.calibration import fit_temperature
from runtime.metrics.calibration import expected_calibration_error

RUNS = Path(__file__).parent / "runs"
CV = Path(__file__).parents[1] / "cv" / "cpu-local"
DRAWS = 40
#: The leave-one-event-out runs: (event, recipe) -> (run, fold of the event store, chip prefix).
LOEO = {
    ("Michael", "bundled"): ("loeo-bundled-cpu", 2, "hurricane-michael"),
    ("Michael", "general"): ("loeo-general-cpu", 2, "hurricane-michael"),
    ("Santa Rosa", "general"): ("loeo-general-cpu", 4, "santa-rosa-wildfire"),
    ("Joplin", "general"): ("loeo-general-cpu", 3, "joplin-tornado"),
}
#: The general recipe's spatial-block folds whose out-of-area predictions give the temperature.
BLOCK_FOLDS = (0, 1, 2, 3, 4)


def _read(paths) -> tuple[np.ndarray, np.ndarray, pd.Series]:
    """Logits, labels and chip ids (``<event>_<tile>:<uid>``) of the predictions."""
    d = pd.concat([pd.read_csv(p) for p in paths], ignore_index=True)
    logits = d[[c for c in d.columns if c.startswith("logit_")]].to_numpy(np.float64)
    return logits, d.label.to_numpy(np.int64), d.chip_id


def _p(logits: np.ndarray, t: float) -> np.ndarray:
    z = logits / t
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _ece(logits, y, t=1.0) -> float:
    return expected_calibration_error(_p(logits, t), y)


def main() -> None:
    blocks = [RUNS / "block-general" / f"fold{f}" / "predictions.csv" for f in BLOCK_FOLDS]
    bl, by, ids = _read(blocks)
    sets = {}
    print("1. without a label of the event: leave-one-event-out")
    for (event, recipe), (run, fold, prefix) in LOEO.items():
        path = RUNS / run / f"fold{fold}" / "predictions.csv"
        if not path.exists():
            print(f"  {event}, {recipe}: no {path}")
            continue
        lo, y, _ = _read([path])
        em = ids.str.startswith(prefix).to_numpy()
        sets[f"{event}, {recipe} recipe"] = (lo, y)
        line = f"  {event}, {recipe}: raw ECE {_ece(lo, y):.3f}"
        for what, mask in (("other events' blocks", ~em), ("every event's blocks", em | ~em)):
            t = fit_temperature(bl[mask], by[mask])
            line += f"; T from {what} ({mask.sum()} buildings) {t:.2f}: ECE {_ece(lo, y, t):.3f}"
        oracle = fit_temperature(lo, y)
        print(f"{line}; oracle T {oracle:.2f}: ECE {_ece(lo, y, oracle):.3f}")
    michael = ids.str.startswith("hurricane-michael").to_numpy()
    sets["other events, new areas (general recipe)"] = (bl[~michael], by[~michael])
    tl, ty, _ = _read([CV / f"fold{f}" / "predictions.csv" for f in range(5)])
    t_tiles = fit_temperature(tl, ty)
    sets[f"tile folds at T {t_tiles:.2f} (bundled recipe, calibrated)"] = (tl / t_tiles, ty)
    print("2. with k labels of the event: adapt's recalibration, 40 draws per k")
    print("  set | k | ECE raw | recalibrated (max) | draws worse (by > 0.02) | T kept")
    for name, (lo, y) in sets.items():
        rng = np.random.default_rng(0)
        for k in (10, 20, 30, 50, 100, 200):
            raw, new, kept = [], [], 0
            for _ in range(DRAWS):
                idx = rng.permutation(len(y))
                a, b = idx[:k], idx[k:]
                r = recalibrate(lo[a] - lo[a].max(1, keepdims=True), y[a])
                kept += r.kept
                raw.append(_ece(lo[b], y[b]))
                new.append(_ece(lo[b], y[b], r.temperature))
            raw, new = np.asarray(raw), np.asarray(new)
            print(
                f"  {name} | {k} | {raw.mean():.3f} | {new.mean():.3f} ({new.max():.3f}) | "
                f"{(new > raw).sum()} ({(new > raw + 0.02).sum()}) of {DRAWS} | {kept} of {DRAWS}"
            )


if __name__ == "__main__":
    main()
