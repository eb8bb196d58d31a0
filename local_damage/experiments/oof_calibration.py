"""Calibration fitted on the out-of-fold predictions of a cross-validation, judged fold by fold.

A cross-validation grades every labelled building once, by the model that never saw its tile
(``oof_predictions.csv``, with raw logits). A calibration map fitted on those predictions is
fitted on held-out predictions of every fold at once; to judge it without fitting and measuring
on the same buildings, it is *cross-fitted*: for each fold, fitted on the other folds'
predictions and applied to that fold's. Its ECE is then read per fold, on each fold's intact
tiles (tiles whose buildings are all no-damage) and pooled, beside the raw probabilities'.

The maps tried:

- ``temperature``: one ``T`` divides every logit (Guo et al. 2017); every grade is kept. This is
  what a model file carries (:mod:`runtime.calibration`).
- ``temperature per grade``: one ``T`` per predicted grade, fitted on the buildings given that
  grade; every grade is kept.
- ``vector scaling``: ``w * z + b`` per class (Guo et al.'s vector scaling); it can change
  grades.

**The rule** (:func:`choose`): a map ships only if a model file can carry it, it keeps every
grade, and its cross-fitted ECE is nowhere above the raw probabilities' (each fold, each fold's
intact tiles, pooled, pooled intact); among those, the lowest pooled ECE. Otherwise the raw
probabilities ship: a map that helps on average but harms easy tiles is not taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from runtime.calibration import CalibrationError, fit_temperature
from runtime.metrics.calibration import (
    expected_calibration_error,
    negative_log_likelihood,
)

#: The maps tried, in report order.
MAPS = ("temperature", "temperature per grade", "vector scaling")
#: The maps a model file can carry.
SHIPPABLE = ("temperature",)
#: Least buildings given a grade for its own temperature (else that grade keeps T = 1).
MIN_PER_GRADE = 20
#: Ridge on vector scaling's biases and on the scales' distance from 1.
RIDGE = 1e-3


def _softmax(z: np.ndarray) -> np.ndarray:
    from scipy.special import softmax

    return softmax(z, axis=1)


def _temperature(logits: np.ndarray, labels: np.ndarray) -> float:
    try:
        return fit_temperature(logits, labels)
    except CalibrationError:
        return 1.0


def _fit_per_grade(logits: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    grades = logits.argmax(axis=1)
    temps = []
    for k in range(logits.shape[1]):
        rows = grades == k
        ok = rows.sum() >= MIN_PER_GRADE and len(np.unique(labels[rows])) > 1
        temps.append(_temperature(logits[rows], labels[rows]) if ok else 1.0)
    return {"temperatures": temps}


def _fit_vector(logits: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    from scipy.optimize import minimize

    n, k = logits.shape
    rows = np.arange(n)

    def objective(p: np.ndarray) -> float:
        z = logits * p[:k] + p[k:]
        z = z - z.max(axis=1, keepdims=True)
        nll = np.mean(np.log(np.exp(z).sum(axis=1)) - z[rows, labels])
        return float(nll + RIDGE * (np.sum((p[:k] - 1) ** 2) + np.sum(p[k:] ** 2)))

    p = minimize(objective, np.r_[np.ones(k), np.zeros(k)], method="L-BFGS-B").x
    return {"scales": p[:k].tolist(), "biases": p[k:].tolist()}


def fit_map(name: str, logits: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    """The parameters of map ``name`` fitted on ``logits`` ``[N, K]`` and ``labels`` ``[N]``."""
    logits = np.asarray(logits, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    if name == "temperature":
        return {"temperature": _temperature(logits, labels)}
    if name == "temperature per grade":
        return _fit_per_grade(logits, labels)
    if name == "vector scaling":
        return _fit_vector(logits, labels)
    raise ValueError(f"unknown calibration map {name!r}; one of {', '.join(MAPS)}")


def apply_map(name: str, params: dict[str, Any] | None, logits: np.ndarray) -> np.ndarray:
    """Probabilities ``[N, K]`` of ``logits`` under map ``name`` (raw softmax for ``None``)."""
    z = np.asarray(logits, dtype=np.float64)
    if params is None:
        return _softmax(z)
    if name == "temperature":
        return _softmax(z / params["temperature"])
    if name == "temperature per grade":
        t = np.asarray(params["temperatures"], dtype=np.float64)[z.argmax(axis=1)]
        return _softmax(z / t[:, None])
    if name == "vector scaling":
        return _softmax(z * np.asarray(params["scales"]) + np.asarray(params["biases"]))
    raise ValueError(f"unknown calibration map {name!r}; one of {', '.join(MAPS)}")


def _ece(p: np.ndarray, y: np.ndarray, rows: np.ndarray) -> float | None:
    return expected_calibration_error(p[rows], y[rows]) if rows.any() else None


def _figures(p: np.ndarray, y: np.ndarray, folds: np.ndarray, intact: np.ndarray) -> dict:
    per_fold = {
        int(f): {
            "n": int((folds == f).sum()),
            "ece": _ece(p, y, folds == f),
            "ece_intact": _ece(p, y, (folds == f) & intact),
        }
        for f in np.unique(folds)
    }
    return {
        "folds": per_fold,
        "ece": _ece(p, y, np.ones(len(y), bool)),
        "ece_intact": _ece(p, y, intact),
        "nll": negative_log_likelihood(p, y),
    }


def _places(figures: dict) -> dict[str, float | None]:
    """Every ECE of :func:`_figures` by where it was read."""
    out = {"pooled": figures["ece"], "pooled intact": figures["ece_intact"]}
    for f, q in figures["folds"].items():
        out[f"fold {f}"] = q["ece"]
        out[f"fold {f} intact"] = q["ece_intact"]
    return out


def worse_places(raw: dict, mapped: dict, tolerance: float = 0.0) -> list[str]:
    """Where ``mapped``'s ECE is above ``raw``'s by more than ``tolerance``."""
    before, after = _places(raw), _places(mapped)
    return [
        k
        for k, v in after.items()
        if v is not None and before[k] is not None and v > before[k] + tolerance
    ]


def calibration_study(
    frame, class_names: Sequence[str], maps: Sequence[str] = MAPS
) -> dict[str, Any] | None:
    """Cross-fit each map over the folds of an out-of-fold frame and judge it.

    Args:
        frame: out-of-fold predictions (``fold``, ``label``, ``intact_tile``, ``logit_<class>``).
        class_names: class names in label order.
        maps: the maps to try.

    Returns:
        ``{"raw": figures, "maps": {name: {"figures", "grades_changed", "worse", "params"}},
        "chosen": name or None, "why": str}`` where figures are ECE per fold, per fold's intact
        tiles and pooled (:func:`_figures`), ``params`` the map fitted on every fold at once;
        None when the frame has fewer than two folds or no logits.
    """
    columns = [f"logit_{c}" for c in class_names]
    if any(c not in frame.columns for c in columns) or frame["fold"].nunique() < 2:
        return None
    z = frame[columns].to_numpy(dtype=np.float64)
    y = frame["label"].to_numpy(dtype=np.int64)
    folds = frame["fold"].to_numpy(dtype=np.int64)
    intact = frame["intact_tile"].to_numpy(dtype=bool)
    raw = _figures(_softmax(z), y, folds, intact)
    study: dict[str, Any] = {"n": len(y), "raw": raw, "maps": {}}
    for name in maps:
        p = np.empty_like(z)
        for f in np.unique(folds):
            test = folds == f
            p[test] = apply_map(name, fit_map(name, z[~test], y[~test]), z[test])
        figures = _figures(p, y, folds, intact)
        study["maps"][name] = {
            "figures": figures,
            "grades_changed": int((p.argmax(axis=1) != z.argmax(axis=1)).sum()),
            "worse": worse_places(raw, figures),
            "params": fit_map(name, z, y),
        }
    study.update(choose(study))
    return study


def choose(study: dict[str, Any]) -> dict[str, Any]:
    """The rule of the module docstring: ``{"chosen": name or None, "why": str}``."""
    fit = []
    for name in SHIPPABLE:
        m = study["maps"].get(name)
        if m is not None and not m["worse"] and m["grades_changed"] == 0:
            fit.append((m["figures"]["ece"], name))
    if fit:
        ece, name = min(fit)
        return {
            "chosen": name,
            "why": f"{name}: nowhere worse than the raw probabilities, pooled ECE "
            f"{study['raw']['ece']:.3f} -> {ece:.3f}",
        }
    reasons = [
        f"{name} is worse on {', '.join(study['maps'][name]['worse'])}"
        for name in SHIPPABLE
        if name in study["maps"]
    ]
    return {"chosen": None, "why": "raw probabilities ship: " + "; ".join(reasons)}


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def calibration_table(name: str, study: dict[str, Any]) -> list[str]:
    """Markdown lines: ECE of each map per fold (and its intact tiles) and pooled, the rule's
    choice."""
    raw = study["raw"]
    folds = sorted(raw["folds"])
    header = ["map", *(f"fold {f}" for f in folds), "pooled", "NLL", "grades changed", "worse on"]
    rows = []
    for label, figures, extra in [("raw", raw, None)] + [
        (m, q["figures"], q) for m, q in study["maps"].items()
    ]:
        cells = [
            f"{_f(figures['folds'][f]['ece'])} ({_f(figures['folds'][f]['ece_intact'])})"
            for f in folds
        ]
        rows.append(
            [
                label,
                *cells,
                f"{_f(figures['ece'])} ({_f(figures['ece_intact'])})",
                f"{figures['nll']:.3f}",
                "-" if extra is None else str(extra["grades_changed"]),
                "-" if extra is None else (", ".join(extra["worse"]) or "nowhere"),
            ]
        )
    lines = [
        f"### {name}: calibration fitted on out-of-fold predictions",
        "",
        "ECE (15 bins) of each map cross-fitted over the folds (fitted on the other folds' "
        "predictions); in brackets, on the fold's intact tiles.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return [*lines, "", f"Rule: {study['why']}.", ""]
