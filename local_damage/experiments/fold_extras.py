"""What a cross-validation fold's run gives beside its test figures: the training-set figures
(the gap between them and the test figures shows memorisation) and the embeddings of both sets
(for a scene-level signal of imagery unlike the training data, measured on unseen areas and
events).

    python -m local_damage.experiments.fold_extras RUN CHIPS FOLD [--train-sample N]

writes ``RUN/train_eval/`` (metrics.json and predictions.csv of up to N training chips, drawn
with a fixed seed) and ``RUN/embeddings.npz`` (``test_ids``, ``test_z``, ``train_ids``,
``train_z``: the unit-norm ``z`` in float16, manifest order).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from data_prep.split import fold_indices
from local_damage.evaluation.torch_scorer import TorchScorer
from runtime.evaluation.evaluate import EvaluationOptions, evaluate

TRAIN_EVAL = "train_eval"
EMBEDDINGS = "embeddings.npz"


def fold_extras(run: str | Path, chips: str | Path, fold: int, train_sample: int = 2000) -> dict:
    """Score a fold's run on a sample of its training chips and keep both sets' embeddings.

    Returns:
        The training-sample metrics (as ``evaluate`` returns them).
    """
    run = Path(run)
    train_ids, test_ids = fold_indices(chips, fold)
    rng = np.random.default_rng(0)
    if len(train_ids) > train_sample:
        keep = np.sort(rng.choice(len(train_ids), train_sample, replace=False))
        train_ids = [train_ids[i] for i in keep]
    scorer = TorchScorer(run)
    options = EvaluationOptions(views=1, tsne=False, batch_size=256)
    metrics = evaluate(scorer, chips, train_ids, run / TRAIN_EVAL, options)
    test = scorer.score(chips, test_ids, views=1, batch_size=256)
    train = scorer.score(chips, train_ids, views=1, batch_size=256)
    np.savez_compressed(
        run / EMBEDDINGS,
        test_ids=np.asarray(test.chip_ids, dtype=str),
        test_z=test.z.astype(np.float16),
        train_ids=np.asarray(train.chip_ids, dtype=str),
        train_z=train.z.astype(np.float16),
    )
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m local_damage.experiments.fold_extras")
    parser.add_argument("run")
    parser.add_argument("chips")
    parser.add_argument("fold", type=int)
    parser.add_argument("--train-sample", type=int, default=2000)
    args = parser.parse_args(argv)
    metrics = fold_extras(args.run, args.chips, args.fold, args.train_sample)
    print(
        f"{args.run}: training sample accuracy {metrics['accuracy']:.3f}, "
        f"macro-F1 {metrics['macro_f1']:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
