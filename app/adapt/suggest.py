"""Which buildings to label next (no torch).

Two rankings, chosen by what the model knows of the event (:func:`suggestion_order`):

- **Before the model is adapted to the event** (no head fitted to its labels yet): a random
  draw (:func:`id_order` in the app). On an unseen event the base model is wrong about many buildings,
  and no ranking built on its grades, hesitation or embedding was measured to beat a random draw
  for the first labels (docs/experiments/fewshot.md, "How the ranking was chosen"); a random draw is also an
  unbiased sample of the event, which the adapted head's class balance needs.
- **Once the model is adapted** (an ``adaptation`` head, :mod:`app.adapt.fit`): the buildings it
  hesitates over (:func:`rank_buildings` with :data:`ADAPTED_UNCERTAINTY`, weighted by
  typicality and kept away from the labelled buildings) interleaved with the random draw, one
  from each in turn, the random one first (:data:`RANDOM_SHARE` of the picks random, rounded
  up). The uncertain picks teach the head where its classes meet; the random ones keep the
  labels a sample of the event.

The random draw orders buildings by a hash of their ids (:func:`id_order`): the same buildings
always come in the same order, and a building keeps its place as others are labelled.

:func:`rank_buildings` orders buildings greedily: each next building maximises

    typicality ** TYPICALITY * uncertainty ** UNCERTAINTY * (distance / largest) ** DIVERSITY

- Typicality: how dense the embedding is around the building, ``1 / mean cosine distance`` to its
  :data:`NEIGHBOURS` nearest unlabelled buildings, scaled to a maximum of 1. A label on a typical
  building speaks for many others; an outlier's speaks for itself.
- Uncertainty: ``1 - margin`` of the model's probabilities (``margin`` = the largest minus the
  second).
- Diversity: ``distance`` is the building's cosine distance in the embedding space to the nearest
  building already ranked or labelled, so near-duplicates of a pick sink and the ranking covers
  the event's kinds of buildings, the most common first.

The leave-one-event-out report (``local-damage bench fewshot``, docs/experiments/fewshot.md) measures the
ranking in the rounds an analyst works in: the first labels drawn with the base model, each later
round ranked with the head adapted to the labels so far.
"""

from __future__ import annotations

import csv
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.store import atomic_path
from runtime.head import unit

#: Exponent of the distance term: 0 ranks without it, larger spreads the picks more.
DIVERSITY = 1.0
#: Exponent of the typicality term: 0 ignores how typical a building is.
TYPICALITY = 1.0
#: Exponent of the uncertainty term: 0 (default) ignores the model's hesitation.
UNCERTAINTY = 0.0
#: Exponent of the uncertainty term once the model is adapted to the event.
ADAPTED_UNCERTAINTY = 1.0
#: Share of an adapted model's picks taken from the random draw (interleaved with the uncertain).
RANDOM_SHARE = 0.5
#: Neighbours whose mean distance defines a building's typicality.
NEIGHBOURS = 20
#: CSV columns of a ranking.
COLUMNS = (
    "rank",
    "id",
    "row",
    "file",
    "event",
    "predicted",
    "confidence",
    "margin",
    "entropy",
    "distance",
)


@dataclass
class Suggestion:
    """One ranked building: its id, row and file as the user knows them
    (:class:`app.adapt.labelled.BuildingRef`: the footprints' ``uid`` or feature id, the row
    of the file and of the scored output, the file), event, predicted class, confidence,
    margin, entropy (nats) and the cosine distance to the nearest building ranked before it or
    labelled (1 for the first when nothing is labelled); ``key`` is the id the ranking hashes
    (``<scene>:<id>``, a chip store's chip id), unique across inputs."""

    rank: int
    id: str
    row: int | None
    file: str
    event: str
    predicted: str
    confidence: float
    margin: float
    entropy: float
    distance: float
    key: str = ""


def uncertainty(probabilities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(margin, entropy)`` of ``[N, K]`` probabilities: top-1 minus top-2, and nats."""
    p = np.asarray(probabilities, dtype=np.float64)
    top = np.sort(p, axis=1)[:, ::-1]
    margin = top[:, 0] - (top[:, 1] if p.shape[1] > 1 else 0.0)
    entropy = -(p * np.log(np.clip(p, 1e-12, 1.0))).sum(axis=1)
    return margin, entropy


def typicality(embedding: np.ndarray, neighbours: int = NEIGHBOURS) -> np.ndarray:
    """``[M]`` in ``(0, 1]``: ``1 / mean cosine distance`` of each building to its ``neighbours``
    nearest others, divided by the largest (all ones for fewer than two buildings)."""
    from sklearn.neighbors import NearestNeighbors

    z = unit(embedding)
    m = len(z)
    if m < 2:
        return np.ones(m)
    nn = NearestNeighbors(n_neighbors=min(int(neighbours), m - 1) + 1, algorithm="brute")
    dist, _ = nn.fit(z).kneighbors(z)  # Euclidean on unit vectors: sqrt(2 * cosine distance)
    mean = (dist[:, 1:] ** 2 / 2.0).mean(axis=1)
    density = 1.0 / (mean + 1e-9)
    return density / density.max()


def _distance_to_labelled(z: np.ndarray, labelled_embedding: np.ndarray | None) -> np.ndarray:
    """``[M]`` cosine distance of unit rows ``z`` to the nearest labelled building (inf: none)."""
    if labelled_embedding is None or not len(labelled_embedding):
        return np.full(len(z), np.inf)
    return (1.0 - z @ unit(labelled_embedding).T).min(axis=1)


def rank_buildings(
    probabilities: np.ndarray,
    embedding: np.ndarray,
    n: int,
    labelled_embedding: np.ndarray | None = None,
    diversity: float = DIVERSITY,
    typical: float = TYPICALITY,
    uncertain: float = UNCERTAINTY,
) -> tuple[np.ndarray, np.ndarray]:
    """The ``n`` buildings to label next, in order (module docstring).

    Args:
        probabilities: ``[M, K]`` calibrated probabilities of the unlabelled buildings.
        embedding: their ``[M, D]`` embeddings.
        n: how many to rank (at most ``M``).
        labelled_embedding: ``[L, D]`` embeddings of buildings already labelled (new picks are
            kept away from them too); None: none.
        diversity: exponent of the distance term.
        typical: exponent of the typicality term.
        uncertain: exponent of the uncertainty term (``1 - margin``).

    Returns:
        ``(order, distance)``: ``[min(n, M)]`` indices into the ``M`` buildings, best first, and
        each pick's cosine distance to the nearest earlier pick or labelled building.
    """
    margin, entropy = uncertainty(probabilities)
    m = len(margin)
    n = max(0, min(int(n), m))
    z = unit(embedding)
    u = (1.0 - margin) + 1e-3 * entropy / max(np.log(max(probabilities.shape[1], 2)), 1e-9)
    worth = np.clip(u, 1e-12, None) ** uncertain
    if typical and n:
        worth = worth * typicality(z) ** typical
    nearest = _distance_to_labelled(z, labelled_embedding)
    order, dist = [], []
    chosen = np.zeros(m, dtype=bool)
    for _ in range(n):
        finite = np.isfinite(nearest)
        if finite.any():
            scale = max(float(nearest[finite & ~chosen].max(initial=0.0)), 1e-9)
            spread = np.where(finite, np.clip(nearest, 0.0, None) / scale, 1.0)
        else:
            spread = np.ones(m)
        score = np.where(chosen, -np.inf, worth * spread**diversity)
        i = int(np.argmax(score))
        order.append(i)
        dist.append(float(nearest[i]) if np.isfinite(nearest[i]) else 1.0)
        chosen[i] = True
        nearest = np.minimum(nearest, 1.0 - z @ z[i])
    return np.asarray(order, dtype=np.int64), np.asarray(dist)


def id_order(ids: Sequence[str]) -> np.ndarray:
    """A random order of buildings that depends only on their ids: indices sorted by a hash
    (BLAKE2b) of each id. Labelling some of them leaves the others' order as it was."""
    keys = [hashlib.blake2b(str(i).encode("utf-8"), digest_size=8).digest() for i in ids]
    return np.asarray(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)


def interleave(first: Sequence[int], second: Sequence[int], n: int, share: float) -> list[int]:
    """``n`` distinct items: pick ``j`` (from 0) is the next of ``second`` not taken yet when
    ``ceil((j + 1) * share) > ceil(j * share)``, else the next of ``first`` (the other when one
    runs out). So every prefix takes ``share`` of its items from ``second``, rounded up, spread
    evenly (0.5: second, first, second, ...)."""
    queues = [[int(i) for i in first], [int(i) for i in second]]
    heads = [0, 0]
    taken: set[int] = set()
    picks: list[int] = []
    while len(picks) < n:
        j = len(picks)
        q = int(np.ceil((j + 1) * share - 1e-9) > np.ceil(j * share - 1e-9))
        for side in (q, 1 - q):
            while heads[side] < len(queues[side]) and queues[side][heads[side]] in taken:
                heads[side] += 1
            if heads[side] < len(queues[side]):
                i = queues[side][heads[side]]
                picks.append(i)
                taken.add(i)
                break
        else:  # both queues used up
            break
    return picks


def _distances(
    embedding: np.ndarray, picks: Sequence[int], labelled_embedding: np.ndarray | None
) -> np.ndarray:
    """Each pick's cosine distance to the nearest earlier pick or labelled building (1 for the
    first when nothing is labelled)."""
    z = unit(embedding)
    nearest = _distance_to_labelled(z, labelled_embedding)
    dist = []
    for i in picks:
        dist.append(float(nearest[i]) if np.isfinite(nearest[i]) else 1.0)
        nearest = np.minimum(nearest, 1.0 - z @ z[i])
    return np.asarray(dist)


def suggestion_order(
    probabilities: np.ndarray,
    embedding: np.ndarray,
    n: int,
    labelled_embedding: np.ndarray | None = None,
    adapted: bool = False,
    *,
    order: Sequence[int],
    share: float = RANDOM_SHARE,
) -> tuple[np.ndarray, np.ndarray]:
    """The ranking :func:`suggest` uses (module docstring): for a model not adapted to the event
    the first ``n`` of the random ``order``; for an adapted one :func:`rank_buildings` with
    :data:`ADAPTED_UNCERTAINTY` interleaved with ``order`` (``share`` of the picks from it).

    Args:
        probabilities, embedding, n, labelled_embedding: as :func:`rank_buildings`.
        adapted: whether the probabilities are those of a head adapted to the event.
        order: the buildings in a random order (a permutation of their indices: :func:`id_order`
            in the app, the pool's own random order in ``bench fewshot``).
        share: the share of an adapted model's picks taken from ``order``.

    Returns:
        ``(order, distance)`` as :func:`rank_buildings`.
    """
    m = len(probabilities)
    n = max(0, min(int(n), m))
    drawn = np.asarray(order, dtype=np.int64)
    if sorted(drawn.tolist()) != list(range(m)):
        raise ValueError(f"order must be a permutation of the {m} buildings")
    if not adapted:
        picks = drawn[:n].tolist()
    else:
        unsure, _ = rank_buildings(
            probabilities, embedding, n, labelled_embedding, uncertain=ADAPTED_UNCERTAINTY
        )
        picks = interleave(unsure, drawn, n, share)
    return np.asarray(picks, dtype=np.int64), _distances(embedding, picks, labelled_embedding)


def suggest(
    predictor,
    buildings,
    n: int,
    labelled=None,
    batch_size: int = 32,
) -> list[Suggestion]:
    """Rank the unlabelled buildings of ``buildings`` for labelling (the app and ``adapt
    --suggest`` call this).

    Args:
        predictor: the model whose uncertainty counts (an adapted one after a first round).
        buildings: :class:`app.adapt.labelled.Buildings`; its unlabelled ones are ranked, its labelled
            ones count as already labelled.
        n: how many to return.
        labelled: more labelled :class:`~app.adapt.labelled.Buildings` to keep away from; None: none.
        batch_size: chips per inference batch.
    """
    pool = buildings.subset(~buildings.labelled)
    known = [b.subset(b.labelled) for b in (buildings, labelled) if b is not None]
    pred = predictor.predict(pool.pre, pool.post, batch_size=batch_size)
    seen = [
        predictor.predict(b.pre, b.post, batch_size=batch_size).embedding for b in known if len(b)
    ]
    order, dist = suggestion_order(
        pred.probabilities,
        pred.embedding,
        n,
        np.concatenate(seen) if seen else None,
        adapted=getattr(predictor, "head", None) is not None,
        order=id_order(pool.ids),
    )
    margin, entropy = uncertainty(pred.probabilities)
    names = predictor.class_names
    return [
        Suggestion(
            rank=rank + 1,
            id=pool.ref(i).id,
            row=pool.ref(i).row,
            file=pool.ref(i).file,
            event=pool.events[i],
            predicted=names[int(pred.probabilities[i].argmax())],
            confidence=round(float(pred.probabilities[i].max()), 6),
            margin=round(float(margin[i]), 6),
            entropy=round(float(entropy[i]), 6),
            distance=round(float(d), 6),
            key=pool.ids[i],
        )
        for rank, (i, d) in enumerate(zip(order, dist, strict=True))
    ]


def write_suggestions(path: str | os.PathLike, rows: Sequence[Suggestion]) -> Path:
    """Write a ranking as CSV (:data:`COLUMNS`), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, suffix=".csv") as tmp, open(tmp, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(COLUMNS)
        for r in rows:
            writer.writerow(["" if getattr(r, c) is None else getattr(r, c) for c in COLUMNS])
    return path
