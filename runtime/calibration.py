"""Temperature scaling of a model's class probabilities (no torch).

A trained network is usually over-confident: its softmax puts more mass on the chosen grade than
the grade deserves. Temperature scaling (Guo et al., "On Calibration of Modern Neural Networks",
ICML 2017) divides the logits by one scalar ``T > 0`` before the softmax: ``T > 1`` softens the
probabilities, ``T < 1`` sharpens them, and the argmax, hence every predicted grade, is unchanged.
``T`` is fitted by minimising the negative log-likelihood of labelled validation chips.

A model file carries ``T`` in one place: the metadata prop ``calibration`` (see
:func:`calibration_block`), which :class:`runtime.predictor.Predictor` reads and applies to the
probabilities it returns. The graph and its ``logits`` output stay raw, so a calibrated model
gives the same logits as the uncalibrated one, and calibrating again replaces ``T`` rather than
stacking a second one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from data_prep.errors import LocalDamageError

#: Metadata prop of a model file that holds the calibration block.
METADATA_KEY = "calibration"
#: The only calibration method so far.
METHOD = "temperature scaling"
#: ``method`` of a block that keeps the raw probabilities on purpose (``T = 1``; the fitted
#: temperature recorded as ``fitted_temperature``, not applied).
RAW_METHOD = "raw"
#: Search interval of the temperature. A fit that ends on either bound has no interior optimum.
T_MIN, T_MAX = 0.01, 100.0


class CalibrationError(LocalDamageError, ValueError):
    """Logits and labels a temperature cannot be fitted to; the message says why."""


def _check(logits: ArrayLike, labels: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(logits, dtype=np.float64)
    y = np.asarray(labels)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] < 2:
        raise CalibrationError(
            f"logits must be a non-empty [N, K] array with K >= 2 classes, got shape {x.shape}"
        )
    if y.shape != (x.shape[0],):
        raise CalibrationError(f"labels must be [N] = [{x.shape[0]}], got shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise CalibrationError(f"labels must be integer class ids, got dtype {y.dtype}")
    if y.min() < 0 or y.max() >= x.shape[1]:
        raise CalibrationError(
            f"labels must be class ids in [0, {x.shape[1]}), got {int(y.min())}..{int(y.max())} "
            "(unlabelled chips, -1, cannot be used)"
        )
    if not np.isfinite(x).all():
        raise CalibrationError(f"logits hold {int((~np.isfinite(x)).sum())} NaN or inf value(s)")
    return x, y.astype(np.int64)


def scaled_nll(logits: ArrayLike, labels: ArrayLike, temperature: float) -> float:
    """Mean negative log-likelihood (nats) of ``labels`` under ``softmax(logits / temperature)``.

    Args:
        logits: ``[N, K]`` raw class scores.
        labels: ``[N]`` true class ids in ``[0, K)``.
        temperature: ``T > 0``.
    """
    if not temperature > 0 or not math.isfinite(temperature):
        raise CalibrationError(f"temperature must be a positive number, got {temperature!r}")
    x, y = _check(logits, labels)
    z = x / temperature
    z = z - z.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=1))
    return float(np.mean(log_norm - z[np.arange(len(y)), y]))


def fit_temperature(logits: ArrayLike, labels: ArrayLike) -> float:
    """The temperature ``T`` that minimises :func:`scaled_nll` on labelled logits.

    The search runs over ``log T`` in ``[log T_MIN, log T_MAX]`` with bounded Brent's method: the
    NLL is convex in ``1 / T``, so it has one minimum along ``log T`` and no restarts are needed.

    Args:
        logits: ``[N, K]`` raw class scores of validation chips (chips the model did not train on).
        labels: ``[N]`` their true class ids.

    Returns:
        ``T`` as a Python float.

    Raises:
        CalibrationError: bad shapes or labels, non-finite logits, or a minimum on a bound of the
            search interval: the NLL keeps falling towards ``T -> 0`` when the logits separate the
            labels perfectly (typically chips the model was trained on), and towards
            ``T -> infinity`` when the logits carry no information about the labels, or point
            away from them.
    """
    from scipy.optimize import minimize_scalar

    x, y = _check(logits, labels)
    lo, hi = math.log(T_MIN), math.log(T_MAX)
    result = minimize_scalar(
        lambda u: scaled_nll(x, y, math.exp(u)),
        bounds=(lo, hi),
        method="bounded",
        options={"xatol": 1e-6},
    )
    u = float(result.x)
    best = scaled_nll(x, y, math.exp(u))
    # a minimum on a bound, or a flat run to it (the NLL of separable logits underflows to 0
    # long before T_MIN, so the search may stop anywhere on that flat run)
    at_low = u - lo < 1e-3 or scaled_nll(x, y, T_MIN) <= best
    at_high = hi - u < 1e-3 or scaled_nll(x, y, T_MAX) <= best
    if at_low or at_high:
        edge = "0" if at_low else "infinity"
        raise CalibrationError(
            f"the negative log-likelihood of {len(y)} chips keeps falling as T -> {edge} "
            f"(search ended at T = {math.exp(u):.3g}); "
            + (
                "the logits separate the labels perfectly, as on chips the model was trained "
                "on: fit on validation chips the model has not seen"
                if edge == "0"
                else "the logits carry no usable information about the labels (are the "
                "chips labelled with the model's class order?)"
            )
        )
    return math.exp(u)


def calibration_block(
    temperature: float,
    fitted_on: Mapping[str, Any],
    before: Mapping[str, Any] | None = None,
    after: Mapping[str, Any] | None = None,
    applied: bool = True,
) -> dict[str, Any]:
    """The ``calibration`` metadata prop of a calibrated model.

    Args:
        temperature: the fitted ``T``.
        fitted_on: where ``T`` was fitted: ``chips`` (store), ``fold``, ``selection``, ``n``.
        before: ECE / NLL / Brier of the uncalibrated probabilities on those chips.
        after: the same with ``T`` applied.
        applied: False keeps the raw probabilities: ``method`` is :data:`RAW_METHOD`,
            ``temperature`` 1 and ``after`` equal to ``before``; the fit is recorded as
            ``fitted_temperature`` and ``after_if_fitted``.

    Returns:
        ``{"method", "temperature", "fitted_on", "before", "after"}`` (and, not applied,
        ``fitted_temperature`` and ``after_if_fitted``).
    """
    before = dict(before) if before is not None else None
    after = dict(after) if after is not None else None
    block = {
        "method": METHOD,
        "temperature": float(temperature),
        "fitted_on": dict(fitted_on),
        "before": before,
        "after": after,
    }
    if applied:
        return block
    return {
        **block,
        "method": RAW_METHOD,
        "temperature": 1.0,
        "after": before,
        "fitted_temperature": float(temperature),
        "after_if_fitted": after,
    }


def read_temperature(metadata: Mapping[str, Any], path: str | os.PathLike) -> float | None:
    """The temperature stored in a model's parsed metadata, or None when it has none.

    Raises:
        ValueError: naming ``path`` when the ``calibration`` prop is not a mapping with a
            positive finite ``temperature``.
    """
    block = metadata.get(METADATA_KEY)
    if block is None:
        return None
    t = block.get("temperature") if isinstance(block, Mapping) else None
    valid = isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0
    if not valid:
        raise ValueError(
            f"{path}: metadata {METADATA_KEY} must hold a positive finite temperature, got "
            f"{block!r}; recalibrate with `local-damage calibrate`"
        )
    return float(t)
