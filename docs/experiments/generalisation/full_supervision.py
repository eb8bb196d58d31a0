"""The ceiling of the adaptation curve on Hurricane Michael: the Michael-free base adapted with
every label of the other Michael tiles, by 5-fold cross-validation by tile:

    python docs/experiments/generalisation/full_supervision.py BASE_ONNX CHIPS [FOLDS]

BASE_ONNX: the Michael-free base of fewshot.md (work/fs9/hurricane-michael/base.onnx, its
.safetensors beside it); CHIPS: work/all5/chips64. Michael's labelled buildings are dealt to 5
folds by tile (scikit-learn's GroupKFold); for each fold, `adapt` (the heads) and
`adapt --finetune` (the network, default options, the same rule that keeps the base when the
cross-validation on the labels does not clearly beat it) learn from the other four folds'
labels, about 2,900 buildings, and grade the fold. Beside what the commands keep, what the
labels could buy if the rule were set aside: every head fitted on the labels (`forced <head>`),
and the network trained for the epoch count with the lowest cross-validated NLL on the labels
(`finetune forced`). Prints per fold and pooled: accuracy, macro-F1 and the share of intact
buildings called damaged. FOLDS (e.g. ``2,3,4``) runs only those folds of the five, the pooled
figures then over those folds' buildings.
"""

import sys
import time

import numpy as np
from sklearn.model_selection import GroupKFold

from app.adapt.fit import METHODS, adapt_head, fit_head
from app.adapt.labelled import from_chip_store
from app.adapt.model import base_model
from data_prep.store import read_manifest
from local_damage.adapt import finetune as ft
from local_damage.adapt.finetune import FinetuneOptions
from local_damage.adapt.network import (
    load_network,
    predict,
    prepare_chips,
    split_network,
    trunk_features,
)
from runtime.metrics import classification_metrics
from runtime.predictor import Predictor
from runtime.selection import INTACT
from studies.finetune_arm import finetune_labels, finetuned_classes

FOLDS = 5


def scores(y: np.ndarray, pred: np.ndarray, names) -> str:
    m = classification_metrics(y, pred, names)
    intact = np.mean(pred[y == INTACT] != INTACT)
    return (
        f"accuracy {m['accuracy']:.3f}, macro-F1 {m['macro_f1']:.3f}, intact damaged {intact:.1%}"
    )


def forced(weights: str, b, tr: np.ndarray, te: np.ndarray, epochs: int) -> np.ndarray:
    """The grades of ``te`` by the network trained on the labels of ``tr`` for ``epochs`` epochs
    as `adapt --finetune` trains it, whatever its rule says (the base network for 0)."""
    return forced_logits(weights, b, tr, te, epochs).argmax(1)


def forced_logits(weights: str, b, tr: np.ndarray, te: np.ndarray, epochs: int) -> np.ndarray:
    """The logits of :func:`forced`."""
    net, config = load_network(weights)
    size = ft.input_size(config, b.pre.shape[1])
    if epochs:
        trunk, _, _ = split_network(net, FinetuneOptions().blocks)
        feats = trunk_features(
            trunk, prepare_chips(b.pre[tr], size), prepare_chips(b.post[tr], size)
        )
        ft.train_top(net, feats, b.labels[tr], epochs, FinetuneOptions(), 0)
    net.eval()
    return predict(net, b.pre[te], b.post[te], size)


def main(base_onnx: str, chips: str, only: str = "") -> None:
    predictor = Predictor(base_onnx)
    names = list(predictor.class_names)
    b = from_chip_store(chips, names, event="hurricane-michael")
    b = b.subset(b.labelled)
    p = predictor.predict(b.pre, b.post)
    raw = p.raw_logits if p.raw_logits is not None else p.logits
    y = b.labels
    base = base_model(predictor)
    manifest = read_manifest(chips)
    tile = dict(zip(manifest["chip_id"], manifest["tile"], strict=True))
    groups = np.asarray([tile[i] for i in b.ids])
    weights = base_onnx.replace(".onnx", ".safetensors")
    arms = ["base", "heads", "finetune", "finetune forced"] + [f"forced {m}" for m in METHODS]
    pred = {arm: np.zeros(len(y), dtype=np.int64) for arm in arms}
    print(f"{len(y)} buildings of {len(set(groups))} tiles, {FOLDS} folds by tile")
    chosen = {int(f) for f in only.split(",")} if only else set(range(FOLDS))
    graded = np.zeros(len(y), dtype=bool)
    for fold, (tr, te) in enumerate(GroupKFold(FOLDS).split(y, y, groups)):
        if fold not in chosen:
            continue
        graded[te] = True
        start = time.perf_counter()
        pred["base"][te] = p.probabilities[te].argmax(1)
        a = adapt_head(raw[tr], p.embedding[tr], y[tr], base, METHODS, 0, "discount")
        pred["heads"][te] = a.head.log_probabilities(raw[te], p.embedding[te]).argmax(1)
        for m in METHODS:
            head = fit_head(m, raw[tr], p.embedding[tr], y[tr], base)
            pred[f"forced {m}"][te] = head.log_probabilities(raw[te], p.embedding[te]).argmax(1)
        r = finetune_labels(weights, b, tr, None, FinetuneOptions())
        pred["finetune"][te] = finetuned_classes(r, b, te) if r.epochs else pred["base"][te]
        best = r.clear["best_epoch"]
        pred["finetune forced"][te] = forced(weights, b, tr, te, best)
        curve = {e["epoch"]: e for e in r.curve}
        print(
            f"fold {fold}: {len(tr)} labels, {len(te)} graded; head kept {a.head.method}, "
            f"fine-tuning kept {r.epochs} epoch(s), lowest CV NLL at {best} (CV macro-F1 "
            f"{curve[0]['macro_f1']:.3f} -> {curve[best]['macro_f1']:.3f}, accuracy "
            f"{curve[0]['accuracy']:.3f} -> {curve[best]['accuracy']:.3f}); "
            f"{time.perf_counter() - start:.0f} s"
        )
        for arm in pred:
            print(f"  {arm}: {scores(y[te], pred[arm][te], names)}")
    print(f"pooled over folds {sorted(chosen)}:")
    for arm in pred:
        print(f"  {arm}: {scores(y[graded], pred[arm][graded], names)}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
