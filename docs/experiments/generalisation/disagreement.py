"""Where a network's answers disagree, as a sign that a scene is new (generalisation.md, "Two
networks instead of one").

Two ways to make a network answer twice, and the divergence of the answers: the Jensen-Shannon
divergence of the probabilities (their mutual information, as for an ensemble's members:
Lakshminarayanan et al. 2017, "Simple and scalable predictive uncertainty estimation using deep
ensembles"):

- ``pair``: two networks (two recipes trained on the same tiles), from the ``predictions.csv``
  their cross-validation wrote; the first network's probabilities are the grades;
- ``tta``: one network under the eight turns and mirror images of each chip pair (the ``d8``
  views of ``score --tta``; overhead imagery has no up or down, so they show the same building;
  test-time augmentation as uncertainty: Ayhan and Berens 2018), with PyTorch on the CPU.

``compare`` groups buildings by tile (at least 5) and sets tiles of new areas of known events
(KNOWN: block folds, except Joplin's tiles in block fold 0, which no training tile of that fold
came from) against tiles of events the network never saw (UNSEEN).

    python docs/experiments/generalisation/disagreement.py pair RUN_A RUN_B OUT.csv
    python docs/experiments/generalisation/disagreement.py tta RUN CHIPS OUT.csv [IDS.csv]
    python docs/experiments/generalisation/disagreement.py compare KNOWN.csv... -- UNSEEN.csv...

``tta`` grades the chips of RUN's ``predictions.csv`` (its test fold; or of IDS.csv's ``chip_id``
column). Each writes per building the label, the disagreement ``js`` and the probabilities the
grades come from (``plain_*``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

from data_prep.spec import CLASS_NAMES as CLASSES

UNSEEN_IN_BLOCKS = "joplin-tornado"
MIN_BUILDINGS = 5


def entropy(p: np.ndarray) -> np.ndarray:
    return -(p * np.log(np.clip(p, 1e-12, 1.0))).sum(axis=-1)


def divergence(p: np.ndarray) -> np.ndarray:
    """``[N]`` Jensen-Shannon divergence of ``[N, M, K]`` probabilities over their M answers."""
    return entropy(p.mean(axis=1)) - entropy(p).mean(axis=1)


def predictions(run: str | Path) -> pd.DataFrame:
    path = Path(run) / "predictions.csv"
    if not path.is_file():
        sys.exit(f"{path}: not found; give a fold folder that `cv` (or `fold_extras`) wrote")
    return pd.read_csv(path).set_index("chip_id")


def pair(run_a: str, run_b: str, out: str) -> None:
    a, b = (predictions(r) for r in (run_a, run_b))
    if not a.index.sort_values().equals(b.index.sort_values()):
        sys.exit(f"{run_a} and {run_b} graded different buildings")
    b = b.loc[a.index]
    columns = [f"p_{c}" for c in CLASSES]
    p = np.stack([a[columns].to_numpy(np.float64), b[columns].to_numpy(np.float64)], axis=1)
    frame = pd.DataFrame({"chip_id": a.index, "label": a["label"].to_numpy()})
    frame["js"] = divergence(p)
    for k, c in enumerate(CLASSES):
        frame[f"plain_{c}"] = p[:, 0, k]
    written(frame, out)


def tta(run: str, chips: str, out: str, ids_from: str | None = None) -> None:
    import torch
    from torch.utils.data import DataLoader

    from local_damage.data import ChipPairDataset, normalize
    from local_damage.evaluation.torch_scorer import TorchScorer
    from runtime.predictor import TTA_VIEWS

    scorer = TorchScorer(run, device="cpu")
    ids = (pd.read_csv(ids_from) if ids_from else predictions(run).reset_index())[
        "chip_id"
    ].tolist()
    data = ChipPairDataset(Path(chips), ids, scorer.input_size)
    model = scorer.model
    probs = []  # [N, 8, K]
    with torch.inference_mode():
        for pre, post, _ in DataLoader(data, batch_size=128, shuffle=False):
            pre, post = normalize(pre), normalize(post)
            views = []
            for turns, mirrored in TTA_VIEWS["d8"]:  # NCHW here: as runtime.predictor.tta_view
                a = torch.rot90(pre, turns, dims=(2, 3))
                b = torch.rot90(post, turns, dims=(2, 3))
                if mirrored:
                    a, b = a.flip(3), b.flip(3)
                logits = model.predict(a.contiguous(), b.contiguous())[0]
                views.append(torch.softmax(logits.float(), dim=1).numpy())
            probs.append(np.stack(views, axis=1))
    p = np.concatenate(probs).astype(np.float64)
    frame = pd.DataFrame({"chip_id": list(data.chip_ids)})
    frame["label"] = data.labels
    frame["js"] = divergence(p)
    for k, c in enumerate(CLASSES):
        frame[f"plain_{c}"] = p[:, 0, k]
    written(frame, out)


def written(frame: pd.DataFrame, out: str) -> None:
    """Write ``frame`` to ``out`` and say what its disagreement is, per building and per tile."""
    frame.to_csv(out, index=False, float_format="%.6f")
    tiles = frame.groupby(frame["chip_id"].str.split(":").str[0])["js"].agg(["size", "mean"])
    tiles = tiles[tiles["size"] >= MIN_BUILDINGS]["mean"]
    print(
        f"{out}: {len(frame)} buildings, median disagreement {frame['js'].median():.4f}; "
        f"{len(tiles)} tiles of at least {MIN_BUILDINGS}: median {tiles.median():.4f}, "
        f"0.95 quantile {tiles.quantile(0.95):.4f}"
    )


def tiles_of(paths: list[str], unseen: bool) -> pd.DataFrame:
    parts = []
    for path in paths:
        f = pd.read_csv(path)
        f["tile"] = f["chip_id"].str.split(":").str[0]
        f["event"] = f["tile"].str.split("_").str[0]
        f["unseen"] = unseen | (f["event"] == UNSEEN_IN_BLOCKS)
        g = f[[f"plain_{c}" for c in CLASSES]].to_numpy().argmax(axis=1)
        f["right"] = g == f["label"].to_numpy()
        f["intact"] = f["label"] == 0
        f["alarm"] = f["intact"] & (g > 0)
        f["confidence"] = f[[f"plain_{c}" for c in CLASSES]].to_numpy().max(axis=1)
        f["source"] = Path(path).stem
        parts.append(f)
    return (
        pd.concat(parts)
        .groupby(["source", "event", "tile", "unseen"])
        .agg(
            buildings=("js", "size"),
            js=("js", "mean"),
            confidence=("confidence", "mean"),
            right=("right", "sum"),
            intact=("intact", "sum"),
            alarm=("alarm", "sum"),
        )
        .reset_index()
    )


def compare(known: list[str], unseen: list[str]) -> None:
    from sklearn.metrics import roc_auc_score

    tiles = pd.concat([tiles_of(known, False), tiles_of(unseen, True)])
    tiles = tiles[tiles["buildings"] >= MIN_BUILDINGS]
    flag = tiles["unseen"].to_numpy()
    ref = tiles[~flag]
    print(
        f"tiles of at least {MIN_BUILDINGS} buildings: {len(ref)} of new areas of known events, "
        f"{int(flag.sum())} of unseen events"
    )
    print(
        f"AUC, unseen against known tiles: disagreement "
        f"{roc_auc_score(flag, tiles['js']):.3f}, low mean top probability "
        f"{roc_auc_score(flag, -tiles['confidence']):.3f}\n"
    )
    print(
        "| threshold (quantile of the known tiles) | value | known tiles flagged | unseen tiles "
        "flagged, by event | accuracy (intact called damaged) of flagged / other unseen tiles |"
    )
    print("|---|---|---|---|---|")
    for q in (0.90, 0.95):
        t = float(ref["js"].quantile(q))
        new = tiles[tiles["unseen"]]
        by_event = new.groupby("event")["js"].apply(lambda v, t=t: f"{int((v > t).sum())}/{len(v)}")
        text = ", ".join(f"{e} {v}" for e, v in by_event.to_dict().items())

        def grades(sub: pd.DataFrame) -> str:
            if not len(sub):
                return "-"
            return (
                f"{sub['right'].sum() / sub['buildings'].sum():.3f} "
                f"({sub['alarm'].sum() / max(sub['intact'].sum(), 1):.1%})"
            )

        print(
            f"| {q:.2f} | {t:.4f} | {int((ref['js'] > t).sum())}/{len(ref)} | {text} | "
            f"{grades(new[new['js'] > t])} / {grades(new[new['js'] <= t])} |"
        )
    print("\nmedian disagreement per tile:")
    print(tiles.groupby(["source", "event"])["js"].agg(["count", "median"]).round(4).to_string())


def main(argv: list[str]) -> None:
    if argv[:1] == ["pair"] and len(argv) == 4:
        pair(*argv[1:])
    elif argv[:1] == ["tta"] and len(argv) in (4, 5):
        tta(*argv[1:])
    elif argv[:1] == ["compare"] and "--" in argv:
        cut = argv.index("--")
        compare(argv[1:cut], argv[cut + 1 :])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
