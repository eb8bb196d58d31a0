"""Calibration metrics of class probabilities, and a reliability diagram.

- ECE, expected calibration error (top-label): the predictions are put into ``bins`` equal-width
  bins of their confidence (the largest probability), bin ``b`` holding confidences in
  ``(b / bins, (b + 1) / bins]`` (a confidence of exactly 0 goes to the first bin); ECE is the
  average over bins, weighted by their share of the predictions, of
  ``|accuracy of the bin - mean confidence of the bin|``. 15 bins, as Guo et al. (2017).
- NLL: mean negative log-likelihood of the true class, in nats; probabilities are clipped at
  :data:`PROB_FLOOR` so a single zero does not make it infinite.
- Brier score (multi-class): for each prediction the sum over classes of the squared difference
  between the probability and the one-hot label, averaged over predictions (0 is perfect, 2 the
  worst).

Pure NumPy (matplotlib inside the plot function), no torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
from numpy.typing import ArrayLike

from data_prep.store import atomic_path
from runtime.metrics.representation import check_labels

#: Bins of the expected calibration error and the reliability diagram.
ECE_BINS = 15
#: Smallest probability the NLL takes the log of.
PROB_FLOOR = 1e-12


def check_probabilities(
    probabilities: ArrayLike, labels: ArrayLike
) -> tuple[np.ndarray, np.ndarray]:
    """``(probabilities, labels)`` as float64 ``[N, K]`` and int64 ``[N]`` after checking them.

    Raises:
        ValueError: empty or non-2-D probabilities, rows that are not distributions (negative,
            non-finite, or not summing to 1 within 1e-3), or labels of the wrong length or
            outside ``[0, K)``.
    """
    p = np.asarray(probabilities, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] == 0 or p.shape[1] == 0:
        raise ValueError(f"probabilities must be a non-empty [N, K] array, got shape {p.shape}")
    if not np.isfinite(p).all() or (p < 0).any():
        raise ValueError("probabilities must be finite and non-negative")
    sums = p.sum(axis=1)
    if np.abs(sums - 1.0).max() > 1e-3:
        raise ValueError(
            f"every row of probabilities must sum to 1; row sums run from {sums.min():.4g} to "
            f"{sums.max():.4g}"
        )
    return p, check_labels(labels, n=len(p), num_classes=p.shape[1], name="labels")


def _confidence_bins(confidence: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """``(edges, index)``: the ``bins + 1`` equal-width edges over ``[0, 1]`` and each
    confidence's bin; bin ``b`` holds ``(edges[b], edges[b + 1]]`` (0 goes to the first)."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    # searchsorted 'left' on the inner edges puts a value on an edge in the bin below it
    return edges, np.searchsorted(edges[1:-1], confidence, side="left")


def reliability_bins(
    probabilities: ArrayLike, labels: ArrayLike, bins: int = ECE_BINS
) -> dict[str, list]:
    """Per-bin counts, mean confidence and accuracy of the top-label predictions.

    Args:
        probabilities: ``[N, K]`` class probabilities (rows sum to 1).
        labels: ``[N]`` true class ids.
        bins: number of equal-width confidence bins over ``[0, 1]``.

    Returns:
        ``{"edges": bins + 1 floats, "count": ints, "confidence": floats or None (empty bin),
        "accuracy": floats or None}``, each list per bin in order of confidence.
    """
    if bins < 1:
        raise ValueError(f"bins must be at least 1, got {bins}")
    p, y = check_probabilities(probabilities, labels)
    confidence = p.max(axis=1)
    correct = (p.argmax(axis=1) == y).astype(np.float64)
    edges, index = _confidence_bins(confidence, bins)
    count = np.bincount(index, minlength=bins)
    conf_sum = np.bincount(index, weights=confidence, minlength=bins)
    hit_sum = np.bincount(index, weights=correct, minlength=bins)
    return {
        "edges": [float(e) for e in edges],
        "count": [int(c) for c in count],
        "confidence": [float(s / c) if c else None for s, c in zip(conf_sum, count, strict=True)],
        "accuracy": [float(s / c) if c else None for s, c in zip(hit_sum, count, strict=True)],
    }


def expected_calibration_error(
    probabilities: ArrayLike, labels: ArrayLike, bins: int = ECE_BINS
) -> float:
    """Top-label ECE with ``bins`` equal-width bins (see the module docstring); in ``[0, 1]``."""
    table = reliability_bins(probabilities, labels, bins)
    n = sum(table["count"])
    return float(
        sum(
            c / n * abs(a - f)
            for c, a, f in zip(table["count"], table["accuracy"], table["confidence"], strict=True)
            if c
        )
    )


#: Label draws of :func:`ece_sampling_floor`.
FLOOR_DRAWS = 200


def ece_sampling_floor(
    probabilities: ArrayLike,
    bins: int = ECE_BINS,
    draws: int = FLOOR_DRAWS,
    seed: int = 0,
) -> dict[str, float]:
    """The ECE that chance alone gives these predictions: what the same confidences would
    measure if they were exactly right.

    Each draw decides every prediction's correctness at random with its own confidence as the
    probability (a perfectly calibrated model on the same number of buildings with the same
    confidences) and measures the ECE with the same bins. An ECE near ``mean`` cannot be told
    from perfect calibration on this many buildings; ``p95`` is what 95% of such draws stay
    under. Deterministic for a given ``seed``.

    Returns:
        ``{"mean", "p95", "draws"}``.
    """
    if bins < 1 or draws < 1:
        raise ValueError(f"bins and draws must be at least 1, got {bins} and {draws}")
    p = np.asarray(probabilities, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] == 0:
        raise ValueError(f"probabilities must be a non-empty [N, K] array, got shape {p.shape}")
    confidence = p.max(axis=1)
    _, index = _confidence_bins(confidence, bins)
    conf_sum = np.bincount(index, weights=confidence, minlength=bins)
    rng = np.random.default_rng(seed)
    correct = rng.random((draws, len(confidence))) < confidence  # [draws, N]
    offsets = (np.arange(draws) * bins)[:, None] + index[None, :]
    hits = np.bincount(offsets.ravel(), weights=correct.ravel(), minlength=draws * bins)
    hits = hits.reshape(draws, bins)
    # sum over bins of (n_b / N) |accuracy_b - confidence_b| = sum_b |hits_b - conf_sum_b| / N
    ece = np.abs(hits - conf_sum[None, :]).sum(axis=1) / len(confidence)
    return {
        "mean": float(ece.mean()),
        "p95": float(np.quantile(ece, 0.95)),
        "draws": int(draws),
    }


def negative_log_likelihood(probabilities: ArrayLike, labels: ArrayLike) -> float:
    """Mean ``-log p[true class]`` in nats, probabilities clipped at :data:`PROB_FLOOR`."""
    p, y = check_probabilities(probabilities, labels)
    return float(-np.mean(np.log(np.clip(p[np.arange(len(y)), y], PROB_FLOOR, None))))


def brier_score(probabilities: ArrayLike, labels: ArrayLike) -> float:
    """Multi-class Brier score: mean over predictions of ``sum_k (p_k - [y = k])^2``."""
    p, y = check_probabilities(probabilities, labels)
    onehot = np.zeros_like(p)
    onehot[np.arange(len(y)), y] = 1.0
    return float(np.mean(np.sum((p - onehot) ** 2, axis=1)))


def calibration_metrics(
    probabilities: ArrayLike, labels: ArrayLike, bins: int = ECE_BINS
) -> dict[str, float]:
    """``{"ece", "nll", "brier", "accuracy"}`` of class probabilities against true labels."""
    p, y = check_probabilities(probabilities, labels)
    return {
        "ece": expected_calibration_error(p, y, bins),
        "nll": negative_log_likelihood(p, y),
        "brier": brier_score(p, y),
        "accuracy": float(np.mean(p.argmax(axis=1) == y)),
    }


def plot_reliability_diagram(
    curves: Mapping[str, Mapping[str, list]],
    path: str | os.PathLike,
    title: str | None = None,
) -> None:
    """Write a reliability diagram as a PNG: accuracy per confidence bin against the diagonal.

    Args:
        curves: label -> :func:`reliability_bins` output, e.g. ``{"before": ..., "after": ...}``,
            each drawn as a set of bars side by side; the label should carry the ECE, e.g.
            ``"before calibration (ECE 0.112)"``. All must use the same bins.
        path: output .png; written under a temporary name in the same folder, then renamed.
        title: optional plot title.
    """
    from matplotlib.figure import Figure

    if not curves:
        raise ValueError("curves must hold at least one reliability table")
    tables = list(curves.values())
    edges = np.asarray(tables[0]["edges"], dtype=np.float64)
    if any(list(t["edges"]) != list(tables[0]["edges"]) for t in tables):
        raise ValueError("every reliability table must use the same bins")
    width = np.diff(edges)
    share = width / len(tables)
    colours = ("#9e9e9e", "#1f77b4", "#ff7f0e", "#2ca02c")
    fig = Figure(figsize=(5.6, 5.0), dpi=120, layout="constrained")
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], linestyle="--", color="black", linewidth=1, label="perfect calibration")
    for i, (label, table) in enumerate(curves.items()):
        acc = np.array([a if a is not None else 0.0 for a in table["accuracy"]])
        ax.bar(
            edges[:-1] + i * share,
            acc,
            width=share,
            align="edge",
            color=colours[i % len(colours)],
            alpha=0.85,
            edgecolor="white",
            linewidth=0.5,
            label=label,
        )
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence (largest class probability)")
    ax.set_ylabel("accuracy in the bin")
    ax.legend(loc="upper left", fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", bbox_inches="tight", pad_inches=0.15)
