"""A per-grade logit offset chosen on out-of-fold predictions (post-hoc logit adjustment, Menon
et al. 2021), judged on new areas and on new events:

    python docs/experiments/generalisation/grade_bias.py BLOCK_OOF EVENT_OOF

The offset ``b`` (no-damage fixed at 0, the others on a grid of -1 to 2 by 0.25) maximises
macro-F1 with no more intact buildings called damaged than the raw grades. New areas: fitted
on four block folds' out-of-fold predictions, applied to the fifth (cross-fitted). New events:
fitted on the block folds' predictions of the other events, applied to the model that never saw
the event (EVENT_OOF, leave-one-event-out).
"""

import itertools
import sys

import numpy as np
import pandas as pd
from sklearn.metrics import f1_score

from runtime.metrics.calibration import expected_calibration_error
from runtime.predictor import softmax

GRID = np.arange(-1.0, 2.01, 0.25)


def load(path):
    df = pd.read_csv(path)
    return df, df[[c for c in df.columns if c.startswith("logit_")]].to_numpy(), df.label.to_numpy()


def macro(y, pred):
    return f1_score(y, pred, labels=[0, 1, 2, 3], average="macro", zero_division=0)


def alarms(y, pred):
    return float(np.mean(pred[y == 0] != 0))


def fit(logits, y):
    cap, best = alarms(y, logits.argmax(1)), (-1.0, np.zeros(4))
    for b in itertools.product(GRID, GRID, GRID):
        bias = np.array([0.0, *b])
        pred = (logits + bias).argmax(1)
        if alarms(y, pred) <= cap and (score := macro(y, pred)) > best[0]:
            best = (score, bias)
    return best[1]


def line(name, logits, y):
    pred = logits.argmax(1)
    f1 = f1_score(y, pred, labels=[0, 1, 2, 3], average=None, zero_division=0)
    ece = expected_calibration_error(softmax(logits.astype(np.float32)), y)
    print(
        f"  {name}: accuracy {np.mean(pred == y):.3f}, macro-F1 {macro(y, pred):.3f}, F1 "
        f"{' / '.join(f'{v:.2f}' for v in f1)}, intact called damaged {alarms(y, pred):.1%}, "
        f"ECE {ece:.3f}"
    )


block, bl, by = load(sys.argv[1])
event, el, ey = load(sys.argv[2])
folds = block.fold.to_numpy()
adjusted = bl.copy()
print("new areas (block folds, offset fitted on the other four):")
for k in np.unique(folds):
    bias = fit(bl[folds != k], by[folds != k])
    adjusted[folds == k] = bl[folds == k] + bias
    print(f"  fold {k}: offset {bias.tolist()}")
line("raw", bl, by)
line("offset", adjusted, by)
print("held-out events (offset fitted on the block predictions of the other events):")
for name in sorted(event.event.unique()):
    rows, others = (event.event == name).to_numpy(), (block.event != name).to_numpy()
    bias = fit(bl[others], by[others])
    print(f" {name}: offset {bias.tolist()}")
    line("raw", el[rows], ey[rows])
    line("offset", el[rows] + bias, ey[rows])
