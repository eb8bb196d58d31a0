"""The scene-level signal of unfamiliar imagery, measured on the general recipe's fold models:

    python docs/experiments/generalisation/scene_signal_folds.py BLOCK_CHIPS BLOCK_OOF \
        EVENT_CHIPS EVENT_OOF --block-folds RUN [RUN ...] --event-folds RUN [RUN ...]

BLOCK_CHIPS / EVENT_CHIPS: the chip stores of the spatial-block and leave-one-event-out folds;
BLOCK_OOF / EVENT_OOF: their out-of-fold predictions (``fold_table.py``'s oof_predictions.csv);
the fold runs: those with ``embeddings.npz`` (``fold_extras``). For every test tile of at least
``min_buildings`` buildings it says whether the tile is called unfamiliar by

- the embedding rule a model file carries (:mod:`runtime.familiarity`): the tile's median
  familiarity below the reference, which for a model trained on every tile is the rank among
  its training chips carried over from the block folds (:mod:`runtime.evaluation.out_of_fold`);
  each fold model is judged here with the same rank of its own training chips;
- a nearest-neighbour rule (Sun et al. 2022, "Out-of-distribution detection with deep nearest
  neighbors"): a chip's cosine similarity to its 10th nearest training chip in the unit
  embedding, the tile's median below the 0.1 quantile of the training chips' own (each left out
  of its neighbours);
- a confidence rule: the tile's mean top probability below the 0.1 quantile of the block
  folds' test tiles' (new areas of the training events).
"""

import argparse

import numpy as np
import pandas as pd

from data_prep.store import read_manifest
from runtime.evaluation.out_of_fold import fold_ranks
from runtime.familiarity import MIN_BUILDINGS, QUANTILE
from runtime.flags import class_prototypes, ood_scores

p = argparse.ArgumentParser()
p.add_argument("block_chips")
p.add_argument("block_oof")
p.add_argument("event_chips")
p.add_argument("event_oof")
p.add_argument("--block-folds", nargs="+", required=True)
p.add_argument("--event-folds", nargs="+", required=True)
args = p.parse_args()

ranks = fold_ranks(args.block_chips, args.block_folds, 4)
scene_rank = ranks["ranks"][1]
print(f"scene rank carried over from {len(args.block_folds)} block folds: {scene_rank:.4f}")
#: The neighbour whose similarity the nearest-neighbour rule reads.
NEIGHBOUR = 10


def unit(z):
    return z / np.linalg.norm(z, axis=1, keepdims=True)


def neighbour_similarity(test_z, train_z, leave_out=False):
    sims = unit(test_z) @ unit(train_z).T
    if leave_out:
        np.fill_diagonal(sims, -np.inf)
    return np.sort(sims, axis=1)[:, -NEIGHBOUR]


print("embedding rule (the model file's) and nearest-neighbour rule:")
for chips, runs in ((args.block_chips, args.block_folds), (args.event_chips, args.event_folds)):
    manifest = read_manifest(chips).set_index("chip_id")
    for run in runs:
        with np.load(f"{run}/embeddings.npz") as d:
            train_ids, train_z = d["train_ids"], d["train_z"].astype(np.float64)
            test_ids, test_z = d["test_ids"], d["test_z"].astype(np.float64)
        protos, _ = class_prototypes(train_z, manifest.loc[train_ids, "label"].to_numpy(int), 4)
        reference = np.quantile(ood_scores(train_z, protos), scene_rank)
        frame = pd.DataFrame(
            {
                "tile": manifest.loc[test_ids, "tile"].to_numpy(),
                "event": manifest.loc[test_ids, "event"].to_numpy(),
                "f": ood_scores(test_z, protos),
            }
        )
        frame["knn"] = neighbour_similarity(test_z, train_z)
        knn_reference = np.quantile(neighbour_similarity(train_z, train_z, True), QUANTILE)
        per = frame.groupby(["event", "tile"]).agg(
            median=("f", "median"), knn=("knn", "median"), size=("f", "size")
        )
        per = per[per["size"] >= MIN_BUILDINGS]
        for event, g in per.groupby(level=0):
            print(
                f"  {run}: {event}: {int((g['median'] < reference).sum())} of {len(g)} tiles "
                f"unfamiliar (reference {reference:.3f}; tile medians "
                f"{g['median'].min():.3f}-{g['median'].max():.3f}); nearest-neighbour rule "
                f"{int((g['knn'] < knn_reference).sum())} of {len(g)} (reference "
                f"{knn_reference:.3f}; tile medians {g['knn'].min():.3f}-{g['knn'].max():.3f})"
            )


def tiles(path):
    df = pd.read_csv(path)
    top = df[[c for c in df.columns if c.startswith("p_")]].max(axis=1)
    g = df.assign(top=top).groupby(["event", "tile"]).top.agg(["mean", "size"]).reset_index()
    return g[g["size"] >= MIN_BUILDINGS]


block, event = tiles(args.block_oof), tiles(args.event_oof)
reference = float(np.quantile(block["mean"], QUANTILE))
print(f"confidence rule: a tile is unsure below mean top probability {reference:.3f}")
for name, frame in (("new areas (block folds)", block), ("held-out events", event)):
    for ev, g in frame.groupby("event"):
        print(
            f"  {name}: {ev}: {int((g['mean'] < reference).sum())} of {len(g)} tiles "
            f"(tile means {g['mean'].min():.2f}-{g['mean'].max():.2f})"
        )
