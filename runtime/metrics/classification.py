"""Per-building classification metrics and a confusion-matrix plot.

Counts are per building (one prediction per footprint), not per pixel as in the xView2 challenge
scorer; ``xview2_damage_f1`` applies the challenge's combination of class F1 scores to them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from data_prep.store import atomic_path
from data_prep.xview2 import xview2_harmonic_mean
from runtime.metrics.representation import check_labels


def classification_metrics(
    y_true: ArrayLike, y_pred: ArrayLike, class_names: Sequence[str]
) -> dict:
    """Accuracy, per-class precision/recall/F1, macro and xView2 F1, confusion matrix.

    A class is *absent* when it has neither a true instance nor a prediction: its precision,
    recall and F1 are undefined (reported as 0, with support 0, and listed in
    ``absent_classes``), and it is left out of ``macro_f1`` and ``xview2_damage_f1``, which
    average over the classes that take part. A class that is predicted but never true, or true
    but never predicted, takes part with F1 0.

    ``xview2_damage_f1`` is the harmonic mean of the per-class F1 scores, as the xView2 challenge
    combines its four damage F1 scores (:func:`data_prep.xview2.xview2_harmonic_mean`, without
    the challenge scorer's 1e-6 added to each F1, which changes the value by less than 1e-5);
    one class at F1 0 makes it exactly 0.

    Args:
        y_true: [N] true class ids in [0, K).
        y_pred: [N] predicted class ids in [0, K).
        class_names: the K class names, in label order.

    Returns:
        ``{"n", "accuracy", "macro_f1", "xview2_damage_f1", "per_class": {name: {"precision",
        "recall", "f1", "support"}}, "confusion_matrix" (K x K list, rows = true, columns =
        predicted), "class_names", "absent_classes"}``; all values plain Python numbers.
    """
    from sklearn.metrics import confusion_matrix, precision_recall_fscore_support

    k = len(class_names)
    if k == 0:
        raise ValueError("class_names must name at least one class")
    yt = check_labels(y_true, num_classes=k, name="y_true")
    yp = check_labels(y_pred, num_classes=k, name="y_pred")
    if len(yt) != len(yp):
        raise ValueError(
            f"y_true and y_pred must have the same length, got {len(yt)} and {len(yp)}"
        )
    if len(yt) == 0:
        raise ValueError("no predictions to score (y_true is empty)")
    labels = list(range(k))
    precision, recall, f1, support = precision_recall_fscore_support(
        yt, yp, labels=labels, zero_division=0
    )
    cm = confusion_matrix(yt, yp, labels=labels)
    present = (cm.sum(axis=1) > 0) | (cm.sum(axis=0) > 0)
    return {
        "n": int(len(yt)),
        "accuracy": float(np.mean(yt == yp)),
        "macro_f1": float(np.mean(f1[present])),
        "xview2_damage_f1": xview2_harmonic_mean(f1[present], epsilon=0.0),
        "per_class": {
            name: {
                "precision": float(precision[c]),
                "recall": float(recall[c]),
                "f1": float(f1[c]),
                "support": int(support[c]),
            }
            for c, name in enumerate(class_names)
        },
        "confusion_matrix": cm.astype(int).tolist(),
        "class_names": list(class_names),
        "absent_classes": [name for c, name in enumerate(class_names) if not present[c]],
    }


def present_class_f1(
    metrics: dict, labels: ArrayLike, class_names: Sequence[str]
) -> dict[str, float | None]:
    """Each class's F1 from :func:`classification_metrics` output, None for a class absent from
    ``labels`` (its F1 would be 0 or undefined, and says nothing of the model)."""
    present = set(np.unique(np.asarray(labels)).tolist())
    return {
        name: (metrics["per_class"][name]["f1"] if i in present else None)
        for i, name in enumerate(class_names)
    }


def macro_f1_present(
    labels: ArrayLike, preds: ArrayLike, class_names: Sequence[str]
) -> float | None:
    """Macro-F1 over the classes present among ``labels`` (as the cross-validation reports it);
    None when there are no labels."""
    if len(np.asarray(labels)) == 0:
        return None
    f1 = present_class_f1(
        classification_metrics(labels, preds, list(class_names)), labels, class_names
    )
    values = [v for v in f1.values() if v is not None]
    return float(np.mean(values)) if values else None


def plot_confusion_matrix(
    cm: ArrayLike,
    class_names: Sequence[str],
    path: str | os.PathLike,
    normalize: bool = True,
    title: str | None = None,
) -> None:
    """Write a confusion matrix as a PNG: counts in the cells, colour by row share or count.

    Args:
        cm: [K, K] counts, rows = true class, columns = predicted class.
        class_names: the K class names, in label order.
        path: output .png; written under a temporary name in the same folder, then renamed.
        normalize: colour each cell by its share of the row (recall per true class, shown as a
            percentage under the count); otherwise by the raw count.
        title: optional plot title.
    """
    from matplotlib.figure import Figure

    counts = np.asarray(cm)
    k = len(class_names)
    if counts.shape != (k, k):
        raise ValueError(f"cm must be [K, K] with K = {k} classes, got shape {counts.shape}")
    if np.any(counts < 0) or not np.all(np.isfinite(counts)):
        raise ValueError("cm must hold non-negative finite counts")
    row_sums = counts.sum(axis=1, keepdims=True)
    shares = np.divide(counts, row_sums, out=np.zeros(counts.shape), where=row_sums > 0)
    colour = shares if normalize else counts.astype(np.float64)
    vmax = 1.0 if normalize else max(float(colour.max()), 1.0)

    side = 2.2 + 1.0 * k
    fig = Figure(figsize=(side + 1.2, side), dpi=120, layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(colour, cmap="Blues", vmin=0.0, vmax=vmax)
    cbar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    cbar.set_label("share of true class" if normalize else "buildings")
    for i in range(k):
        for j in range(k):
            value = counts[i, j]
            text = f"{int(value)}" if float(value).is_integer() else f"{value:.3g}"
            if normalize and row_sums[i, 0] > 0:
                text += f"\n{100 * shares[i, j]:.0f}%"
            dark = colour[i, j] / vmax > 0.55
            ax.text(
                j, i, text, ha="center", va="center", fontsize=9, color="white" if dark else "black"
            )
    ax.set_xticks(range(k), labels=list(class_names), rotation=30, ha="right")
    ax.set_yticks(
        range(k), labels=[f"{name} ({int(row_sums[i, 0])})" for i, name in enumerate(class_names)]
    )
    ax.set_xlabel("predicted")
    ax.set_ylabel("true (buildings)")
    if title:
        ax.set_title(title)
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", bbox_inches="tight", pad_inches=0.15)
