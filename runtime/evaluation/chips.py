"""Which chips of a store a model is evaluated or calibrated on: the labelled chips of one fold
of its splits (or all of them), and whether the store was cut as the model expects.

Shared by :mod:`runtime.evaluation.evaluate` and :mod:`runtime.evaluation.calibrate`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from data_prep.spec import ChipSpec
from data_prep.split import SPLITS, fold_indices
from data_prep.store import read_manifest, read_meta
from runtime.evaluation.scorers import EvaluationError, Scorer

log = logging.getLogger(__name__)


def select_chips(chips: str | Path, fold: int | None = None) -> tuple[list[str], str, int]:
    """The labelled chips to evaluate, in manifest order.

    Args:
        chips: chip store folder.
        fold: evaluate the chips of this fold of ``splits.csv``; None: every labelled chip.

    Returns:
        ``(chip_ids, description, unlabelled)``: the ids, a short description of the selection
        and the number of unlabelled chips left out.

    Raises:
        EvaluationError: no manifest; ``fold`` given and the store has no splits.csv, or it is
            not one of its folds; the selection holds no labelled chip.
    """
    chips = Path(chips)
    try:
        frame = read_manifest(chips)
    except FileNotFoundError as exc:
        raise EvaluationError(str(exc)) from exc
    if fold is not None:
        if not (chips / SPLITS).is_file():
            raise EvaluationError(
                f"{chips / SPLITS}: no splits, so --fold {fold} has no meaning; run "
                f"`local-damage split {chips}` first, or leave out --fold to use every chip"
            )
        try:
            wanted = set(fold_indices(chips, fold)[1])
        except (FileNotFoundError, ValueError) as exc:  # an unknown fold, a stale splits.csv
            raise EvaluationError(str(exc)) from exc
        frame = frame[frame["chip_id"].isin(wanted)]
        description = f"fold {fold} of {chips / SPLITS}"
    else:
        description = f"all labelled chips of {chips} (no --fold given)"
    labelled = frame[frame["label"] >= 0]
    if labelled.empty:
        raise EvaluationError(
            f"{chips}: no labelled chips in {description}"
            + (f" ({len(frame)} unlabelled)" if len(frame) else "")
        )
    return labelled["chip_id"].tolist(), description, int(len(frame) - len(labelled))


def store_folds(chips: str | Path) -> list[int]:
    """The folds of ``chips/splits.csv``, sorted.

    Raises:
        EvaluationError: the store has no splits.csv.
    """
    import pandas as pd

    path = Path(chips) / SPLITS
    if not path.is_file():
        raise EvaluationError(
            f"{path}: no splits, so prototype folds have no meaning; run `local-damage split "
            f"{chips}` first"
        )
    return sorted(int(f) for f in pd.read_csv(path, usecols=["fold"])["fold"].unique())


def warn_spec_mismatch(scorer: Scorer, chips: str | Path) -> None:
    """Warn (log) when the store was cut with another chip spec than the model's."""
    store_spec = read_meta(chips).get("spec")
    if scorer.spec is not None and store_spec and ChipSpec.from_dict(store_spec) != scorer.spec:
        log.warning(
            f"warning: {chips} was cut with chip spec {store_spec}, the model with "
            f"{scorer.spec.to_dict()}: scores may not reflect the model"
        )
