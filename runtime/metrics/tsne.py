"""A t-SNE scatter of embeddings, one colour per class (``tsne_z.png`` of ``local-damage
evaluate``)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from data_prep.store import atomic_path
from runtime.metrics.representation import check_embeddings, check_labels

#: Class colours by class index, shared by every embedding plot: the first four run green to red
#: along the damage scale (no-damage, minor, major, destroyed), the rest are distinct extras.
CLASS_COLOURS: tuple[str, ...] = (
    "#2ca02c",
    "#e6b800",
    "#ff7f0e",
    "#d62728",
    "#1f77b4",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#17becf",
)


def plot_embedding_tsne(
    z: ArrayLike,
    labels: ArrayLike,
    class_names: Sequence[str],
    path: str | os.PathLike,
    title: str,
    seed: int = 0,
    max_points: int = 5000,
) -> None:
    """Write a 2-D t-SNE scatter of the embeddings, one colour per class, as a PNG.

    Colours follow ``CLASS_COLOURS`` by class index, so a class looks the same in every plot.
    Perplexity is ``min(30, (N - 1) / 3)`` so small sets work. Above ``max_points`` embeddings a
    seeded random subset is shown (t-SNE time grows quickly with N) and the title says so.

    Args:
        z: [N, D] L2-normalised embeddings, N >= 2.
        labels: [N] class ids in [0, K).
        class_names: the K class names, in label order (legend entries, with counts).
        path: output .png; written under a temporary name in the same folder, then renamed.
        title: plot title.
        seed: seed of t-SNE and of the subset.
        max_points: most embeddings to embed.
    """
    from matplotlib.figure import Figure
    from sklearn.manifold import TSNE

    arr = check_embeddings(z)
    y = check_labels(labels, len(arr), len(class_names))
    if len(arr) < 2:
        raise ValueError("a t-SNE plot needs at least 2 embeddings")
    n_all = len(arr)
    if n_all > max_points:
        keep = np.sort(np.random.default_rng(seed).choice(n_all, size=max_points, replace=False))
        arr, y = arr[keep], y[keep]
        title = f"{title} ({max_points} of {n_all} shown)"
    n = len(arr)
    xy = TSNE(
        n_components=2, perplexity=min(30.0, (n - 1) / 3), init="pca", random_state=seed
    ).fit_transform(arr)

    fig = Figure(figsize=(6.5, 5.5), dpi=120, layout="constrained")
    ax = fig.add_subplot()
    size = float(np.clip(3000.0 / n, 4.0, 40.0))
    for c, name in enumerate(class_names):
        members = y == c
        if members.any():
            ax.scatter(
                xy[members, 0],
                xy[members, 1],
                s=size,
                c=CLASS_COLOURS[c % len(CLASS_COLOURS)],
                alpha=0.8,
                linewidths=0,
                label=f"{name} ({int(members.sum())})",
            )
    ax.set_title(title)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.legend(loc="best", fontsize="small", markerscale=max(1.0, 20.0 / size) ** 0.5)
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", bbox_inches="tight", pad_inches=0.15)
