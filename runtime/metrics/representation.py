"""Representation-space metrics on L2-normalised embeddings.

The alignment and uniformity metrics follow Sec. 3.1 of Mildenberger et al., "A Tale of Two
Classes: Adapting Supervised Contrastive Learning to Binary Imbalanced Datasets" (CVPR 2025):

- SAD, sample alignment distance (Eq. 1): how far apart two augmented views of a sample land.
- SAA, sample alignment accuracy (Eq. 2): how often a view's own positive is its nearest view.
- CAD, class alignment distance (Eq. 3): how tightly each class clusters.
- CAC, class alignment consistency (Eq. 4): how pure each embedding's neighbourhood is.
- GPU, Gaussian potential uniformity (Eq. 5): how evenly embeddings cover the hypersphere.

The paper writes its formulas for two classes; every function here takes any number. Where a
formula leaves a choice open, the docstring says which reading is implemented. ``class_mean_gram``
measures the geometry LOCAL's orthonormal contrastive loss aims for: class means pairwise
perpendicular (off-diagonal cosines 0) rather than the regular simplex of SupCon (-1/(K-1)).

Everything is NumPy/SciPy (no torch), so evaluation of an exported ONNX model can use it (the
t-SNE plot of the embeddings is :mod:`runtime.metrics.tsne`). Pairwise
distances come from float64 matrix products in row blocks, so memory stays at a few tens of MB for
tens of thousands of embeddings; time grows with N^2.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
from numpy.typing import ArrayLike

#: Row norms of embeddings must lie within this of 1 (they are meant to be L2-normalised).
NORM_TOLERANCE = 1e-3
#: Cosine or squared l2 distances closer than this count as equal (a tie): distances come from
#: float64 matrix products, whose rounding (~1e-16) must not break the ties of equal embeddings.
TIE_TOLERANCE = 1e-9
#: Bytes of one block of the pairwise distance matrix (float64).
_BLOCK_BYTES = 32 * 2**20

# --------------------------------------------------------------------------------------------
# input checks and helpers


def check_embeddings(z: ArrayLike, name: str = "z") -> np.ndarray:
    """Return ``z`` as float64 [N, D] after checking it is finite and L2-normalised.

    Raises:
        ValueError: naming ``name`` when ``z`` is not 2-D, is empty, holds NaN/inf, or has a row
            whose norm differs from 1 by more than ``NORM_TOLERANCE``.
    """
    arr = np.asarray(z, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(
            f"{name} must be a non-empty [N, D] array of embeddings, got shape {arr.shape}"
        )
    if not np.isfinite(arr).all():
        bad = int((~np.isfinite(arr)).any(axis=1).sum())
        raise ValueError(f"{name} has {bad} row(s) with NaN or inf values")
    norms = np.linalg.norm(arr, axis=1)
    off = np.abs(norms - 1.0) > NORM_TOLERANCE
    if off.any():
        raise ValueError(
            f"{name} must be L2-normalised (every row norm 1 +- {NORM_TOLERANCE}); {int(off.sum())} "
            f"of {len(arr)} rows are not (norms from {norms.min():.4g} to {norms.max():.4g}). "
            "Divide each row by its norm first."
        )
    return arr


def check_labels(
    labels: ArrayLike, n: int | None = None, num_classes: int | None = None, name: str = "labels"
) -> np.ndarray:
    """Return ``labels`` as int64 [n] after checking shape, integrality and range.

    Args:
        labels: [n] class ids.
        n: the number of items they label (any length when None).
        num_classes: when given, ids must lie in ``[0, num_classes)``.
        name: what to call ``labels`` in error messages.

    Raises:
        ValueError: when the shape is wrong, a value is not an integer, or an id is out of range
            (for example -1, the chip store's mark for an unlabelled building).
    """
    arr = np.asarray(labels)
    if arr.ndim != 1 or (n is not None and arr.shape[0] != n):
        want = "[N]" if n is None else f"[N] with N = {n} (one per item)"
        raise ValueError(f"{name} must be {want}, got shape {arr.shape}")
    integral = arr.dtype.kind in "iub" or (
        arr.dtype.kind == "f"
        and bool(np.all(np.isfinite(arr)))
        and bool(np.all(arr == np.round(arr)))
    )
    if not integral:
        raise ValueError(f"{name} must hold integer class ids, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if num_classes is not None:
        bad = (arr < 0) | (arr >= num_classes)
        if bad.any():
            values = sorted({int(v) for v in arr[bad]})[:10]
            raise ValueError(
                f"{name} must hold class ids in [0, {num_classes}); {int(bad.sum())} do not "
                f"(values {values}). Drop unlabelled items (label -1) before computing metrics."
            )
    return arr


def _check_pair(z_view1: ArrayLike, z_view2: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    a = check_embeddings(z_view1, "z_view1")
    b = check_embeddings(z_view2, "z_view2")
    if a.shape != b.shape:
        raise ValueError(
            f"z_view1 and z_view2 must have the same shape (row i = two views of sample i), "
            f"got {a.shape} and {b.shape}"
        )
    if len(a) < 2:
        raise ValueError(
            "sample alignment accuracy needs at least 2 samples (negatives to compare)"
        )
    return a, b


def _row_blocks(n_rows: int, n_cols: int) -> Iterator[slice]:
    step = max(1, _BLOCK_BYTES // (8 * max(n_cols, 1)))
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))


def neighbourhood_size(n: int, fraction: float) -> int:
    """Neighbours per embedding for CAC: ``floor(fraction * n)``, at least 1 and at most n - 1."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if n < 2:
        raise ValueError("class alignment consistency needs at least 2 embeddings")
    return int(min(n - 1, max(1, math.floor(fraction * n + 1e-9))))


# --------------------------------------------------------------------------------------------
# per-item building blocks (labels group them into per-class values)


def sample_alignment_distances(z_view1: ArrayLike, z_view2: ArrayLike) -> np.ndarray:
    """Per-sample l2 distance between the two views' embeddings, float64 [N]."""
    a, b = _check_pair(z_view1, z_view2)
    return np.linalg.norm(a - b, axis=1)


def _sq_dists(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Squared l2 distances [len(a), len(b)] from one matrix product (BLAS), clipped at 0."""
    d2 = np.einsum("ij,ij->i", a, a)[:, None] + np.einsum("ij,ij->i", b, b)[None, :]
    d2 -= 2.0 * (a @ b.T)
    return np.maximum(d2, 0.0, out=d2)


def _saa_hits_one_way(anchor: np.ndarray, other: np.ndarray) -> np.ndarray:
    n = len(anchor)
    views = np.concatenate([anchor, other])  # W: anchor views 0..n-1, positives n..2n-1
    hits = np.zeros(n, dtype=bool)
    for block in _row_blocks(n, 2 * n):
        rows = np.arange(block.start, block.stop)
        local = rows - block.start
        d2 = _sq_dists(anchor[block], views)  # [b, 2N]
        positive = d2[local, n + rows].copy()
        d2[local, rows] = np.inf  # the anchor itself
        d2[local, n + rows] = np.inf  # its positive
        hits[block] = positive < d2.min(axis=1) - TIE_TOLERANCE
    return hits


def sample_alignment_hits(
    z_view1: ArrayLike, z_view2: ArrayLike, symmetric: bool = False
) -> np.ndarray:
    """Per-sample SAA indicator: is the positive strictly nearer than every negative view?

    Returns float64 [N] of 0/1 (0, 0.5 or 1 when ``symmetric``). See
    ``sample_alignment_accuracy`` for the definition.
    """
    a, b = _check_pair(z_view1, z_view2)
    hits = _saa_hits_one_way(a, b).astype(np.float64)
    if symmetric:
        hits = 0.5 * (hits + _saa_hits_one_way(b, a))
    return hits


def class_alignment_consistencies(
    z: ArrayLike, labels: ArrayLike, fraction: float = 0.05
) -> np.ndarray:
    """Per-embedding CAC term: share of its nearest neighbours that have its class, float64 [N].

    See ``class_alignment_consistency`` for the definition, the neighbourhood size and ties.
    """
    arr = check_embeddings(z)
    y = check_labels(labels, len(arr))
    n = len(arr)
    k = neighbourhood_size(n, fraction)
    unit = arr / np.linalg.norm(arr, axis=1, keepdims=True)
    out = np.empty(n, dtype=np.float64)
    for block in _row_blocks(n, n):
        local = np.arange(block.stop - block.start)
        d = 1.0 - unit[block] @ unit.T  # cosine distance, [b, N]
        d[local, block.start + local] = np.inf  # the embedding itself is not its own neighbour
        kth = np.partition(d, k - 1, axis=1)[:, k - 1 : k]
        closer = d < kth - TIE_TOLERANCE
        tied = ~closer & (d <= kth + TIE_TOLERANCE)
        same = y[None, :] == y[block, None]
        slots = k - closer.sum(axis=1)  # neighbourhood places left for the tied boundary group
        tied_same_share = (tied & same).sum(axis=1) / tied.sum(axis=1)
        out[block] = ((closer & same).sum(axis=1) + slots * tied_same_share) / k
    return out


def _sum_pairwise_l2(x: np.ndarray) -> float:
    """Sum of ||x_j - x_k||_2 over unordered pairs j < k of the rows of x."""
    total = 0.0
    for block in _row_blocks(len(x), len(x)):
        local = np.arange(block.stop - block.start)
        d2 = _sq_dists(x[block], x)
        d2[local, block.start + local] = 0.0
        total += float(np.sqrt(d2).sum())
    return total / 2.0  # every pair was counted in both orders


def class_alignment_distances(z: ArrayLike, labels: ArrayLike, num_classes: int) -> np.ndarray:
    """Per-class CAD term, float64 [K]; NaN for classes with no embedding.

    See ``class_alignment_distance`` for the definition.
    """
    arr = check_embeddings(z)
    y = check_labels(labels, len(arr), num_classes)
    out = np.full(num_classes, np.nan)
    for c in range(num_classes):
        members = arr[y == c]
        m = len(members)
        if m:
            out[c] = _sum_pairwise_l2(members) / math.comb(m + 1, 2)
    return out


# --------------------------------------------------------------------------------------------
# the five metrics of Sec. 3.1


def sample_alignment_distance(z_view1: ArrayLike, z_view2: ArrayLike) -> float:
    """Sample alignment distance, SAD (Eq. 1). Lower means the two views agree more.

    Paper: "the average pairwise l2 distance between sample-wise positive pairs":
    ``SAD = 1/|X| * sum_{x in X} ||f(x~) - f(x~+)||_2``. The plain (not squared) l2 distance,
    as written; Wang & Isola's alignment squares it.

    Args:
        z_view1: [N, D] L2-normalised embeddings of the first augmented view of each sample.
        z_view2: [N, D] embeddings of the second view; row i is the positive of row i.

    Returns:
        SAD in [0, 2] (distance on the unit hypersphere).
    """
    return float(sample_alignment_distances(z_view1, z_view2).mean())


def sample_alignment_accuracy(
    z_view1: ArrayLike, z_view2: ArrayLike, symmetric: bool = False
) -> float:
    """Sample alignment accuracy, SAA (Eq. 2). Higher means samples are told apart.

    Paper: "the proportion of all sample-wise positive pairs for which the l2 distance between
    their embeddings is smaller than that to all negative pairs":
    ``SAA = 1/|X| * sum_{x in X} 1( ||f(x~) - f(x~+)|| < min_{x~- in W \\ {x~, x~+}} ||f(x~) - f(x~-)|| )``
    where W is the set of all 2N views.

    Reading: the anchor x~ is the first view of each sample and the negatives are the other
    2N - 2 views (both views of every other sample). The inequality is strict (squared distances
    must differ by more than ``TIE_TOLERANCE``), so a collapsed space (all embeddings equal)
    scores 0, as the paper reads it. ``symmetric=True`` also uses each second view as an anchor
    and averages the two directions (the authors' published code uses every view as an anchor);
    the default is Eq. 2 as written.

    Args:
        z_view1: [N, D] L2-normalised embeddings of the first view, N >= 2.
        z_view2: [N, D] embeddings of the second view; row i is the positive of row i.
        symmetric: average over both views as anchors.

    Returns:
        SAA in [0, 1].
    """
    return float(sample_alignment_hits(z_view1, z_view2, symmetric=symmetric).mean())


def class_alignment_distance(z: ArrayLike, labels: ArrayLike) -> float:
    """Class alignment distance, CAD (Eq. 3, after Li et al.). Lower means tighter classes.

    Paper: ``CAD = 1/C * sum_i 1/binom(|X_i|+1, 2) * sum_{x~, x~' in W_i} ||f(x~) - f(x~')||_2``
    over "all unique pairs of samples in W_i".

    Reading: W_i is the set of embeddings passed for class i and |X_i| its size m. The
    normaliser binom(m+1, 2) = m(m+1)/2 counts unordered pairs *including* the m self-pairs,
    whose distance is 0, so each class term is the mean l2 distance over those pairs (0 for a
    single-member class). C is the number of classes present in ``labels``; absent classes have
    no term.

    Args:
        z: [N, D] L2-normalised embeddings.
        labels: [N] integer class ids.

    Returns:
        CAD in [0, 2).
    """
    arr = check_embeddings(z)
    y = check_labels(labels, len(arr))
    if y.min() < 0:
        raise ValueError("labels must be non-negative class ids; drop unlabelled items (-1) first")
    per_class = class_alignment_distances(arr, y, int(y.max()) + 1)
    return float(np.nanmean(per_class))


def class_alignment_consistency(z: ArrayLike, labels: ArrayLike, fraction: float = 0.05) -> float:
    """Class alignment consistency, CAC (Eq. 4). Higher means purer neighbourhoods.

    Paper: "class alignment within a local neighborhood of the closest r views to x~ ... we set
    r to 5% of all views": ``CAC = 1/|D| * sum_{(x~, W_x~) in D} 1/|W_x~| * sum_{x~' in W_x~}
    1(g(x~) = g(x~'))``, averaged over every embedding x~.

    Reading: closeness is cosine similarity (the same order as l2 distance on the unit sphere);
    the neighbourhood holds r = floor(fraction * N) embeddings (at least 1, at most N - 1) and
    never the embedding itself. Where several embeddings tie at the neighbourhood's boundary,
    they share its remaining places equally (the expected purity under a random tie-break), so
    the result does not depend on the order of the rows. Collapsed embeddings therefore score the
    mean share of each embedding's own class among the others.

    Args:
        z: [N, D] L2-normalised embeddings, N >= 2.
        labels: [N] integer class ids.
        fraction: neighbourhood size as a fraction of N (the paper's 5%).

    Returns:
        CAC in [0, 1]; 1 when every neighbourhood holds only its own class.
    """
    return float(class_alignment_consistencies(z, labels, fraction).mean())


def gaussian_potential_uniformity(z: ArrayLike, t: float = 1.0, self_pairs: bool = True) -> float:
    """Gaussian potential uniformity, GPU (Eq. 5). Lower means more evenly spread.

    Paper: ``GPU = log( 1/binom(N+1, 2) * sum_k sum_j exp(-||f(x~_k) - f(x~_j)||_2^2) )``.

    Reading: the normaliser binom(N+1, 2) counts unordered pairs with the N self-pairs, so the
    double sum is read over k <= j: GPU is the log of the mean potential over those pairs, and
    a collapsed space scores exactly 0 (summed over all N^2 ordered pairs it would not be a mean
    and could exceed 0). The exponent has no temperature in Eq. 5 (``t=1``). ``t=2,
    self_pairs=False`` gives Wang & Isola's uniformity ``log mean_{i<j} exp(-2 ||z_i - z_j||^2)``,
    the form the authors' published code evaluates (per class there, without the log).

    Args:
        z: [N, D] L2-normalised embeddings.
        t: temperature of the Gaussian potential, > 0.
        self_pairs: include the k = j pairs (Eq. 5); without them N must be >= 2.

    Returns:
        GPU <= 0; 0 for fully collapsed embeddings, about -4t for two antipodal clusters.
    """
    if not t > 0:
        raise ValueError(f"t must be positive, got {t}")
    arr = check_embeddings(z)
    n = len(arr)
    if not self_pairs and n < 2:
        raise ValueError("uniformity without self-pairs needs at least 2 embeddings")
    log_off = -np.inf  # log of the sum over ordered pairs k != j
    for block in _row_blocks(n, n):
        local = np.arange(block.stop - block.start)
        logits = _sq_dists(arr[block], arr)
        logits *= -t
        logits[local, block.start + local] = -np.inf
        top = logits.max()
        if np.isfinite(top):  # a log-sum-exp, shifted by the block's largest term
            np.exp(logits - top, out=logits)
            log_off = np.logaddexp(log_off, top + math.log(logits.sum()))
    log_pairs = log_off - math.log(2.0)  # unordered pairs k < j
    if self_pairs:
        return float(np.logaddexp(log_pairs, math.log(n)) - math.log(math.comb(n + 1, 2)))
    return float(log_pairs - math.log(math.comb(n, 2)))


def unit_rows(x: ArrayLike, min_norm: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """Embeddings re-normalised in float64, and which rows are real directions.

    The model L2-normalises its embeddings, but under mixed precision the norms drift a little,
    and ``z`` is exactly the zero vector when a chip's pre and post images give the same
    projection (the fixed-difference correlation of identical inputs). Such rows have no
    direction: they are flagged so the representation metrics and plots can leave them out.

    Args:
        x: [N, D] embeddings.
        min_norm: rows with a smaller norm count as zero.

    Returns:
        ``(unit, valid)``: float64 [N, D] with every valid row of norm 1 (others 0) and bool [N].
    """
    arr = np.asarray(x, dtype=np.float64)
    norms = np.linalg.norm(arr, axis=1)
    valid = np.isfinite(norms) & (norms > min_norm)
    unit = np.zeros_like(arr)
    unit[valid] = arr[valid] / norms[valid, None]
    return unit, valid


def class_mean_gram(z: ArrayLike, labels: ArrayLike, num_classes: int) -> tuple[np.ndarray, float]:
    """Cosine Gram matrix of the class means: how close the classes are to orthonormal.

    LOCAL's orthonormal contrastive loss drives class embeddings towards pairwise perpendicular
    directions (off-diagonal cosines 0); SupCon drives them to a regular simplex (-1/(K-1)).

    Args:
        z: [N, D] L2-normalised embeddings.
        labels: [N] class ids in [0, num_classes).
        num_classes: K.

    Returns:
        ``(gram, max_offdiag_abs_cos)``: gram float64 [K, K] with ``gram[a, b]`` the cosine
        between the mean embeddings of classes a and b (rows/columns NaN for classes absent from
        ``z`` or whose mean is the zero vector), and the largest ``|gram[a, b]|`` over a != b
        among the others (NaN when fewer than two classes remain).
    """
    arr = check_embeddings(z)
    sums = np.zeros((num_classes, arr.shape[1]))
    np.add.at(sums, check_labels(labels, len(arr), num_classes), arr)
    return gram_of_sums(sums)


def gram_of_sums(sums: ArrayLike) -> tuple[np.ndarray, float]:
    """:func:`class_mean_gram` from per-class sums of embeddings (``[K, D]``, zero rows absent).

    A class's mean has the direction of its sum, so sums accumulated batch by batch (during a
    training epoch, say) give the same Gram matrix as the stacked embeddings would.
    """
    sums = np.asarray(sums, dtype=np.float64)
    norms = np.linalg.norm(sums, axis=1)
    valid = norms > 1e-12
    means = np.full(sums.shape, np.nan)
    means[valid] = sums[valid] / norms[valid, None]
    gram = np.clip(means @ means.T, -1.0, 1.0)
    gram[valid, valid] = 1.0
    return gram, gram_summary(gram)["max_abs_cos"]


def gram_summary(gram: np.ndarray) -> dict[str, float]:
    """``max_abs_cos`` and ``mean_offdiag_cos`` of a class-mean Gram matrix (NaN rows skipped).

    OCL aims at 0 for both; SupCon's regular simplex has every off-diagonal cosine at -1/(K-1).
    """
    valid = ~np.isnan(np.diag(gram))
    off = gram[np.ix_(valid, valid)][~np.eye(int(valid.sum()), dtype=bool)]
    if not off.size:
        return {"max_abs_cos": float("nan"), "mean_offdiag_cos": float("nan")}
    return {"max_abs_cos": float(np.abs(off).max()), "mean_offdiag_cos": float(off.mean())}


# --------------------------------------------------------------------------------------------
# the JSON-ready bundle


def _json_float(x: float) -> float | None:
    return None if x is None or not np.isfinite(x) else float(x)


def representation_metrics(
    z: ArrayLike,
    labels: ArrayLike,
    class_names: Sequence[str],
    z_view2: ArrayLike | None = None,
    fraction: float = 0.05,
) -> dict:
    """All representation metrics of a set of embeddings, as a JSON-ready dict.

    CAC, CAD, GPU and the class-mean Gram matrix are computed on ``z`` (one embedding per
    sample, the set W of the paper); SAA and SAD only when ``z_view2`` gives a second view of
    every sample, with ``z`` as the first view. Values that are undefined (an absent class) are
    ``None``.

    Args:
        z: [N, D] L2-normalised embeddings, N >= 2.
        labels: [N] class ids in [0, K).
        class_names: the K class names, in label order.
        z_view2: optional [N, D] embeddings of a second augmented view of the same samples.
        fraction: CAC neighbourhood size as a fraction of N.

    Returns:
        ``{"n", "dim", "cac", "cac_neighbours", "cad", "gpu", "class_mean_gram" (K x K list),
        "max_offdiag_abs_cos", "per_class": {name: {"n", "cac", "cad"[, "saa", "sad"]}}}`` plus
        ``"saa"`` and ``"sad"`` when ``z_view2`` is given.
    """
    k = len(class_names)
    if k == 0:
        raise ValueError("class_names must name at least one class")
    arr = check_embeddings(z)
    y = check_labels(labels, len(arr), k)
    counts = np.bincount(y, minlength=k)
    cac_items = class_alignment_consistencies(arr, y, fraction)
    cad = class_alignment_distances(arr, y, k)
    gram, max_off = class_mean_gram(arr, y, k)
    out: dict = {
        "n": int(len(arr)),
        "dim": int(arr.shape[1]),
        "cac": float(cac_items.mean()),
        "cac_neighbours": neighbourhood_size(len(arr), fraction),
        "cad": float(np.nanmean(cad)),
        "gpu": gaussian_potential_uniformity(arr),
        "class_mean_gram": [[_json_float(v) for v in row] for row in gram],
        "max_offdiag_abs_cos": _json_float(max_off),
    }
    per_class: dict[str, dict] = {
        name: {
            "n": int(counts[c]),
            "cac": float(cac_items[y == c].mean()) if counts[c] else None,
            "cad": _json_float(cad[c]),
        }
        for c, name in enumerate(class_names)
    }
    if z_view2 is not None:
        if np.shape(z_view2) != arr.shape:
            raise ValueError(
                f"z_view2 must have the shape of z {arr.shape} (row i = second view of sample i), "
                f"got {np.shape(z_view2)}"
            )
        hits = sample_alignment_hits(arr, z_view2)
        dists = sample_alignment_distances(arr, z_view2)
        out["saa"] = float(hits.mean())
        out["sad"] = float(dists.mean())
        for c, name in enumerate(class_names):
            members = y == c
            per_class[name]["saa"] = float(hits[members].mean()) if counts[c] else None
            per_class[name]["sad"] = float(dists[members].mean()) if counts[c] else None
    out["per_class"] = per_class
    return out
