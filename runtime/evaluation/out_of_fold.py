"""Calibrating a model trained on every labelled chip from its recipe's cross-validation.

A model trained on every labelled chip has no chips it never saw to fit its temperature and its
``ood`` threshold on: on its own training chips a network is more confident, and its embeddings
sit closer to its class prototypes, than on new imagery. Its recipe's cross-validation has what
it lacks, since every fold's model graded areas it never saw:

- **temperature**: fitted on the out-of-fold logits of the cross-validation
  (``oof_predictions.csv`` of ``local-damage cv``, or of the fold table that pools its folds),
  the same recipe's predictions on areas it never saw. It is stored in the model, and applied
  only when asked (``temperature=True``): a temperature that helps on new areas of the training
  events can harm on a new event (docs/experiments/generalisation.md).
- **ood threshold and scene reference**: the threshold of :mod:`runtime.evaluation.calibrate` is
  the 0.01 quantile of held-out chips' familiarity (largest cosine to a class prototype), the
  scene reference its 0.1 quantile (:mod:`runtime.familiarity`). For each fold's model with
  embeddings (``embeddings.npz`` of ``local_damage.experiments.fold_extras``: its test chips and
  a sample of its training chips) the *rank* of those quantiles among its own training chips is
  measured: the share of its training chips that score below the test chips' 0.01 (0.1)
  quantile. The full model's threshold and reference are the same ranks (means over the folds)
  of its own training chips' familiarity, so it flags about the share of unseen chips that the
  folds' models flagged on theirs.

No torch: it runs on a scoring machine like ``local-damage calibrate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from data_prep.store import read_manifest
from runtime import familiarity, flags
from runtime.calibration import METADATA_KEY, CalibrationError, calibration_block, fit_temperature
from runtime.contract import save_onnx, set_metadata
from runtime.evaluation.calibrate import OOD_QUANTILE, rounded_metrics
from runtime.evaluation.chips import select_chips, warn_spec_mismatch
from runtime.evaluation.scorers import OnnxScorer
from runtime.flags import class_prototypes, ood_block, ood_scores
from runtime.metrics import calibration_metrics
from runtime.predictor import softmax

#: The file of a fold's embeddings (written by ``fold_extras``).
EMBEDDINGS = "embeddings.npz"


def check_inputs(oof_predictions: str | Path, fold_runs: Sequence[str | Path]) -> None:
    """Fail before any work when the out-of-fold predictions or a fold's embeddings are missing.

    Raises:
        CalibrationError: naming the missing file.
    """
    _check_oof(Path(oof_predictions))
    _check_folds(fold_runs)


def _check_oof(path: Path) -> None:
    if not path.is_file():
        raise CalibrationError(f"{path}: no out-of-fold predictions there (oof_predictions.csv)")


def _check_folds(fold_runs: Sequence[str | Path]) -> None:
    if not fold_runs:
        raise CalibrationError("no fold runs to carry the ood threshold over from")
    for run in map(Path, fold_runs):
        if not (run / EMBEDDINGS).is_file():
            raise CalibrationError(
                f"{run / EMBEDDINGS}: no fold embeddings; `python -m "
                f"local_damage.experiments.fold_extras {run} CHIPS FOLD` writes them"
            )


def read_oof_logits(path: str | Path, class_names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(logits [N, K], labels [N])`` of an ``oof_predictions.csv``, columns in the model's class
    order.

    Raises:
        CalibrationError: no such file, or it lacks the ``label`` column or a ``logit_<class>``
            column of one of ``class_names``, or holds no row.
    """
    path = Path(path)
    _check_oof(path)
    df = pd.read_csv(path)
    wanted = ["label", *(f"logit_{name}" for name in class_names)]
    missing = [c for c in wanted if c not in df.columns]
    if missing:
        raise CalibrationError(
            f"{path}: no column(s) {', '.join(missing)}; out-of-fold predictions of `local-damage "
            "cv` carry each class's logit"
        )
    if df.empty:
        raise CalibrationError(f"{path}: no out-of-fold predictions in it")
    logits = df[wanted[1:]].to_numpy(dtype=np.float64)
    return logits, df["label"].to_numpy(dtype=np.int64)


def fold_ranks(
    chips: str | Path,
    fold_runs: Sequence[str | Path],
    n_classes: int,
    quantiles: Sequence[float] = (OOD_QUANTILE, familiarity.QUANTILE),
) -> dict[str, Any]:
    """The rank among its own training chips of each quantile of a fold model's test chips'
    familiarity (module doc), per fold and averaged.

    Args:
        chips: the chip store the folds were cut from (it gives the labels of the chips).
        fold_runs: fold run folders, each with ``embeddings.npz``.
        n_classes: the number of classes of the model.
        quantiles: the test-chip quantiles to carry over.

    Returns:
        ``{"quantiles", "ranks", "folds"}``: ``ranks[i]`` the mean over folds of the rank of
        ``quantiles[i]``, and per fold its run, chip counts and ranks.

    Raises:
        CalibrationError: no fold run, a run without embeddings, or chips not in the store.
    """
    _check_folds(fold_runs)
    labels = read_manifest(chips).set_index("chip_id")["label"]
    folds = []
    for run in map(Path, fold_runs):
        path = run / EMBEDDINGS
        with np.load(path) as data:
            train_ids, train_z = data["train_ids"], data["train_z"].astype(np.float64)
            test_z = data["test_z"].astype(np.float64)
        unknown = [i for i in train_ids if i not in labels.index]
        if unknown:
            raise CalibrationError(
                f"{path}: {len(unknown)} training chip(s) not in {chips} (e.g. {unknown[0]}); give "
                "the chip store the folds were cut from"
            )
        y = labels.loc[train_ids].to_numpy()
        keep = ~pd.isna(y)
        protos, _ = class_prototypes(train_z[keep], y[keep].astype(np.int64), n_classes)
        own, held = ood_scores(train_z[keep], protos), ood_scores(test_z, protos)
        ranks = [float(np.mean(own < np.quantile(held, q))) for q in quantiles]
        folds.append(
            {"run": str(run), "n_train": int(keep.sum()), "n_test": len(held), "ranks": ranks}
        )
    mean = np.mean([f["ranks"] for f in folds], axis=0)
    return {"quantiles": list(quantiles), "ranks": [float(r) for r in mean], "folds": folds}


def calibrate_from_folds(
    model: str | Path,
    chips: str | Path,
    out: str | Path,
    oof_predictions: str | Path,
    fold_runs: Sequence[str | Path],
    temperature: bool = False,
    batch_size: int = 64,
    progress: bool = False,
) -> dict[str, Any]:
    """Calibrate a model trained on every labelled chip of ``chips`` from its recipe's
    cross-validation (module doc) and write it to ``out`` (temporary name, then renamed).

    Args:
        model: the exported model (``local-damage export``).
        chips: its training chip store: the class prototypes are the mean embedding of each
            class over its labelled chips, and the threshold a rank of their familiarity.
        out: the ``.onnx`` file to write (may be ``model``).
        oof_predictions: the cross-validation's ``oof_predictions.csv`` (temperature).
        fold_runs: fold run folders with ``embeddings.npz`` (threshold and scene reference).
        temperature: apply the fitted temperature; False records it and keeps the raw
            probabilities.
        batch_size: chip pairs per ONNX Runtime call.
        progress: show a progress bar.

    Returns:
        ``{"calibration": block, "ood": block}`` as stored in the model.

    Raises:
        CalibrationError: ``out`` does not end in .onnx, or a missing or malformed input.
    """
    import onnx

    model, chips, out = Path(model), Path(chips), Path(out)
    if out.suffix != ".onnx":
        raise CalibrationError(f"{out}: the model file name must end in .onnx")
    check_inputs(oof_predictions, fold_runs)
    scorer = OnnxScorer(model)
    names = list(scorer.class_names)
    logits, y_oof = read_oof_logits(oof_predictions, names)
    ranks = fold_ranks(chips, fold_runs, len(names))
    warn_spec_mismatch(scorer, chips)
    chip_ids, description, unlabelled = select_chips(chips, None)
    scored = scorer.score(chips, chip_ids, views=1, batch_size=batch_size, progress=progress)

    try:
        fitted_t = fit_temperature(logits, y_oof)
    except ValueError as exc:
        raise type(exc)(f"{oof_predictions}: {exc}") from exc
    calibration = calibration_block(
        fitted_t,
        fitted_on={
            "chips": str(oof_predictions),
            "fold": None,
            "selection": "out-of-fold predictions of the recipe's cross-validation",
            "n": len(y_oof),
        },
        before=rounded_metrics(calibration_metrics(softmax(logits), y_oof)),
        after=rounded_metrics(calibration_metrics(softmax(logits / fitted_t), y_oof)),
        applied=temperature,
    )

    protos, classes = class_prototypes(scored.z, scored.labels, len(names))
    own = ood_scores(scored.z, protos)
    ood_rank, scene_rank = ranks["ranks"]
    threshold = float(np.quantile(own, ood_rank))
    carried = {
        "chips": str(chips),
        "fold": None,
        "n": len(own),
        "selection": f"{description}, the model's training chips",
        "unlabelled_left_out": unlabelled,
        "rank_from_folds": ranks,
        "flagged": round(float(np.mean(own < threshold)), 6),
    }
    q = familiarity.QUANTILE
    scene = {
        **familiarity.scene_reference(own),
        "familiarity": float(np.quantile(own, scene_rank)),
        "training_rank": round(scene_rank, 6),
        "rule": (
            f"a scene of at least {familiarity.MIN_BUILDINGS} scored buildings is unfamiliar when "
            f"their median familiarity (largest cosine to a class prototype) is below the {q:g} "
            f"quantile of held-out buildings', carried over from the folds' models as the "
            f"{scene_rank:.4f} quantile of this model's training buildings"
        ),
        "fitted_on": {"chips": str(chips), "selection": carried["selection"], "n": len(own)},
    }
    ood = ood_block(
        protos,
        threshold,
        [names[c] for c in classes],
        OOD_QUANTILE,
        prototypes_from={
            "chips": str(chips),
            "folds": None,
            "selection": f"{description}, the model's training chips",
            "n": {names[c]: int((scored.labels == c).sum()) for c in classes},
        },
        threshold_from=carried,
        scene=scene,
    )
    proto = onnx.load(str(model))
    set_metadata(proto, {METADATA_KEY: calibration, flags.METADATA_KEY: ood})
    save_onnx(proto, out)
    return {"calibration": calibration, "ood": ood}
