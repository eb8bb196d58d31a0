"""Which choice rule would keep the adapted heads from making a new event worse: `adapt`'s heads
on Hurricane Michael, every draw judged under several rules on the event's other buildings.

    python docs/experiments/generalisation/heads_rules.py MODEL CHIPS [--k 20,50,100,200,500]
        [--draws 20] [--draw random|area] [--out FILE.json]

MODEL: a base that never saw Michael; CHIPS: a chip store holding Michael's labelled buildings
(work/all5/chips64). The base's logits and embeddings are computed once; for each k and draw
(seed ``[seed, k, draw]``) k labels are drawn (``random``: over the event; ``area``: the first
buildings of whole spatial blocks in a random order, as `bench fewshot --draw area`, the other
blocks graded), the heads are cross-validated four times: on stratified folds, on folds by
the labels' tiles (a tile's labels never on both sides of a fold, when they come from 3 tiles
or more, as `adapt` does it), by their spatial blocks, and on plain k-fold; each rule's head
grades the other buildings:

- ``before``: the rule of runtime.selection.RULE on stratified folds, the candidates' NLL judged
  against the base model's raw probabilities (`adapt` before the two changes below);
- ``spread``: ``before``, every head but ``base+discount`` also held to a macro-F1 gain above 2
  bootstrap standard errors (as fine-tuning is);
- ``mix``: ``before``, and a candidate is refused when its predicted class shares on the
  unlabelled buildings are further (L1) from the labels' class shares than the base model's;
- ``tiles``: ``before`` on the folds by tile;
- ``blocks``: the same with the labels' spatial blocks as the groups;
- ``kfold``: a control, shuffled k-fold neither stratified nor by tile;
- ``recalibrated``: ``before`` with the NLL judged against the base model recalibrated on the
  other folds (app.adapt.recalibrate.softened_losses);
- ``adapt``: ``recalibrated`` on the folds by tile: what `adapt` does.

Printed per rule and k: the mean macro-F1 and accuracy change on the other buildings, the draws
worse by more than 0.01 macro-F1 or 0.02 accuracy, and the draws in which a head was kept.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np

import app.adapt.fit as fit
from app.adapt.fit import AdaptError, adapt_head
from app.adapt.labelled import from_chip_store
from app.adapt.model import base_model
from runtime.metrics import classification_metrics
from runtime.predictor import Predictor
from runtime.selection import NEAR_TIE_SE, macro_f1_gain
from studies.fewshot_measure import area_blocks, area_split

RULES = ("before", "spread", "mix", "tiles", "blocks", "kfold", "recalibrated", "adapt")
_seen: dict = {}
_choose = fit.choose
_splits = fit._splits


def _record(candidates, losses, names, preds=None, labels=None, reference=None):
    """``fit.choose`` as `adapt` runs it, keeping what it saw and the choice without the
    recalibrated reference (the rule before it; its verdicts are the ones left in
    ``candidates``)."""
    saved = fit.HEADS_SPREAD
    fit.HEADS_SPREAD = ""
    try:
        best = _choose(candidates, losses, names, None, labels, reference)
        raw = _choose(candidates, losses, names, None, labels)
    finally:
        fit.HEADS_SPREAD = saved
    _seen.update(candidates=candidates, preds=preds, names=list(names), best=best, raw=raw)
    return best


def _kfold(labels, seed, tiles=None):
    """The control: shuffled k-fold, not stratified, not by tile."""
    from sklearn.model_selection import KFold

    folds = KFold(min(fit.CV_FOLDS, len(labels)), shuffle=True, random_state=seed)
    return "k-fold, not stratified", list(folds.split(labels))


def _shares(pred: np.ndarray, k: int) -> np.ndarray:
    return np.bincount(pred, minlength=k) / max(len(pred), 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("chips")
    ap.add_argument("--event", default="hurricane-michael")
    ap.add_argument("--k", default="20,50,100,200,500")
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--draw", choices=("random", "area"), default="random")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args()
    predictor = Predictor(args.model)
    names = list(predictor.class_names)
    kk = len(names)
    b = from_chip_store(args.chips, names, event=args.event)
    b = b.subset(b.labelled)
    p = predictor.predict(b.pre, b.post)
    raw = p.raw_logits if p.raw_logits is not None else p.logits
    z = p.embedding
    y = b.labels
    base_pred = p.probabilities.argmax(1)
    base = base_model(predictor)
    tiles = np.asarray(b.tiles())
    blocks = area_blocks(args.chips, b.ids)
    print(f"{args.model}: {len(b)} {args.event} buildings, draw {args.draw}", flush=True)
    fit.choose = _record
    fit.HEADS_SPREAD = "fitted"  # only so that adapt_head hands the out-of-fold classes over
    rows = []
    for k in [int(v) for v in args.k.split(",")]:
        for d in range(args.draws):
            rng = np.random.default_rng([args.seed, k, d])
            perm = rng.permutation(len(b))
            if args.draw == "random":
                given, rest = perm[:k], np.sort(perm[k:])
            else:
                pool, rest = area_split(blocks, perm, len(b) // 2, rng)
                given = pool[:k]
            yr = y[rest]

            def grade(head, rest=rest, yr=yr):
                pred = head.log_probabilities(raw[rest], z[rest]).argmax(1)
                m = classification_metrics(yr, pred, names)
                return pred, m["macro_f1"], m["accuracy"]

            m0 = classification_metrics(yr, base_pred[rest], names)
            row = {"k": k, "draw": d, "n_tiles": len(set(tiles[given].tolist()))}
            row["n_blocks"] = len(set(blocks[given].tolist()))
            row["labels"] = dict(Counter(names[v] for v in y[given]))
            try:
                a = adapt_head(raw[given], z[given], y[given], base)
                seen = dict(_seen)
                grouped = {}
                for name, groups in (
                    ("tiles", tiles[given]),
                    ("blocks", blocks[given]),
                    ("kfold", None),
                ):
                    fit._splits = _kfold if groups is None else _splits
                    g = adapt_head(raw[given], z[given], y[given], base, tiles=groups)
                    grouped[name] = (g, dict(_seen))
            except AdaptError as exc:
                row["refused"] = str(exc)
                rows.append(row)
                continue
            finally:
                fit._splits = _splits
            cands, preds = seen["candidates"], seen["preds"]
            label_shares = _shares(y[given], kk)
            base_mix = np.abs(_shares(base_pred[rest], kk) - label_shares).sum()
            figures = {}
            for name in seen["names"]:
                pred, f1, acc = grade(a.extra["fitted"][name])
                c = cands[name]
                f1g = se = None
                if name != "base":
                    f1g, se = macro_f1_gain(y[given], preds["base"], preds[name])
                mix = float(np.abs(_shares(pred, kk) - label_shares).sum())
                figures[name] = {
                    "clear": bool(c.get("clear")),
                    **{
                        f"clear_{pn}": bool(v[1]["candidates"].get(name, {}).get("clear"))
                        for pn, v in grouped.items()
                    },
                    "d_f1": f1 - m0["macro_f1"],
                    "d_acc": acc - m0["accuracy"],
                    "oof_f1_gain": f1g,
                    "oof_f1_se": se,
                    "mix": mix,
                    "nll": c["nll"],
                }
            names_c = seen["names"]

            def pick(ok, names_c=names_c, cands=cands):
                clear = [n for n in names_c if n != "base" and ok(n)]
                if not clear:
                    return "base"
                return min(clear, key=lambda n: (cands[n]["nll"], names_c.index(n)))

            choice = {
                "before": seen["raw"],
                "spread": pick(
                    lambda n, f=figures: (
                        f[n]["clear"]
                        and (
                            n == "base+discount"
                            or f[n]["oof_f1_gain"] > NEAR_TIE_SE * f[n]["oof_f1_se"]
                        )
                    )
                ),
                "mix": pick(lambda n, f=figures, m=base_mix: f[n]["clear"] and f[n]["mix"] <= m),
                **{pn: v[1]["raw"] for pn, v in grouped.items()},
                "recalibrated": seen["best"],
                "adapt": grouped["tiles"][1]["best"],
            }
            row.update(base_mix=float(base_mix), candidates=figures)
            row["schemes"] = {pn: v[0].cv["scheme"] for pn, v in grouped.items()}
            row["choice"] = choice
            for rule, name in choice.items():
                f = figures[name]
                row[rule] = {"head": name, "d_f1": f["d_f1"], "d_acc": f["d_acc"]}
            rows.append(row)
            kept = {r: row[r]["head"] for r in RULES if row[r]["head"] != "base"}
            print(
                f"k = {k}, draw {d}: {row['n_tiles']} tiles, {row['n_blocks']} blocks; "
                + "; ".join(
                    f"{r} {row[r]['head']} {row[r]['d_f1']:+.3f}/{row[r]['d_acc']:+.3f}"
                    for r in RULES
                    if r in kept
                )
                if kept
                else f"k = {k}, draw {d}: base under every rule",
                flush=True,
            )
    print("rule | k | mean d macro-F1 | mean d accuracy | worse | heads kept")
    for rule in RULES:
        for k in sorted({r["k"] for r in rows}):
            sel = [r[rule] for r in rows if r["k"] == k and rule in r]
            if not sel:
                continue
            df1 = np.mean([s["d_f1"] for s in sel])
            dacc = np.mean([s["d_acc"] for s in sel])
            worse = sum(s["d_f1"] < -0.01 or s["d_acc"] < -0.02 for s in sel)
            kept = sum(s["head"] != "base" for s in sel)
            print(
                f"{rule} | {k} | {df1:+.3f} | {dacc:+.3f} | {worse} of {len(sel)} | {kept}",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
