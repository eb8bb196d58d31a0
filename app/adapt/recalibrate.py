"""The probabilities of an adapted model recalibrated on the new event's own labels (no torch).

On a disaster it never saw, a model can be over-confident by a wide margin: the bundled recipe
trained without Hurricane Michael grades it at accuracy 0.57 with ECE 0.24 (its oracle temperature
is 2.6), where its tile folds, like the imagery it trained on, asked for a temperature of about
1.4. A temperature fitted on the seen events does not hold on a new one;
one fitted on a few labels of the new event does (docs/experiments/generalisation.md). So
``adapt`` (heads and fine-tuning alike) fits temperature scaling (Guo et al. 2017;
:func:`runtime.calibration.fit_temperature`) on the labels it was given:

- on **out-of-fold** log-probabilities of the model it kept: the head's cross-validation, or
  fine-tuning's at the kept epoch (the base model's own log-probabilities when it was kept; no
  label shaped them), so the labels were not used to make the probabilities they calibrate;
- kept when it **softens** (``T > 1``: a few labels may show that the model is over-confident
  on the event) from at least :data:`MIN_LABELS` labels, or when it **sharpens** (``T < 1``) from
  at least :data:`MIN_SHARPEN_LABELS`, and in both cases only when its **cross-fitted** NLL
  (``T`` fitted on four fifths of the labels, judged on the fifth, :data:`FOLDS` folds) beats the
  probabilities as they are clearly, by the rule of :func:`runtime.selection.gain`
  (:data:`runtime.selection.NEAR_TIE_NATS` and :data:`runtime.selection.NEAR_TIE_SE`).
  Sharpening asks for more labels because a few labels that the model happens to get right call
  for it by chance: on the tile folds' predictions, which are calibrated, a rule that sharpened
  from 50 labels made 2 of 40 draws worse (ECE 0.016 to 0.057), and none from 100. A new event
  can need either: Hurricane Michael asks the general recipe for ``T`` 1.3, the Santa Rosa
  wildfire for ``T`` 0.23 (its probabilities far too soft: mean top probability 0.40 at accuracy
  0.77) (docs/experiments/generalisation.md).

The temperature divides the kept model's scores (the ``calibration`` prop the adapted model
carries; :class:`runtime.predictor.Predictor` applies it), so every grade is unchanged: only the
probabilities, the confidence flags read from them, and what an analyst can trust them for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from runtime.calibration import CalibrationError, fit_temperature
from runtime.head import log_softmax
from runtime.metrics.calibration import expected_calibration_error
from runtime.selection import NEAR_TIE_NATS, NEAR_TIE_SE, gain

#: Fewer labels than this: the probabilities are kept as they are.
MIN_LABELS = 10
#: Fewer labels than this: a temperature that would sharpen the probabilities is not taken.
MIN_SHARPEN_LABELS = 100
#: Folds of the cross-fitting that judges the temperature.
FOLDS = 5


@dataclass(frozen=True)
class Recalibration:
    """The temperature ``adapt`` fitted on the labels, and whether the adapted model applies it.

    Attributes:
        temperature: what the adapted model divides its scores by (1: kept as they were).
        fitted: the temperature fitted on every label (None: no fit had an interior optimum,
            or too few labels).
        kept: whether ``temperature`` is ``fitted``.
        why: the reason, in words.
        n: the labels.
        nll: the cross-fitted mean NLL per label ``(as they are, recalibrated)``.
        ece: the cross-fitted ECE ``(as they are, recalibrated)``.
        gain, gain_se: the mean NLL gain per label and its standard error.
    """

    temperature: float
    fitted: float | None
    kept: bool
    why: str
    n: int
    nll: tuple[float, float] | None = None
    ece: tuple[float, float] | None = None
    gain: float | None = None
    gain_se: float | None = None

    def to_dict(self) -> dict:
        """The ``recalibration`` member of the ``adaptation`` block."""
        out = asdict(self)
        for key in ("nll", "ece"):
            if out[key] is not None:
                out[key] = [round(float(v), 6) for v in out[key]]
        for key in ("temperature", "fitted", "gain", "gain_se"):
            if out[key] is not None:
                out[key] = round(float(out[key]), 6)
        return out


def _fit(scores: np.ndarray, y: np.ndarray) -> float | None:
    try:
        return fit_temperature(scores, y)
    except CalibrationError:  # separable labels, or scores that say nothing about them
        return None


def _too_few_to_sharpen(t: float, n: int) -> bool:
    """Whether ``t`` would sharpen the probabilities on fewer than :data:`MIN_SHARPEN_LABELS`."""
    return t < 1.0 and n < MIN_SHARPEN_LABELS


def _allowed(t: float | None, n: int) -> float:
    """``t`` where the rule may take it on ``n`` labels (softening from :data:`MIN_LABELS`,
    sharpening from :data:`MIN_SHARPEN_LABELS`), else 1."""
    if t is None or n < MIN_LABELS or _too_few_to_sharpen(t, n):
        return 1.0
    return t


def softened_losses(scores, labels, folds) -> np.ndarray:
    """``[N]`` out-of-fold NLL of ``scores`` (``[N, K]`` log-probabilities) at a temperature
    fitted on each fold's training labels, where :func:`recalibrate` may take it (softening from
    :data:`MIN_LABELS` labels, sharpening from :data:`MIN_SHARPEN_LABELS`); the scores as they
    are with fewer labels. The base model recalibrated on the labels is what an adapted head must
    beat (:func:`app.adapt.fit.choose`): a head that only rescales the base model's
    probabilities is a temperature, which ``adapt`` applies to the base model anyway.

    Args:
        scores: ``[N, K]`` log-probabilities (or logits) of the labelled buildings.
        labels: ``[N]`` their class ids.
        folds: ``(train, test)`` index pairs covering every label once as test.
    """
    x = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    out = np.zeros(len(y))
    for train, test in folds:
        t = _allowed(_fit(x[train], y[train]) if len(y) >= MIN_LABELS else None, len(y))
        lp = log_softmax(x[test] / t)
        out[test] = -np.clip(lp[np.arange(len(test)), y[test]], -50.0, 0.0)
    return out


def recalibrate(scores, labels, seed: int = 0) -> Recalibration:
    """The temperature of the kept model's probabilities on the labels (module docstring).

    Args:
        scores: ``[N, K]`` out-of-fold log-probabilities (or logits) of the labelled buildings
            by the model ``adapt`` kept.
        labels: ``[N]`` their class ids.
        seed: seed of the cross-fitting folds.
    """
    from sklearn.model_selection import KFold

    x = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    n = len(y)
    if n < MIN_LABELS:
        return Recalibration(1.0, None, False, f"{n} labels, fewer than {MIN_LABELS}", n)
    fitted = _fit(x, y)
    if fitted is None:
        return Recalibration(1.0, None, False, "no temperature fits these labels", n)
    before, after = np.zeros(n), np.zeros(n)
    p_before, p_after = np.zeros_like(x), np.zeros_like(x)
    for train, test in KFold(FOLDS, shuffle=True, random_state=seed).split(x):
        t = _fit(x[train], y[train]) or 1.0
        lp0, lp1 = log_softmax(x[test]), log_softmax(x[test] / t)
        rows = np.arange(len(test))
        before[test] = -lp0[rows, y[test]]
        after[test] = -lp1[rows, y[test]]
        p_before[test], p_after[test] = np.exp(lp0), np.exp(lp1)
    g, se = gain(before, after)
    figures = {
        "nll": (float(before.mean()), float(after.mean())),
        "ece": (expected_calibration_error(p_before, y), expected_calibration_error(p_after, y)),
        "gain": g,
        "gain_se": se,
    }
    if _too_few_to_sharpen(fitted, n):
        why = (
            f"T = {fitted:.3g} would sharpen the probabilities; sharpening is taken from "
            f"{MIN_SHARPEN_LABELS} labels"
        )
        return Recalibration(1.0, fitted, False, why, n, **figures)
    if fitted == 1.0 or not (g > NEAR_TIE_NATS and g > NEAR_TIE_SE * se):
        why = f"T = {fitted:.3g} did not lower the cross-fitted NLL clearly"
        return Recalibration(1.0, fitted, False, why, n, **figures)
    way = "over" if fitted > 1.0 else "under"
    why = (
        f"the probabilities were {way}-confident on these labels; the cross-fitted NLL fell clearly"
    )
    return Recalibration(fitted, fitted, True, why, n, **figures)


def recalibration_text(block) -> str | None:
    """What the recalibration did, in a line (None: the block has none)."""
    r = (block or {}).get("recalibration")
    if not r:
        return None
    if r.get("ece"):
        figures = (
            f" (cross-validated ECE {r['ece'][0]:.3f} -> {r['ece'][1]:.3f}, NLL "
            f"{r['nll'][0]:.3f} -> {r['nll'][1]:.3f})"
        )
    else:
        figures = ""
    if r.get("kept"):
        return (
            f"probabilities recalibrated on the labels: T = {r['temperature']:.3g}{figures}; "
            "grades unchanged"
        )
    return f"probabilities kept as they were: {r['why']}{figures}"
