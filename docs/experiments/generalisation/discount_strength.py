"""How strongly `adapt` should discount a grade the labels never show: the prior weight ``A`` of
the ``discount`` rule (`app.adapt.fit.UNLABELLED_PSEUDO_COUNT`, ``rho = A / (A + e_c)``) tried
on both scenarios of docs/experiments/fewshot.md, `adapt`'s heads as the command fits them.

    python docs/experiments/generalisation/discount_strength.py --michael-base MICHAEL_FREE.onnx \
        --michael-chips CHIPS --new-tile-model MODEL.onnx --new-tile-chips CHIPS [CHIPS ...] \
        [--pseudo-counts 1,2,3,5] [--seed 1000] [--draws 40]

- **An unseen event**: a base that never saw Hurricane Michael (`bench fewshot`'s base of the
  shipped recipe), k labels drawn at random over Michael's buildings (seed ``[seed, k, draw]``),
  the other buildings graded by the base and by the head `adapt` keeps.
- **A new tile of a known event**: `studies.newtile.bench_new_tile` (the draws of `bench
  new-tile`, heads only, 100 draws per k), the same seed.

Printed per ``A`` and k: the mean macro-F1 gain on the graded buildings, the share of draws worse
by more than 0.01 macro-F1, and the heads kept. A small ``A`` trusts the labels' silence about a
grade (one wrong call among 20 labels halves it); a large one trusts the base model's view.
"""

from __future__ import annotations

import argparse
from collections import Counter

import numpy as np

import app.adapt.fit as fit
from app.adapt.labelled import from_chip_store
from app.adapt.model import base_model
from runtime.grading import grade_ids
from runtime.predictor import Predictor
from runtime.selection import INTACT
from studies.newtile import WORSE, NewTileOptions, bench_new_tile, head_predictions, macro_f1

K_MICHAEL = (10, 20, 50, 100)
K_NEW_TILE = (5, 10, 20, 50)


def michael(model: str, chips: str, seed: int, draws: int):
    """One closure per ``A``: the heads `adapt` keeps on random draws of Michael's labels."""
    predictor = Predictor(model)
    names = list(predictor.class_names)
    b = from_chip_store(chips, names, event="hurricane-michael")
    b = b.subset(b.labelled)
    p = predictor.predict(b.pre, b.post)
    raw = p.raw_logits if p.raw_logits is not None else p.logits
    y, z, tiles = b.labels, p.embedding, np.asarray(b.tiles())
    base = base_model(predictor)  # the base and the heads graded under the model's own rule
    base_pred = grade_ids(p.probabilities, INTACT, base.false_alarm_cost)

    def run() -> list[str]:
        lines = []
        for k in K_MICHAEL:
            gains, kept = [], Counter()
            for d in range(draws):
                perm = np.random.default_rng([seed, k, d]).permutation(len(y))
                given, rest = perm[:k], np.sort(perm[k:])
                before = macro_f1(y[rest], base_pred[rest], names)
                pred, head = head_predictions(raw, z, y, given, rest, tiles, base)
                pred = base_pred[rest] if pred is None else pred
                gains.append(macro_f1(y[rest], pred, names) - before)
                kept[head] += 1
            g = np.asarray(gains)
            lines.append(
                f"michael  k={k:<4d} gain {g.mean():+.4f}  worse {np.mean(g < -WORSE):.0%} "
                f"of {draws}  kept {dict(kept.most_common())}"
            )
        return lines

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--michael-base", required=True)
    ap.add_argument("--michael-chips", required=True)
    ap.add_argument("--new-tile-model", required=True)
    ap.add_argument("--new-tile-chips", nargs="+", required=True)
    ap.add_argument("--pseudo-counts", default="1,2,3,5")
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--draws", type=int, default=40)
    a = ap.parse_args(argv)
    run_michael = michael(a.michael_base, a.michael_chips, a.seed, a.draws)
    for value in (float(v) for v in a.pseudo_counts.split(",")):
        fit.UNLABELLED_PSEUDO_COUNT = value
        print(f"A = {value:g}", flush=True)
        for line in run_michael():
            print("  " + line, flush=True)
        options = NewTileOptions(ks=K_NEW_TILE, draws=100, seed=a.seed)
        for s in bench_new_tile(a.new_tile_model, a.new_tile_chips, options)["summary"]:
            print(
                f"  new tile k={s['k']:<4d} gain {s['gain']:+.4f}  worse {s['worse_share']:.0%} "
                f"of {s['draws']}  kept {s['heads']}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
