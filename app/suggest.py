"""Which buildings to label next: uncertain ones, spread over the embedding space (no torch).

:func:`rank_buildings` orders unlabelled buildings by how much an analyst's label is likely to
help the adapted head (:mod:`app.adapt`):

1. Uncertainty: ``1 - margin`` of the model's calibrated probabilities (``margin`` = the largest
   probability minus the second), so a building the model hesitates on between two grades comes
   first; entropy breaks ties.
2. Diversity: the ranking is built greedily; each next building maximises
   ``uncertainty * (distance / largest distance) ** DIVERSITY``, where ``distance`` is its cosine
   distance in the embedding space to the nearest building already ranked or labelled. The first
   pick is the most uncertain building; near-duplicates of a picked building sink.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.adapt import unit

#: Exponent of the distance term: 0 ranks by uncertainty alone, larger spreads the picks more.
DIVERSITY = 1.0
#: CSV columns of a ranking.
COLUMNS = ("rank", "id", "event", "predicted", "confidence", "margin", "entropy", "distance")


@dataclass
class Suggestion:
    """One ranked building: id, event, predicted class, confidence, margin, entropy (nats) and
    the cosine distance to the nearest building ranked before it or labelled (1 for the first
    when nothing is labelled)."""

    rank: int
    id: str
    event: str
    predicted: str
    confidence: float
    margin: float
    entropy: float
    distance: float


def uncertainty(probabilities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(margin, entropy)`` of ``[N, K]`` probabilities: top-1 minus top-2, and nats."""
    p = np.asarray(probabilities, dtype=np.float64)
    top = np.sort(p, axis=1)[:, ::-1]
    margin = top[:, 0] - (top[:, 1] if p.shape[1] > 1 else 0.0)
    entropy = -(p * np.log(np.clip(p, 1e-12, 1.0))).sum(axis=1)
    return margin, entropy


def rank_buildings(
    probabilities: np.ndarray,
    embedding: np.ndarray,
    n: int,
    labelled_embedding: np.ndarray | None = None,
    diversity: float = DIVERSITY,
) -> tuple[np.ndarray, np.ndarray]:
    """The ``n`` buildings to label next, in order.

    Args:
        probabilities: ``[M, K]`` calibrated probabilities of the unlabelled buildings.
        embedding: their ``[M, D]`` embeddings.
        n: how many to rank (at most ``M``).
        labelled_embedding: ``[L, D]`` embeddings of buildings already labelled (new picks are
            kept away from them too); None: none.
        diversity: exponent of the distance term (0: uncertainty only).

    Returns:
        ``(order, distance)``: ``[min(n, M)]`` indices into the ``M`` buildings, best first, and
        each pick's cosine distance to the nearest earlier pick or labelled building.
    """
    margin, entropy = uncertainty(probabilities)
    m = len(margin)
    n = max(0, min(int(n), m))
    z = unit(embedding)
    u = (1.0 - margin) + 1e-3 * entropy / max(np.log(max(probabilities.shape[1], 2)), 1e-9)
    nearest = np.full(m, np.inf)
    if labelled_embedding is not None and len(labelled_embedding):
        nearest = (1.0 - z @ unit(labelled_embedding).T).min(axis=1)
    order, dist = [], []
    chosen = np.zeros(m, dtype=bool)
    for _ in range(n):
        finite = np.isfinite(nearest)
        if finite.any():
            scale = max(float(nearest[finite & ~chosen].max(initial=0.0)), 1e-9)
            spread = np.where(finite, np.clip(nearest, 0.0, None) / scale, 1.0)
        else:
            spread = np.ones(m)
        score = np.where(chosen, -np.inf, u * spread**diversity)
        i = int(np.argmax(score))
        order.append(i)
        dist.append(float(nearest[i]) if np.isfinite(nearest[i]) else 1.0)
        chosen[i] = True
        nearest = np.minimum(nearest, 1.0 - z @ z[i])
    return np.asarray(order, dtype=np.int64), np.asarray(dist)


def suggest(
    predictor,
    buildings,
    n: int,
    labelled=None,
    batch_size: int = 32,
    diversity: float = DIVERSITY,
) -> list[Suggestion]:
    """Rank the unlabelled buildings of ``buildings`` for labelling (the app and ``adapt
    --suggest`` call this).

    Args:
        predictor: the model whose uncertainty counts (an adapted one after a first round).
        buildings: :class:`app.labelled.Buildings`; its unlabelled ones are ranked, its labelled
            ones count as already labelled.
        n: how many to return.
        labelled: more labelled :class:`~app.labelled.Buildings` to keep away from; None: none.
        batch_size: chips per inference batch.
        diversity: see :func:`rank_buildings`.
    """
    pool = buildings.subset(~buildings.labelled)
    known = [b.subset(b.labelled) for b in (buildings, labelled) if b is not None]
    pred = predictor.predict(pool.pre, pool.post, batch_size=batch_size)
    seen = [
        predictor.predict(b.pre, b.post, batch_size=batch_size).embedding for b in known if len(b)
    ]
    order, dist = rank_buildings(
        pred.probabilities,
        pred.embedding,
        n,
        np.concatenate(seen) if seen else None,
        diversity,
    )
    margin, entropy = uncertainty(pred.probabilities)
    names = predictor.class_names
    return [
        Suggestion(
            rank + 1,
            pool.ids[i],
            pool.events[i],
            names[int(pred.probabilities[i].argmax())],
            round(float(pred.probabilities[i].max()), 6),
            round(float(margin[i]), 6),
            round(float(entropy[i]), 6),
            round(float(d), 6),
        )
        for rank, (i, d) in enumerate(zip(order, dist, strict=True))
    ]


def write_suggestions(path: str | os.PathLike, rows: Sequence[Suggestion]) -> Path:
    """Write a ranking as CSV (:data:`COLUMNS`), atomically."""
    from data_prep.store import atomic_path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, suffix=".csv") as tmp, open(tmp, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(COLUMNS)
        for r in rows:
            writer.writerow([getattr(r, c) for c in COLUMNS])
    return path
