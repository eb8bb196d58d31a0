"""The never-worse rule: when an adapted model replaces the base model, judged on the
cross-validation of the analyst's labels (no torch). Shared by the adapted heads
(:mod:`app.adapt.fit`) and fine-tuning (:mod:`local_damage.adapt.finetune`)."""

from __future__ import annotations

import math

import numpy as np

from data_prep.spec import CLASS_NAMES
from runtime.grading import NO_DAMAGE

#: Class id of no-damage, whose recall the rule guards (intact buildings called damaged).
INTACT = CLASS_NAMES.index(NO_DAMAGE)

#: A candidate replaces the base model only when its cross-validated NLL is lower than the base
#: model's by more than this many nats per label...
NEAR_TIE_NATS = 0.01
#: ...and by more than this many standard errors of the paired per-label difference, and its
#: cross-validated macro-F1 is above the base model's: near-ties go to the base model.
NEAR_TIE_SE = 2.0
#: The rule in words, recorded in the metadata of adapted models.
RULE = (
    "the base model unless a candidate's cross-validated negative log-likelihood (nats) of the "
    f"given labels is lower by more than {NEAR_TIE_NATS} and by more than {NEAR_TIE_SE:g} "
    "standard errors of the paired per-label difference, with a cross-validated macro-F1 above "
    "the base model's and a cross-validated accuracy and recall of intact (no-damage) buildings "
    "no lower than the base model's; among those, the lowest NLL (ties to the simpler candidate)"
)


def gain(base_losses: np.ndarray, losses: np.ndarray) -> tuple[float, float]:
    """``(mean, standard error)`` of the per-label NLL a candidate saves over the base model
    (``[N]`` out-of-fold losses each, nats)."""
    diff = np.asarray(base_losses, np.float64) - np.asarray(losses, np.float64)
    se = float(diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else 0.0
    return float(diff.mean()) if len(diff) else 0.0, se


def clearly_better(
    base_losses: np.ndarray,
    losses: np.ndarray,
    base_macro_f1: float,
    macro_f1: float,
    *,
    base_accuracy: float | None = None,
    accuracy: float | None = None,
    base_intact: float | None = None,
    intact: float | None = None,
) -> tuple[bool, float, float]:
    """``(clear, gain, gain_se)``: whether a candidate beats the base model clearly (:data:`RULE`).

    A lower NLL and a higher macro-F1 are not enough when the candidate's cross-validated
    accuracy, or its recall of intact buildings (``intact``: the share of the no-damage labels it
    grades no-damage; None when no label is no-damage), falls below the base model's: on a new
    event a head can win on NLL and macro-F1 by calling many intact buildings damaged, which is
    what makes a damage map useless.
    """
    g, se = gain(base_losses, losses)
    ok = g > NEAR_TIE_NATS and g > NEAR_TIE_SE * se and macro_f1 > base_macro_f1
    if base_accuracy is not None and accuracy is not None:
        ok = ok and accuracy >= base_accuracy
    if base_intact is not None and intact is not None:
        ok = ok and intact >= base_intact
    return bool(ok), g, se
