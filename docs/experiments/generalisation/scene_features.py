"""A scene signal from the encoder's pooled features (before the projection head), measured on a
block fold model and a leave-one-event-out model of the general recipe:

    python docs/experiments/generalisation/scene_features.py \
        --run work/cpu-gen/runs/block-general/fold0 work/cpu-gen/block \
        --run work/cpu-loeo/runs/loeo-general/fold4 work/all5/events64

Each run needs ``embeddings.npz`` (``fold_extras``): its 2,000 training chips and its test chips.
For each chip the pooled last feature map of the pre image, of the post image and both
(512 + 512, what the classifier reads) is computed with PyTorch; per test tile of at least 10
buildings the median of two scores is compared with the training chips':

- nearest neighbour (Sun et al. 2022): cosine to the 10th nearest training chip, the tile
  unfamiliar below the training chips' 0.1 quantile (each chip left out of its neighbours);
- Mahalanobis (Lee et al. 2018) with a Ledoit-Wolf covariance of the training chips, the tile
  unfamiliar above the training chips' 0.9 quantile. The training chips' own distances are
  in-sample, so compare the tiles' ranges across runs rather than the counts.
"""

import argparse

import numpy as np
import pandas as pd
import torch
from sklearn.covariance import LedoitWolf
from torch.utils.data import DataLoader

from data_prep.store import read_manifest
from local_damage.data import ChipPairDataset, normalize
from local_damage.evaluation.torch_scorer import TorchScorer

NEIGHBOUR = 10
PARTS = {"pre": slice(0, 512), "post": slice(512, 1024), "both": slice(0, 1024)}


def pooled_features(scorer, chips, ids):
    model, out = scorer.model, []
    loader = DataLoader(ChipPairDataset(chips, list(ids), scorer.input_size), batch_size=128)
    with torch.inference_mode():
        for pre, post, _ in loader:
            f_pre, f_post = model.encode_pair(normalize(pre), normalize(post))
            out.append(torch.cat([f_pre[-1].mean((2, 3)), f_post[-1].mean((2, 3))], 1).numpy())
    return np.concatenate(out).astype(np.float64)


def unit(a):
    return a / np.linalg.norm(a, axis=1, keepdims=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", nargs=2, action="append", metavar=("RUN", "CHIPS"), required=True)
    args = ap.parse_args()
    for run, chips in args.run:
        manifest = read_manifest(chips).set_index("chip_id")
        with np.load(f"{run}/embeddings.npz") as d:
            train_ids, test_ids = d["train_ids"], d["test_ids"]
        scorer = TorchScorer(run, device="cpu")
        train_f = pooled_features(scorer, chips, train_ids)
        test_f = pooled_features(scorer, chips, test_ids)
        for part, cols in PARTS.items():
            tr, te = train_f[:, cols], test_f[:, cols]
            sims = unit(tr) @ unit(tr).T
            np.fill_diagonal(sims, -np.inf)
            knn_train = np.sort(sims, 1)[:, -NEIGHBOUR]
            knn_test = np.sort(unit(te) @ unit(tr).T, 1)[:, -NEIGHBOUR]
            cov = LedoitWolf().fit(tr)
            maha_train, maha_test = cov.mahalanobis(tr), cov.mahalanobis(te)
            frame = pd.DataFrame(
                {
                    "event": manifest.loc[test_ids, "event"].to_numpy(),
                    "tile": manifest.loc[test_ids, "tile"].to_numpy(),
                    "knn": knn_test,
                    "maha": maha_test,
                }
            )
            per = frame.groupby(["event", "tile"]).agg(
                knn=("knn", "median"), maha=("maha", "median"), n=("knn", "size")
            )
            per = per[per["n"] >= 10]
            knn_ref, maha_ref = np.quantile(knn_train, 0.1), np.quantile(maha_train, 0.9)
            print(
                f"{run} [{part}]: neighbour reference {knn_ref:.3f} (training median "
                f"{np.median(knn_train):.3f}); Mahalanobis reference {maha_ref:.0f} (training "
                f"median {np.median(maha_train):.0f})"
            )
            for event, g in per.groupby(level=0):
                print(
                    f"  {event}: neighbour {int((g['knn'] < knn_ref).sum())} of {len(g)} tiles "
                    f"({g['knn'].min():.3f}-{g['knn'].max():.3f}); Mahalanobis "
                    f"{int((g['maha'] > maha_ref).sum())} of {len(g)} "
                    f"({g['maha'].min():.0f}-{g['maha'].max():.0f})"
                )


if __name__ == "__main__":
    main()
