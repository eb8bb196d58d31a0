"""The never-worse rule: when an adapted model replaces the base model, judged on the
cross-validation of the analyst's labels (no torch). Shared by the adapted heads
(:mod:`app.adapt.fit`) and fine-tuning (:mod:`local_damage.adapt.finetune`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from data_prep.spec import CLASS_NAMES
from runtime.grading import NO_DAMAGE

#: Class id of no-damage, whose recall the rule guards (intact buildings called damaged).
INTACT = CLASS_NAMES.index(NO_DAMAGE)

#: A candidate replaces the base model only when its cross-validated NLL is lower than the base
#: model's by more than this many nats per label...
NEAR_TIE_NATS = 0.01
#: ...and by more than this many standard errors of the paired per-label difference, and its
#: cross-validated macro-F1 is above the base model's (for fine-tuning, by more than this many
#: bootstrap standard errors of the paired difference): near-ties go to the base model.
NEAR_TIE_SE = 2.0
#: Resamples of the labels for the standard error of the macro-F1 gain (fixed seed: the same
#: labels and predictions always get the same verdict).
BOOTSTRAP = 1000
#: The rule in words, recorded in the metadata of the heads' adapted models.
RULE = (
    "the base model unless a candidate's cross-validated negative log-likelihood (nats) of the "
    f"given labels is lower by more than {NEAR_TIE_NATS} and by more than {NEAR_TIE_SE:g} "
    "standard errors of the paired per-label difference, with a cross-validated macro-F1 above "
    "the base model's and a cross-validated accuracy and recall of intact (no-damage) buildings "
    "no lower than the base model's; among those, the lowest NLL (ties to the simpler candidate)"
)
#: What fine-tuning must show besides: a macro-F1 gain clear of its spread.
SPREAD = (
    f"an out-of-fold macro-F1 higher than the base model's by more than {NEAR_TIE_SE:g} "
    "bootstrap standard errors of the paired difference (over the labels)"
)
#: The rule of fine-tuning: :data:`RULE` and :data:`SPREAD`.
FINETUNE_RULE = f"{RULE.split('; among those')[0]}, and {SPREAD}"


@dataclass(frozen=True)
class OutOfFold:
    """A model's cross-validated figures on the given labels.

    Attributes:
        losses: ``[N]`` out-of-fold NLL of each label (nats).
        macro_f1: the cross-validated macro-F1 as the caller reports it.
        accuracy: cross-validated accuracy (None: not checked).
        intact: the share of the no-damage labels graded no-damage (None: no such label).
        pred: ``[N]`` out-of-fold class ids (None: the macro-F1 gain's spread is not checked).
    """

    losses: np.ndarray
    macro_f1: float
    accuracy: float | None = None
    intact: float | None = None
    pred: np.ndarray | None = None


class Verdict(NamedTuple):
    """Whether a candidate beats the base model clearly, and the figures that say so."""

    clear: bool
    #: mean NLL saved per label (nats) and its standard error
    gain: float
    gain_se: float
    #: out-of-fold macro-F1 gain (pooled over the folds) and its bootstrap standard error; None
    #: when no predictions were given
    f1_gain: float | None = None
    f1_gain_se: float | None = None

    def figures(self) -> dict[str, float | bool | None]:
        """The verdict as rounded JSON-ready figures (``clear``, ``gain``, ``gain_se``, ...)."""
        out: dict[str, float | bool | None] = {"gain": round(self.gain, 6)}
        out["gain_se"] = round(self.gain_se, 6)
        if self.f1_gain is not None:
            out["f1_gain"] = round(self.f1_gain, 6)
            out["f1_gain_se"] = round(float(self.f1_gain_se or 0.0), 6)
        out["clear"] = self.clear
        return out


def gain(base_losses: np.ndarray, losses: np.ndarray) -> tuple[float, float]:
    """``(mean, standard error)`` of the per-label NLL a candidate saves over the base model
    (``[N]`` out-of-fold losses each, nats)."""
    diff = np.asarray(base_losses, np.float64) - np.asarray(losses, np.float64)
    se = float(diff.std(ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else 0.0
    return float(diff.mean()) if len(diff) else 0.0, se


def _macro_f1(weights: np.ndarray, y: np.ndarray, pred: np.ndarray, classes) -> np.ndarray:
    """Macro-F1 over ``classes`` of each row of label ``weights`` ``[B, N]`` (a class with no
    true and no predicted label in a resample counts 0 for both models alike)."""
    f1 = []
    for c in classes:
        t, p = y == c, pred == c
        tp = weights @ (t & p)
        wrong = weights @ (t ^ p)
        den = 2 * tp + wrong
        f1.append(np.where(den > 0, 2 * tp / np.maximum(den, 1e-12), 0.0))
    return np.mean(f1, axis=0)


@lru_cache(maxsize=4)
def _resamples(n: int, seed: int) -> np.ndarray:
    """``[BOOTSTRAP, n]`` counts of each label in each resample (read-only; the candidates of
    one adaptation share them)."""
    rng = np.random.default_rng(seed)
    w = rng.multinomial(n, np.full(n, 1.0 / n), size=BOOTSTRAP).astype(np.float64)
    w.flags.writeable = False
    return w


def macro_f1_gain(
    labels: np.ndarray, base_pred: np.ndarray, pred: np.ndarray, seed: int = 0
) -> tuple[float, float]:
    """``(gain, standard error)``: the candidate's macro-F1 over the classes present in
    ``labels`` minus the base model's, on the same labels, and the spread of that difference
    over :data:`BOOTSTRAP` resamples of the labels (paired: both models on the same resample)."""
    y = np.asarray(labels)
    if len(y) == 0:
        return 0.0, 0.0
    base_pred, pred = np.asarray(base_pred), np.asarray(pred)
    classes = sorted({int(v) for v in y})
    ones = np.ones((1, len(y)))
    g = float((_macro_f1(ones, y, pred, classes) - _macro_f1(ones, y, base_pred, classes))[0])
    w = _resamples(len(y), seed)
    diff = _macro_f1(w, y, pred, classes) - _macro_f1(w, y, base_pred, classes)
    return g, float(diff.std(ddof=1))


def clearly_better(
    base: OutOfFold, candidate: OutOfFold, labels: np.ndarray | None = None
) -> Verdict:
    """Whether ``candidate`` beats ``base`` clearly on the cross-validation (:data:`RULE`; with
    ``labels`` and both models' ``pred``, :data:`FINETUNE_RULE`).

    A lower NLL and a higher macro-F1 are not enough when the candidate's cross-validated
    accuracy, or its recall of intact buildings, falls below the base model's: on a new event a
    head can win on NLL and macro-F1 by calling many intact buildings damaged, which is what
    makes a damage map useless. With ``labels`` and both models' out-of-fold ``pred``, nor is a
    macro-F1 gain that the draw of the labels could make by chance: the gain must stand clear of
    its bootstrap spread (on Hurricane Michael, 100-500 labels let a fine-tuned network win on
    NLL and on macro-F1 over the labels while it gave up the middle grades of the other
    buildings).
    """
    g, se = gain(base.losses, candidate.losses)
    ok = g > NEAR_TIE_NATS and g > NEAR_TIE_SE * se and candidate.macro_f1 > base.macro_f1
    if base.accuracy is not None and candidate.accuracy is not None:
        ok = ok and candidate.accuracy >= base.accuracy
    if base.intact is not None and candidate.intact is not None:
        ok = ok and candidate.intact >= base.intact
    f1_gain = f1_se = None
    if labels is not None and base.pred is not None and candidate.pred is not None:
        f1_gain, f1_se = macro_f1_gain(labels, base.pred, candidate.pred)
        ok = ok and f1_gain > NEAR_TIE_SE * f1_se
    return Verdict(bool(ok), g, se, f1_gain, f1_se)
