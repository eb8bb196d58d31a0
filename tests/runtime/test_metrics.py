"""Metrics against hand-computed cases, naive loops written from the formulas, and edge cases."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from data_prep.xview2 import xview2_harmonic_mean
from runtime.metrics import (
    class_alignment_consistency,
    class_alignment_distance,
    class_mean_gram,
    classification_metrics,
    gaussian_potential_uniformity,
    gram_of_sums,
    gram_summary,
    plot_confusion_matrix,
    plot_embedding_tsne,
    representation_metrics,
    sample_alignment_accuracy,
    sample_alignment_distance,
)
from runtime.metrics.representation import class_alignment_consistencies

NAMES = ["no-damage", "minor-damage", "major-damage", "destroyed"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def deg(*angles: float) -> np.ndarray:
    """2-D unit vectors at the given angles in degrees, [N, 2]."""
    a = np.radians(np.asarray(angles, dtype=np.float64))
    return np.stack([np.cos(a), np.sin(a)], axis=1)


def clusters(n_per_class, dim=8, noise=0.3, seed=0, view_noise=None):
    """Seeded noisy clusters around orthonormal class directions; returns z, labels (, z2)."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(len(n_per_class)), n_per_class)
    z = np.eye(dim)[labels] + noise * rng.normal(size=(len(labels), dim))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    if view_noise is None:
        return z, labels
    z2 = z + view_noise * rng.normal(size=z.shape)
    z2 /= np.linalg.norm(z2, axis=1, keepdims=True)
    return z, labels, z2


# ---------------------------------------------------------------------------------------------
# naive loops written straight from the paper's formulas (Sec. 3.1 of paper 001)


def naive_saa(z1, z2):
    n = len(z1)
    views = list(z1) + list(z2)
    hits = 0
    for i in range(n):
        pos = np.linalg.norm(z1[i] - z2[i])
        neg = min(np.linalg.norm(z1[i] - w) for j, w in enumerate(views) if j not in (i, n + i))
        hits += pos < neg
    return hits / n


def naive_cac(z, labels, r):
    total = 0.0
    for i in range(len(z)):
        sims = [(float(z[i] @ z[j]), j) for j in range(len(z)) if j != i]
        neighbours = [j for _, j in sorted(sims, reverse=True)[:r]]
        total += np.mean([labels[j] == labels[i] for j in neighbours])
    return total / len(z)


def naive_cad(z, labels):
    terms = []
    for c in np.unique(labels):
        members = z[labels == c]
        m = len(members)
        pair_sum = sum(np.linalg.norm(a - b) for a, b in itertools.combinations(members, 2))
        terms.append(pair_sum / math.comb(m + 1, 2))
    return float(np.mean(terms))


def naive_gpu(z):
    n = len(z)
    total = sum(math.exp(-float(np.sum((z[k] - z[j]) ** 2))) for k in range(n) for j in range(k, n))
    return math.log(total / math.comb(n + 1, 2))


# ---------------------------------------------------------------------------------------------
# SAD and SAA


def test_sad_by_hand():
    # sample 0: views at 0 and 60 degrees -> chord 1; sample 1: identical views -> 0
    z1 = deg(0, 90)
    z2 = deg(60, 90)
    assert sample_alignment_distance(z1, z2) == pytest.approx(0.5)


def test_saa_by_hand():
    # view 1 at 0, 90, 180 degrees; view 2 at 10, 100, 300 degrees.
    # sample 0: positive 10 deg away, nearest negative (300) 60 deg away -> hit
    # sample 1: positive 10 deg away, nearest negatives (10, 180) 80 / 90 deg away -> hit
    # sample 2: positive 120 deg away, negative at 100 deg only 80 deg away -> miss
    z1, z2 = deg(0, 90, 180), deg(10, 100, 300)
    assert sample_alignment_accuracy(z1, z2) == pytest.approx(2 / 3)


def test_saa_symmetric_by_hand():
    # view 1 at 0, 90, 180, 270; view 2 at 10, 100, 250, 280 degrees.
    # One way every sample hits (180 -> its positive 250 is 70 deg away, nearest negative 100 is
    # 80). With view 2 as anchors, 250 has the negative 270 only 20 deg away: 7 of 8 hits.
    z1, z2 = deg(0, 90, 180, 270), deg(10, 100, 250, 280)
    assert sample_alignment_accuracy(z1, z2) == pytest.approx(1.0)
    assert sample_alignment_accuracy(z1, z2, symmetric=True) == pytest.approx(7 / 8)


def test_saa_collapsed_is_zero_and_sad_is_zero():
    z = np.tile(deg(30), (6, 1))
    assert sample_alignment_accuracy(z, z) == 0.0  # strict inequality: ties are misses
    assert sample_alignment_distance(z, z) == 0.0


def test_saa_matches_naive_loop():
    z1, _, z2 = clusters([7, 5, 4], noise=0.6, seed=3, view_noise=0.5)
    value = sample_alignment_accuracy(z1, z2)
    assert value == pytest.approx(naive_saa(z1, z2))
    assert 0.0 < value < 1.0  # the case is not degenerate


# ---------------------------------------------------------------------------------------------
# CAC


def test_cac_by_hand():
    # class 0 at 0, 10, 20 deg; class 1 at 25, 90, 100 deg; N = 6, fraction 0.34 -> 2 neighbours
    # 0 -> {10, 20}: 1 | 10 -> {0, 20}: 1 | 20 -> {25, 10}: 1/2
    # 25 -> {20, 10}: 0 | 90 -> {100, 25}: 1 | 100 -> {90, 25}: 1   (25 is class 1)
    z = deg(0, 10, 20, 25, 90, 100)
    y = [0, 0, 0, 1, 1, 1]
    assert class_alignment_consistency(z, y, fraction=0.34) == pytest.approx(4.5 / 6)
    items = class_alignment_consistencies(z, y, fraction=0.34)
    np.testing.assert_allclose(items, [1, 1, 0.5, 0, 1, 1])


def test_cac_perfect_clusters_is_one():
    z, y = clusters([30, 25, 20, 25], noise=0.05)
    assert class_alignment_consistency(z, y) == 1.0


def test_cac_ties_share_the_boundary_places():
    # all embeddings equal; 2 of the 3 others are neighbours, chosen fairly among the tie:
    # class-0 anchors expect 2/3 of them own-class, the class-1 anchor 0 -> mean 0.5
    z = np.tile(deg(45), (4, 1))
    for y in ([0, 0, 0, 1], [1, 0, 0, 0], [0, 1, 0, 0]):
        assert class_alignment_consistency(z, y, fraction=0.5) == pytest.approx(0.5)


def test_cac_matches_naive_loop_and_excludes_self():
    z, y = clusters([12, 9, 9], noise=0.7, seed=5)
    r = math.floor(0.2 * len(z))
    value = class_alignment_consistency(z, y, fraction=0.2)
    assert value == pytest.approx(naive_cac(z, y, r))
    assert 0.0 < value < 1.0


def test_cac_neighbourhood_is_five_percent_by_default():
    z, y = clusters([25, 20, 15], noise=0.8, seed=9)  # N = 60 -> 3 neighbours
    assert naive_cac(z, y, 3) != pytest.approx(naive_cac(z, y, 1))  # the size matters here
    assert class_alignment_consistency(z, y) == pytest.approx(naive_cac(z, y, 3))
    assert representation_metrics(z, y, ["a", "b", "c"])["cac_neighbours"] == 3


# ---------------------------------------------------------------------------------------------
# CAD


def test_cad_by_hand():
    # class 0 at 0, 60, 120 deg: chords 1, 1, sqrt(3) over binom(4, 2) = 6 pairs with self-pairs
    # class 1 a single embedding: 0 over binom(2, 2) = 1
    z = deg(0, 60, 120, 200)
    y = [0, 0, 0, 1]
    expected = ((2 + math.sqrt(3)) / 6 + 0.0) / 2
    assert class_alignment_distance(z, y) == pytest.approx(expected)


def test_cad_matches_naive_loop_and_skips_absent_classes():
    z, y = clusters([6, 0, 5, 3], noise=0.5, seed=2)  # class 1 absent
    assert class_alignment_distance(z, y) == pytest.approx(naive_cad(z, y))


def test_cad_collapsed_classes_is_zero():
    z = np.concatenate([np.tile(deg(0), (5, 1)), np.tile(deg(90), (4, 1))])
    assert class_alignment_distance(z, [0] * 5 + [1] * 4) == 0.0


# ---------------------------------------------------------------------------------------------
# GPU


def test_gpu_by_hand():
    # two antipodal points: pairs (1,1), (2,2) potential 1, (1,2) exp(-4) -> mean over 3
    z = deg(0, 180)
    assert gaussian_potential_uniformity(z) == pytest.approx(math.log((2 + math.exp(-4)) / 3))
    # Wang & Isola form: only the pair 1-2, t = 2 -> log exp(-8)
    assert gaussian_potential_uniformity(z, t=2, self_pairs=False) == pytest.approx(-8.0)
    # orthonormal triple: every distinct pair has squared distance 2
    e = np.eye(3)
    assert gaussian_potential_uniformity(e) == pytest.approx(math.log((3 + 3 * math.exp(-2)) / 6))
    assert gaussian_potential_uniformity(e, t=2, self_pairs=False) == pytest.approx(-4.0)


def test_gpu_collapsed_is_zero_in_both_forms():
    z = np.tile(deg(77), (9, 1))
    assert gaussian_potential_uniformity(z) == pytest.approx(0.0, abs=1e-12)
    assert gaussian_potential_uniformity(z, t=2, self_pairs=False) == pytest.approx(0.0, abs=1e-12)


def test_gpu_matches_naive_loop_and_spread_is_lower():
    z, _ = clusters([10, 10, 10], noise=0.4, seed=7)
    value = gaussian_potential_uniformity(z)
    assert value == pytest.approx(naive_gpu(z))
    tight, _ = clusters([10, 10, 10], noise=0.01, seed=7)
    # spreading points around the whole circle lowers GPU relative to a 30-degree arc
    arc = deg(*np.linspace(0, 30, 30))
    circle = deg(*np.arange(0, 360, 12))
    assert gaussian_potential_uniformity(circle) < gaussian_potential_uniformity(arc)
    assert gaussian_potential_uniformity(tight) < 0.0


# ---------------------------------------------------------------------------------------------
# class-mean Gram matrix


def test_gram_orthonormal_classes():
    z, y = clusters([5, 5, 5, 5], noise=0.0)
    gram, max_off = class_mean_gram(z, y, 4)
    np.testing.assert_allclose(gram, np.eye(4), atol=1e-12)
    assert max_off == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("k", [3, 4])
def test_gram_regular_simplex(k):
    # vertices of a regular simplex: centred standard basis of R^k, normalised
    vertices = np.eye(k) - 1.0 / k
    vertices /= np.linalg.norm(vertices, axis=1, keepdims=True)
    y = np.repeat(np.arange(k), 3)
    gram, max_off = class_mean_gram(vertices[y], y, k)
    off = gram[~np.eye(k, dtype=bool)]
    np.testing.assert_allclose(off, -1.0 / (k - 1))
    np.testing.assert_allclose(np.diag(gram), 1.0)
    assert max_off == pytest.approx(1.0 / (k - 1))


def test_gram_of_batch_sums_matches_the_stacked_embeddings():
    # Sums accumulated batch by batch (as training does) give the Gram of all embeddings at once.
    rng = np.random.default_rng(3)
    z = rng.normal(size=(60, 5)) + np.repeat(np.eye(4, 5) * 3, 15, axis=0)
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    y = np.repeat(np.arange(4), 15)
    order = rng.permutation(60)
    sums = np.zeros((4, 5))
    for batch in np.array_split(order, 7):
        np.add.at(sums, y[batch], z[batch])
    want, want_max = class_mean_gram(z, y, 4)
    got, got_max = gram_of_sums(sums)
    np.testing.assert_allclose(got, want, atol=1e-12)
    assert got_max == pytest.approx(want_max) and want_max > 0.05


@pytest.mark.parametrize("k", [3, 4])
def test_gram_summary_tells_orthonormal_from_simplex(k):
    vertices = np.eye(k) - 1.0 / k
    vertices /= np.linalg.norm(vertices, axis=1, keepdims=True)
    simplex = gram_summary(gram_of_sums(vertices)[0])
    assert simplex["mean_offdiag_cos"] == pytest.approx(-1.0 / (k - 1))
    assert simplex["max_abs_cos"] == pytest.approx(1.0 / (k - 1))
    ortho = gram_summary(gram_of_sums(np.eye(k) * 2.0)[0])
    assert ortho == {"max_abs_cos": 0.0, "mean_offdiag_cos": 0.0}
    # an absent class (zero sum) is left out, not counted as a cosine of 0
    partial = np.eye(k)
    partial[0] = 0.0
    partial[1] = [0.0, 0.6, 0.8] + [0.0] * (k - 3)  # 0.8 against class 2
    summary = gram_summary(gram_of_sums(partial)[0])
    assert summary["max_abs_cos"] == pytest.approx(0.8)
    same = gram_summary(gram_of_sums(np.ones((k, k)))[0])
    assert same["max_abs_cos"] == pytest.approx(1.0) and same["mean_offdiag_cos"] == pytest.approx(
        1.0
    )


def test_gram_absent_class_is_nan_and_excluded():
    # classes 0 and 2 at 60 degrees apart, class 1 absent
    z = deg(0, 0, 60)
    gram, max_off = class_mean_gram(z, [0, 0, 2], 3)
    assert np.isnan(gram[1]).all() and np.isnan(gram[:, 1]).all()
    assert gram[0, 2] == pytest.approx(0.5)
    assert max_off == pytest.approx(0.5)
    _, single = class_mean_gram(z, [0, 0, 0], 3)
    assert math.isnan(single)


def test_gram_uses_class_means_not_members():
    # class 0 members at +-40 deg average to 0 deg; class 1 at 90 deg -> perpendicular means
    z = deg(40, -40, 90)
    gram, max_off = class_mean_gram(z, [0, 0, 1], 2)
    assert max_off == pytest.approx(0.0, abs=1e-12)
    assert gram[0, 1] == pytest.approx(0.0, abs=1e-12)


# ---------------------------------------------------------------------------------------------
# the bundle, invariances and input errors


def test_representation_metrics_bundle_is_json_ready():
    z, y, z2 = clusters([8, 6, 0, 6], noise=0.3, seed=1, view_noise=0.1)
    out = representation_metrics(z, y, NAMES, z_view2=z2)
    text = json.dumps(out, allow_nan=False)  # no NaN anywhere: absent class -> null
    assert json.loads(text)["per_class"]["major-damage"] == {
        "n": 0,
        "cac": None,
        "cad": None,
        "saa": None,
        "sad": None,
    }
    assert out["saa"] == pytest.approx(sample_alignment_accuracy(z, z2))
    assert out["sad"] == pytest.approx(sample_alignment_distance(z, z2))
    assert out["cac"] == pytest.approx(class_alignment_consistency(z, y))
    assert out["cad"] == pytest.approx(class_alignment_distance(z, y))
    assert out["gpu"] == pytest.approx(gaussian_potential_uniformity(z))
    assert out["class_mean_gram"][2] == [None] * 4
    assert out["n"] == 20 and out["dim"] == 8 and out["cac_neighbours"] == 1
    # per-class SAD averages back to the overall SAD, weighted by counts
    weighted = sum(v["n"] * v["sad"] for v in out["per_class"].values() if v["n"])
    assert weighted / out["n"] == pytest.approx(out["sad"])


def test_representation_metrics_without_second_view_has_no_saa():
    z, y = clusters([5, 5], noise=0.2)
    out = representation_metrics(z, y, ["a", "b"])
    assert "saa" not in out and "sad" not in out
    assert "saa" not in out["per_class"]["a"]


def test_permutation_invariance():
    z, y, z2 = clusters([9, 7, 5, 4], noise=0.6, seed=11, view_noise=0.4)
    perm = np.random.default_rng(0).permutation(len(z))
    a = representation_metrics(z, y, NAMES, z_view2=z2, fraction=0.1)
    b = representation_metrics(z[perm], y[perm], NAMES, z_view2=z2[perm], fraction=0.1)
    for key in ("saa", "sad", "cac", "cad", "gpu", "max_offdiag_abs_cos"):
        assert b[key] == pytest.approx(a[key]), key
    np.testing.assert_allclose(b["class_mean_gram"], a["class_mean_gram"])
    yp = np.random.default_rng(1).integers(0, 4, len(y))
    assert classification_metrics(y[perm], yp[perm], NAMES) == classification_metrics(y, yp, NAMES)


def test_block_computation_matches_single_block(monkeypatch):
    import runtime.metrics.representation as rep

    z, y, z2 = clusters([20, 15, 10], noise=0.5, seed=4, view_noise=0.3)
    whole = representation_metrics(z, y, ["a", "b", "c"], z_view2=z2, fraction=0.1)
    monkeypatch.setattr(rep, "_BLOCK_BYTES", 8 * 90 * 7)  # 7 rows a block
    blocked = representation_metrics(z, y, ["a", "b", "c"], z_view2=z2, fraction=0.1)
    for key in ("saa", "sad", "cac", "cad", "gpu"):
        assert blocked[key] == pytest.approx(whole[key]), key


def test_errors_name_the_problem():
    z, y = clusters([4, 4])
    with pytest.raises(ValueError, match="z must be L2-normalised"):
        class_alignment_consistency(2 * z, y)
    with pytest.raises(ValueError, match=r"class ids in \[0, 2\).*-1"):
        representation_metrics(z, np.r_[y[:-1], -1], ["a", "b"])
    with pytest.raises(ValueError, match="labels must be \\[N\\] with N = 8"):
        class_alignment_consistency(z, y[:5])
    with pytest.raises(ValueError, match="same shape"):
        sample_alignment_accuracy(z, z[:6])
    with pytest.raises(ValueError, match="NaN"):
        gaussian_potential_uniformity(np.full((3, 2), np.nan))
    with pytest.raises(ValueError, match="fraction"):
        class_alignment_consistency(z, y, fraction=0.0)
    with pytest.raises(ValueError, match="shape of z"):
        representation_metrics(z, y, ["a", "b"], z_view2=z[:3])


# ---------------------------------------------------------------------------------------------
# classification


def test_classification_by_hand():
    y_true = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3]
    y_pred = [0, 0, 1, 1, 1, 2, 2, 3, 0, 3]
    out = classification_metrics(y_true, y_pred, NAMES)
    assert out["confusion_matrix"] == [[2, 1, 0, 0], [0, 2, 0, 0], [1, 0, 2, 1], [0, 0, 0, 1]]
    assert out["n"] == 10
    assert out["accuracy"] == pytest.approx(0.7)
    # per class (P, R, F1): 0: 2/3, 2/3, 2/3 | 1: 2/3, 1, 4/5 | 2: 1, 1/2, 2/3 | 3: 1/2, 1, 2/3
    pc = out["per_class"]
    assert pc["no-damage"] == pytest.approx(
        {"precision": 2 / 3, "recall": 2 / 3, "f1": 2 / 3, "support": 3}
    )
    assert pc["minor-damage"]["f1"] == pytest.approx(0.8)
    assert pc["major-damage"]["precision"] == pytest.approx(1.0)
    assert pc["major-damage"]["recall"] == pytest.approx(0.5)
    assert pc["destroyed"]["precision"] == pytest.approx(0.5)
    assert out["macro_f1"] == pytest.approx((3 * 2 / 3 + 0.8) / 4)
    # harmonic mean: 4 / (3/2 + 5/4 + 3/2 + 3/2) = 4 / 5.75
    assert out["xview2_damage_f1"] == pytest.approx(4 / 5.75)
    assert out["absent_classes"] == []
    json.dumps(out, allow_nan=False)


def test_classification_absent_class_is_skipped_but_kept_in_the_matrix():
    # "destroyed" neither true nor predicted: 4x4 matrix, averages over the other three
    y_true = [0, 0, 1, 2, 2]
    y_pred = [0, 0, 1, 2, 2]
    out = classification_metrics(y_true, y_pred, NAMES)
    assert out["confusion_matrix"] == [[2, 0, 0, 0], [0, 1, 0, 0], [0, 0, 2, 0], [0, 0, 0, 0]]
    assert out["absent_classes"] == ["destroyed"]
    assert out["per_class"]["destroyed"] == {
        "precision": 0.0,
        "recall": 0.0,
        "f1": 0.0,
        "support": 0,
    }
    assert out["macro_f1"] == 1.0
    assert out["xview2_damage_f1"] == 1.0


def test_classification_zero_f1_class_makes_xview2_zero():
    # "destroyed" predicted once but never true: it takes part with F1 0
    y_true = [0, 0, 1, 2]
    y_pred = [0, 0, 1, 3]
    out = classification_metrics(y_true, y_pred, NAMES)
    assert out["absent_classes"] == []
    assert out["per_class"]["destroyed"]["f1"] == 0.0
    assert out["xview2_damage_f1"] == 0.0
    assert out["macro_f1"] == pytest.approx(0.5)  # F1s 1, 1, 0, 0


def test_classification_single_class_perfect():
    out = classification_metrics([1, 1, 1], [1, 1, 1], NAMES)
    assert out["accuracy"] == 1.0 and out["macro_f1"] == 1.0 and out["xview2_damage_f1"] == 1.0
    assert out["absent_classes"] == ["no-damage", "major-damage", "destroyed"]


def test_xview2_damage_f1_is_the_challenges_harmonic_mean_without_its_epsilon():
    assert xview2_harmonic_mean([0.5, 1.0], epsilon=0.0) == pytest.approx(2 / 3)
    assert xview2_harmonic_mean([0.9, 0.0, 0.8], epsilon=0.0) == 0.0
    with pytest.raises(ValueError, match="no F1 scores"):
        xview2_harmonic_mean([], epsilon=0.0)
    with pytest.raises(ValueError, match="non-negative"):
        xview2_harmonic_mean([0.5, -0.1])
    labels = np.array([0, 0, 1, 1, 2, 2, 2, 2])
    preds = np.array([0, 0, 1, 2, 2, 2, 1, 1])
    got = classification_metrics(labels, preds, NAMES[:3])
    f1 = [got["per_class"][n]["f1"] for n in NAMES[:3]]
    assert got["xview2_damage_f1"] == xview2_harmonic_mean(f1, epsilon=0.0)


def test_classification_errors():
    with pytest.raises(ValueError, match=r"y_true must hold class ids in \[0, 4\).*-1"):
        classification_metrics([0, -1], [0, 1], NAMES)
    with pytest.raises(ValueError, match="y_pred must hold class ids"):
        classification_metrics([0, 1], [0, 4], NAMES)
    with pytest.raises(ValueError, match="same length"):
        classification_metrics([0, 1], [0], NAMES)
    with pytest.raises(ValueError, match="empty"):
        classification_metrics([], [], NAMES)
    with pytest.raises(ValueError, match="integer class ids"):
        classification_metrics([0.5, 1], [0, 1], NAMES)


# ---------------------------------------------------------------------------------------------
# plots


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 1000
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


@pytest.mark.parametrize("normalize", [True, False])
def test_plot_confusion_matrix_writes_png(tmp_path, normalize):
    path = tmp_path / "out" / "cm.png"
    cm = [[50, 3, 1, 0], [4, 9, 2, 0], [0, 0, 0, 0], [1, 0, 3, 7]]
    plot_confusion_matrix(cm, NAMES, path, normalize=normalize)
    _assert_png(path)


def test_plot_confusion_matrix_rejects_wrong_shape(tmp_path):
    with pytest.raises(ValueError, match="K = 4"):
        plot_confusion_matrix([[1, 2], [3, 4]], NAMES, tmp_path / "cm.png")
    assert not list(tmp_path.iterdir())


def test_plot_embedding_tsne_writes_png(tmp_path):
    z, y = clusters([12, 8, 0, 10], noise=0.3, seed=2)
    path = tmp_path / "tsne.png"
    plot_embedding_tsne(z, y, NAMES, path, title="validation embeddings")
    _assert_png(path)


def test_plot_embedding_tsne_small_and_subsampled(tmp_path):
    z, y = clusters([3, 2], noise=0.3, seed=2)
    plot_embedding_tsne(z, y, ["a", "b"], tmp_path / "small.png", title="five points")
    z, y = clusters([40, 30], noise=0.3, seed=2)
    plot_embedding_tsne(z, y, ["a", "b"], tmp_path / "sub.png", title="subset", max_points=25)
    assert (tmp_path / "small.png").read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / "sub.png").read_bytes()[:8] == PNG_MAGIC


def test_macro_f1_over_present_classes_leaves_absent_ones_out():
    from runtime.metrics import classification_metrics, macro_f1_present, present_class_f1

    names = ["no-damage", "minor-damage", "major-damage", "destroyed"]
    labels = np.array([0, 0, 0, 3, 3])
    preds = np.array([0, 0, 1, 3, 0])  # a minor-damage call where there is none: F1 0 if counted
    f1 = present_class_f1(classification_metrics(labels, preds, names), labels, names)
    assert f1["minor-damage"] is None and f1["major-damage"] is None
    assert f1["no-damage"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))  # tp 2, fp 1, fn 1
    assert f1["destroyed"] == pytest.approx(2 * 1 / (2 * 1 + 0 + 1))  # tp 1, fn 1
    assert macro_f1_present(labels, preds, names) == pytest.approx(
        (f1["no-damage"] + f1["destroyed"]) / 2
    )
    assert macro_f1_present(np.array([], int), np.array([], int), names) is None
