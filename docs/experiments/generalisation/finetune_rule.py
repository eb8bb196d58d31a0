"""What the choice rule of `adapt --finetune` sees on the labels, against what the fine-tuned
network then does on Hurricane Michael's other buildings:

    python docs/experiments/generalisation/finetune_rule.py WEIGHTS CHIPS [--k 50,100,200]
        [--draws 5] [--seed 2000]

WEIGHTS: the Michael-free base's .safetensors (work/fs9/hurricane-michael/base.safetensors);
CHIPS: work/all5/chips64. For each k and draw (seed SEED k + draw; SEED 1000 draws the
labels of recalibration.py), k of Michael's labelled buildings are drawn (in the store's order, as
`adapt` reads them); fine-tuning runs as `adapt --finetune` runs it (default options), and the
network trained for the epoch count with the lowest cross-validated NLL (whether the rule keeps
it or not) grades the other buildings beside the base network. Printed per draw: the
cross-validated figures of the base (epoch 0) and of that epoch (NLL, accuracy, macro-F1 and
each fold's), whether the rule kept it, the gains on the other buildings, and the temperature
`adapt` recalibrates the kept network with and the ECE it gives on the other buildings.
Then, for each rule below, the draws it keeps, those made worse (macro-F1 down by more than 0.01
or accuracy by more than 0.02 on the other buildings) and the mean gain:

- ``rule``: the rule of `adapt` (runtime.selection.clearly_better: NLL, accuracy, intact recall,
  and the out-of-fold macro-F1 gain above 2 bootstrap standard errors);
- ``no spread``: the rule without the macro-F1 gain's spread (the rule before it);
- ``every fold``: ``no spread``, and macro-F1 higher in every fold of the cross-validation;
- ``margin 0.02``: ``no spread``, and the cross-validated macro-F1 higher by at least 0.02.
"""

from __future__ import annotations

import argparse

import numpy as np
from full_supervision import forced_logits  # beside this script

from app.adapt.labelled import from_chip_store
from app.adapt.recalibrate import recalibrate
from data_prep.spec import CLASS_NAMES
from local_damage.adapt import finetune as ft
from local_damage.adapt.finetune import FinetuneOptions
from runtime.head import log_softmax
from runtime.metrics import classification_metrics
from runtime.metrics.calibration import expected_calibration_error
from runtime.selection import NEAR_TIE_NATS, NEAR_TIE_SE

WORSE_F1, WORSE_ACC = 0.01, 0.02


def _softmax(x: np.ndarray) -> np.ndarray:
    return np.exp(log_softmax(x))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("weights")
    ap.add_argument("chips")
    ap.add_argument("--k", default="50,100,200")
    ap.add_argument("--draws", type=int, default=5)
    ap.add_argument("--seed", type=int, default=2000)
    args = ap.parse_args()
    names = list(CLASS_NAMES)
    b = from_chip_store(args.chips, names, event="hurricane-michael")
    b = b.subset(b.labelled)
    rows = []
    base_cache: dict[tuple[int, int], np.ndarray] = {}
    for k in [int(v) for v in args.k.split(",")]:
        for draw in range(args.draws):
            idx = np.random.default_rng(args.seed * k + draw).permutation(len(b))
            tr, te = np.sort(idx[:k]), np.sort(idx[k:])
            r = ft.finetune(args.weights, b.pre[tr], b.post[tr], b.labels[tr], FinetuneOptions())
            best = r.clear["best_epoch"]
            c0, cb = r.curve[0], r.curve[best]
            base = base_cache.setdefault((k, draw), forced_logits(args.weights, b, tr, te, 0))
            tuned = forced_logits(args.weights, b, tr, te, best) if best else base
            y = b.labels[te]
            m0 = classification_metrics(y, base.argmax(1), names)
            m1 = classification_metrics(y, tuned.argmax(1), names)
            # the recalibration adapt applies to the kept network, and the ECE it gives here
            rc = recalibrate(r.oof_logits, b.labels[tr])
            kept_logits = tuned if r.epochs else base
            ece = (
                expected_calibration_error(_softmax(kept_logits), y),
                expected_calibration_error(_softmax(kept_logits / rc.temperature), y),
            )
            no_spread = (
                r.clear["gain"] > NEAR_TIE_NATS
                and r.clear["gain"] > NEAR_TIE_SE * r.clear["gain_se"]
                and cb["macro_f1"] > c0["macro_f1"]
                and cb["accuracy"] >= c0["accuracy"]
                and (cb["intact_recall"] or 0) >= (c0["intact_recall"] or 0)
            )
            folds_up = all(
                f1 > f0 for f0, f1 in zip(c0["macro_f1_folds"], cb["macro_f1_folds"], strict=True)
            )
            row = {
                "k": k,
                "draw": draw,
                "best": best,
                "kept": bool(r.epochs),
                "no_spread": no_spread,
                "cv_f1_gain": cb["macro_f1"] - c0["macro_f1"],
                "cv_acc_gain": cb["accuracy"] - c0["accuracy"],
                "folds_up": folds_up,
                "f1_gain": m1["macro_f1"] - m0["macro_f1"],
                "acc_gain": m1["accuracy"] - m0["accuracy"],
            }
            rows.append(row)
            print(
                f"k = {k}, draw {draw}: best epoch {best}, kept {row['kept']}; CV NLL "
                f"{c0['nll']:.3f} -> {cb['nll']:.3f}, accuracy {c0['accuracy']:.3f} -> "
                f"{cb['accuracy']:.3f}, macro-F1 {c0['macro_f1']:.3f} -> {cb['macro_f1']:.3f} "
                f"(out of fold {r.clear['f1_gain']:+.3f}, se {r.clear['f1_gain_se']:.3f}) "
                f"(folds {c0['macro_f1_folds']} -> {cb['macro_f1_folds']}); other buildings: "
                f"macro-F1 {m0['macro_f1']:.3f} -> {m1['macro_f1']:.3f}, accuracy "
                f"{m0['accuracy']:.3f} -> {m1['accuracy']:.3f}; recalibration of the kept "
                f"network: T {rc.temperature:.2f} (fitted {rc.fitted}, {rc.why}; cross-fitted "
                f"ECE {rc.ece}), ECE on the other buildings {ece[0]:.3f} -> {ece[1]:.3f}",
                flush=True,
            )
    rules = {
        "rule": lambda r: r["kept"],
        "no spread": lambda r: r["no_spread"],
        "every fold": lambda r: r["no_spread"] and r["folds_up"],
        "margin 0.02": lambda r: r["no_spread"] and r["cv_f1_gain"] >= 0.02,
    }
    print("rule | draws kept | made worse | mean macro-F1 gain | mean accuracy gain (all draws)")
    for name, keep in rules.items():
        kept = [r for r in rows if keep(r)]
        worse = [r for r in kept if r["f1_gain"] < -WORSE_F1 or r["acc_gain"] < -WORSE_ACC]
        f1 = np.mean([r["f1_gain"] if keep(r) else 0.0 for r in rows])
        acc = np.mean([r["acc_gain"] if keep(r) else 0.0 for r in rows])
        print(f"{name} | {len(kept)} of {len(rows)} | {len(worse)} | {f1:+.3f} | {acc:+.3f}")


if __name__ == "__main__":
    main()
