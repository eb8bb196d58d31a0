"""New areas of an event the model learnt from, k labels drawn at random over them, the rest
graded: `adapt` (its heads) and `adapt --finetune` as an analyst runs them, against the base.

    python docs/experiments/generalisation/new_area_adapt.py MODEL.onnx CHIPS \
        [--event hurricane-michael] [--k 100] [--draws 3] [--tune-draws 3] [--arms heads,finetune]

MODEL is a block fold's model (exported with `--weights` beside it, as the shipped model is), so
the event's tiles it did not train on (its metadata's training tiles are left out) are areas it
never saw of an event it knows, as the kept-aside Michael tiles are for the shipped model, which
trained on 65 Michael tiles. Per draw: k of those buildings labelled at random, the others graded
by the base model and by each arm (`studies.newtile`'s arms: `app.adapt.fit.adapt_head` as
`adapt`, `local_damage.adapt.finetune` as `adapt --finetune`). Prints per arm and draw the
accuracy, macro-F1 and share of intact buildings called damaged of base and adapted model, and
whether the draw is worse (macro-F1 down by more than 0.01 or accuracy by more than 0.02).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from app.adapt.labelled import from_chip_store
from app.adapt.model import base_model
from local_damage.adapt.finetune import weights_beside
from runtime.grading import grade_ids
from runtime.metrics import classification_metrics
from runtime.predictor import Predictor
from runtime.selection import INTACT
from runtime.training_tiles import training_tiles
from studies.newtile import head_predictions, tuned_predictions


def figures(y, pred, names) -> dict:
    m = classification_metrics(y, pred, names)
    intact = y == 0
    return {
        "accuracy": float(m["accuracy"]),
        "macro_f1": float(m["macro_f1"]),
        "intact_called_damaged": float(np.mean(pred[intact] != 0)) if intact.any() else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("chips")
    ap.add_argument("--event", default="hurricane-michael")
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--draws", type=int, default=3)
    ap.add_argument("--tune-draws", type=int, default=3)
    ap.add_argument("--arms", default="heads,finetune")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    predictor = Predictor(args.model)
    names = list(predictor.class_names)
    event = from_chip_store(args.chips, names, event=args.event)
    trained = training_tiles(predictor.metadata).tiles or frozenset()
    keep = event.labelled & ~np.isin(event.tiles(), sorted(trained))
    b = event.subset(keep)
    tile = np.asarray(b.tiles())
    y = b.labels
    print(
        f"{args.event}: {len(y)} graded buildings on {len(set(tile))} tiles the model did not "
        f"train on ({np.bincount(y, minlength=len(names)).tolist()} per grade)"
    )
    p = predictor.predict(b.pre, b.post)
    raw = p.raw_logits if p.raw_logits is not None else p.logits
    base_net = base_model(predictor)  # the base and the heads graded under the model's own rule
    base_pred = grade_ids(p.probabilities, INTACT, base_net.false_alarm_cost)
    weights = weights_beside(args.model)
    print("arm | draw | base acc / mF1 / intact called damaged | adapted | kept | worse | s")
    for d in range(args.draws):
        rng = np.random.default_rng([args.seed, args.k, d])
        order = rng.permutation(len(y))
        given, rest = order[: args.k], np.sort(order[args.k :])
        base = figures(y[rest], base_pred[rest], names)
        for arm in args.arms.split(","):
            if arm != "heads" and d >= args.tune_draws:
                continue
            start = time.perf_counter()
            if arm == "heads":
                pred, kept = head_predictions(raw, p.embedding, y, given, rest, tile, base_net)
                pred = base_pred[rest] if pred is None else pred
            else:
                unlabelled = rest if arm == "semi" else None
                pred, kept = tuned_predictions(
                    weights, b, given, rest, unlabelled, base_pred[rest], args.seed + d
                )
            got = figures(y[rest], pred, names)
            worse = (got["macro_f1"] < base["macro_f1"] - 0.01) or (
                got["accuracy"] < base["accuracy"] - 0.02
            )
            print(
                f"{arm} | {d} | {base['accuracy']:.3f} / {base['macro_f1']:.3f} / "
                f"{base['intact_called_damaged']:.1%} | {got['accuracy']:.3f} / "
                f"{got['macro_f1']:.3f} / {got['intact_called_damaged']:.1%} | {kept} | "
                f"{'yes' if worse else 'no'} | {time.perf_counter() - start:.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
