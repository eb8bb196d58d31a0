"""SCL, OCL and weighted CE against loops written from the formulas, and at their optima."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from local_damage.losses import (
    OrthonormalContrastiveLoss,
    SupConLoss,
    WeightedCrossEntropy,
    class_counts,
    class_weights,
    label_masks,
)

LOSSES = {"scl": SupConLoss, "ocl": OrthonormalContrastiveLoss}


def naive_loss(
    features: np.ndarray, labels: list[int], t: float, orthonormal: bool, normalize: bool = True
) -> float:
    """The per-anchor formula, one anchor, positive and denominator term at a time."""
    z = [
        np.array(f) / (math.sqrt(sum(x * x for x in f)) if normalize else 1.0)
        for f in features.tolist()
    ]
    b = len(labels)
    per_anchor = []
    for i in range(b):
        positives = [p for p in range(b) if p != i and labels[p] == labels[i]]
        if not positives:
            continue
        denominator = 0.0
        for a in range(b):
            if a == i:
                continue
            s = float(z[i] @ z[a])
            if orthonormal and labels[a] != labels[i]:
                s = abs(s)
            denominator += math.exp(s / t)
        total = 0.0
        for p in positives:
            total += math.log(math.exp(float(z[i] @ z[p]) / t) / denominator)
        per_anchor.append(-total / len(positives))
    return sum(per_anchor) / len(per_anchor) if per_anchor else 0.0


LABEL_PATTERNS = {
    "mixed": [0, 1, 0, 2, 1, 3, 3, 0, 2, 1],
    "singletons": [0, 1, 1, 2, 3, 3, 3, 4],
    "imbalanced": [0] * 9 + [1, 1, 2, 3, 3],
    "balanced": [0, 1, 2, 3] * 3,
    "all_same": [2] * 6,
    "two": [5, 5],
}


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("pattern", sorted(LABEL_PATTERNS))
@pytest.mark.parametrize("temperature", [0.05, 0.1, 0.5, 1.0])
def test_matches_naive_loop(name, pattern, temperature):
    labels = LABEL_PATTERNS[pattern]
    rng = np.random.default_rng(len(labels) * 100 + int(temperature * 100))
    feats = rng.normal(size=(len(labels), 5))
    got = LOSSES[name](temperature)(torch.tensor(feats), torch.tensor(labels))
    want = naive_loss(feats, labels, temperature, orthonormal=name == "ocl")
    assert got.dtype == torch.float64
    assert got.item() == pytest.approx(want, rel=1e-10, abs=1e-12)


def test_ocl_differs_from_scl_only_through_negatives():
    rng = np.random.default_rng(1)
    feats = torch.tensor(rng.normal(size=(12, 6)))
    labels = torch.tensor([0, 1, 2] * 4)
    scl, ocl = SupConLoss(0.1)(feats, labels), OrthonormalContrastiveLoss(0.1)(feats, labels)
    assert ocl.item() > scl.item()  # |s| >= s for the negatives, some of which are negative here
    same = torch.zeros(12, dtype=torch.long)  # no negatives: the two losses coincide
    assert SupConLoss(0.1)(feats, same).item() == pytest.approx(
        OrthonormalContrastiveLoss(0.1)(feats, same).item(), rel=1e-12
    )


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_permutation_and_normalisation_invariance(name, seed):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(16, 8, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 4, (16,), generator=g)
    loss = LOSSES[name](0.2)
    base = loss(feats, labels)
    perm = torch.randperm(16, generator=g)
    assert loss(feats[perm], labels[perm]).item() == pytest.approx(base.item(), rel=1e-12)
    scales = torch.rand(16, 1, generator=g, dtype=torch.float64) * 10 + 0.1
    assert loss(feats * scales, labels).item() == pytest.approx(base.item(), rel=1e-12)
    normalised = torch.nn.functional.normalize(feats, dim=1)
    assert loss(normalised, labels).item() == pytest.approx(base.item(), rel=1e-12)


def _orthonormal(k: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))
    return q.T  # [k, d], orthonormal rows


def _simplex(k: int, d: int, seed: int) -> torch.Tensor:
    centred = torch.eye(k, dtype=torch.float64) - 1.0 / k
    vertices = torch.nn.functional.normalize(centred, dim=1)  # [k, k], <v_i, v_j> = -1/(k-1)
    return vertices @ _orthonormal(k, d, seed)  # rotated into R^d


def theorem_value(labels: torch.Tensor, t: float, negative_sim: float) -> float:
    """``mean_i log(l_i - 1 + (|B| - l_i) exp(-(1 - negative_sim) / t))`` over anchors with a positive.

    At a collapsed configuration (positives identical, negatives at similarity ``negative_sim``)
    each anchor's term is ``log((l-1) e^{1/t} + (B-l) e^{s_n/t}) - 1/t``; ``negative_sim = 0``
    gives Theorem 3.2 (OCL) and ``-1/(K-1)`` gives Theorem 3.1 (SCL, exponent ``-K/((K-1)t)``).
    """
    b = labels.shape[0]
    counts = torch.bincount(labels)
    terms = []
    for y in labels.tolist():
        n = int(counts[y])
        if n > 1:
            terms.append(math.log(n - 1 + (b - n) * math.exp(-(1.0 - negative_sim) / t)))
    return sum(terms) / len(terms)


OPTIMUM_LABELS = {
    "balanced": [0, 1, 2, 3] * 4,
    "imbalanced": [0] * 11 + [1, 1, 1, 2, 2, 3, 3],
    "with_singleton": [0, 0, 0, 1, 1, 2, 3, 3],
}


@pytest.mark.parametrize("pattern", sorted(OPTIMUM_LABELS))
@pytest.mark.parametrize("temperature", [0.1, 0.5, 1.0])
def test_ocl_theorem_3_2_at_collapsed_orthonormal_configuration(pattern, temperature):
    labels = torch.tensor(OPTIMUM_LABELS[pattern])
    basis = _orthonormal(4, 8, seed=3)
    feats = basis[labels]
    loss = OrthonormalContrastiveLoss(temperature)
    at_optimum = loss(feats, labels).item()
    assert at_optimum == pytest.approx(theorem_value(labels, temperature, 0.0), rel=1e-10)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        for scale in (1e-3, 1e-2, 1e-1):
            noisy = feats + scale * torch.randn(feats.shape, generator=g, dtype=torch.float64)
            noisy = torch.nn.functional.normalize(noisy, dim=1)
            assert loss(noisy, labels).item() > at_optimum


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("temperature", [0.1, 0.5, 1.0])
def test_scl_theorem_3_1_at_regular_simplex_for_balanced_batches(k, temperature):
    labels = torch.arange(k).repeat(3)
    vertices = _simplex(k, 8, seed=k)
    gram = vertices @ vertices.T
    assert torch.allclose(
        gram[~torch.eye(k, dtype=torch.bool)], torch.tensor(-1.0 / (k - 1)).double()
    )
    feats = vertices[labels]
    loss = SupConLoss(temperature)
    at_simplex = loss(feats, labels).item()
    want = theorem_value(labels, temperature, -1.0 / (k - 1))
    # the same value written as the theorem writes the exponent: -K / ((K - 1) t)
    b, n = labels.shape[0], 3
    assert want == pytest.approx(math.log(n - 1 + (b - n) * math.exp(-k / ((k - 1) * temperature))))
    assert at_simplex == pytest.approx(want, rel=1e-10)
    # on a balanced batch the simplex is SCL's minimum: perturbations raise it ...
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        noisy = feats + 0.05 * torch.randn(feats.shape, generator=g, dtype=torch.float64)
        assert loss(noisy, labels).item() > at_simplex
    # ... the orthonormal configuration is worse for SCL, and the simplex is worse for OCL
    ortho = _orthonormal(k, 8, seed=0)[labels]
    assert loss(ortho, labels).item() > at_simplex
    ocl = OrthonormalContrastiveLoss(temperature)
    assert ocl(feats, labels).item() > ocl(ortho, labels).item()


def _label_cases(b: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(b)
    return {
        "same": torch.zeros(b, dtype=torch.long),
        "distinct": torch.arange(b),
        "random": torch.randint(0, 4, (b,), generator=g),
    }


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("b", [2, 3, 8, 33, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_gradients_finite(name, b, dtype):
    for temperature in (0.05, 1.0):
        loss = LOSSES[name](temperature)
        for case, labels in _label_cases(b).items():
            g = torch.Generator().manual_seed(b)
            for feats0 in (
                torch.randn(b, 16, generator=g),
                torch.ones(b, 16),  # every sample identical
                _orthonormal(4, 16, seed=0)[torch.arange(b) % 4].float(),  # exact zeros in |s|
            ):
                feats = feats0.to(dtype).requires_grad_(True)
                value = loss(feats, labels)
                value.backward()
                assert torch.isfinite(value), (case, temperature)
                assert feats.grad.dtype == dtype
                assert torch.isfinite(feats.grad.float()).all(), (case, temperature)


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_close_to_float32(name, dtype):
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(32, 16, generator=g)
    labels = torch.randint(0, 4, (32,), generator=g)
    loss = LOSSES[name](0.1)
    low = loss(feats.to(dtype), labels)
    assert low.dtype == torch.float32
    assert low.item() == pytest.approx(loss(feats.to(dtype).float(), labels).item(), rel=1e-6)


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("b", [1, 2, 7])
def test_no_positive_gives_zero_with_gradient(name, b):
    feats = torch.randn(b, 4, requires_grad=True)
    value = LOSSES[name](0.1)(feats, torch.arange(b))
    assert value.item() == 0.0 and not math.copysign(1.0, value.item()) < 0
    assert value.requires_grad
    value.backward()
    assert torch.equal(feats.grad, torch.zeros_like(feats))


def test_anchor_without_positive_is_left_out_of_the_mean():
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(6, 4, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 1, 1, 9])  # label 9 has no positive
    got = SupConLoss(0.3)(feats, labels).item()
    assert got == pytest.approx(naive_loss(feats.numpy(), labels.tolist(), 0.3, False), rel=1e-12)
    # the lone sample still acts as a negative: moving it changes the loss
    moved = feats.clone()
    moved[5] = -moved[5]
    assert SupConLoss(0.3)(moved, labels).item() != pytest.approx(got, rel=1e-9)


def test_label_masks():
    masks = label_masks(torch.tensor([0, 1, 0]))
    assert masks.positive.tolist() == [
        [False, False, True],
        [False, False, False],
        [True, False, False],
    ]
    assert masks.negative.tolist() == [
        [False, True, False],
        [True, False, True],
        [False, True, False],
    ]
    assert masks.self.tolist() == [[True, False, False], [False, True, False], [False, False, True]]


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_bad_arguments(name):
    cls = LOSSES[name]
    for bad in (0, -0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            cls(bad)
    loss = cls(0.1)
    with pytest.raises(ValueError, match=r"features must be \[B, D\]"):
        loss(torch.randn(4), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must be"):
        loss(torch.randn(4, 3), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        loss(torch.randn(4, 3), torch.zeros(4))


def test_class_weights_by_hand():
    labels = [0] * 6 + [1] * 3 + [2] * 1  # counts 6, 3, 1, class 3 absent
    w = class_weights(labels, 4)
    inv = [1 / 6, 1 / 3, 1 / 1]
    mean = sum(inv) / 3
    assert w.dtype == torch.float32
    assert w.tolist() == pytest.approx([inv[0] / mean, inv[1] / mean, inv[2] / mean, 0.0])
    assert w[:3].mean().item() == pytest.approx(1.0)
    # counts, a mapping and a tensor of labels give the same weights
    assert class_weights([6, 3, 1, 0], 4, counts=True).tolist() == pytest.approx(w.tolist())
    assert class_weights({0: 6, 1: 3, 2: 1}, 4).tolist() == pytest.approx(w.tolist())
    assert class_weights(torch.tensor(labels), 4).tolist() == pytest.approx(w.tolist())
    assert class_weights([1, 1, 0, 0], 2).tolist() == pytest.approx([1.0, 1.0])
    assert class_counts(np.array(labels), 4).tolist() == [6, 3, 1, 0]


def test_class_weights_errors():
    with pytest.raises(ValueError, match=r"\[0, 3\).*\[3, 7\]"):
        class_weights([0, 1, 3, 7], 3)
    with pytest.raises(ValueError, match="no training samples"):
        class_weights([0, 0, 0], 3, counts=True)
    with pytest.raises(ValueError, match="3 entries"):
        class_weights([1, 2], 3, counts=True)
    with pytest.raises(ValueError, match=">= 0"):
        class_weights([1, -2, 3], 3, counts=True)


def test_weighted_cross_entropy_by_hand():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0], [0.0, 1.0, 3.0]])
    labels = torch.tensor([0, 1, 2])
    weight = torch.tensor([0.5, 1.0, 2.0])
    logp = torch.log_softmax(logits, dim=1)
    per = -logp[torch.arange(3), labels]
    want = (weight[labels] * per).sum() / weight[labels].sum()
    got = WeightedCrossEntropy(weight)(logits, labels)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    assert WeightedCrossEntropy()(logits, labels).item() == pytest.approx(
        per.mean().item(), rel=1e-6
    )
    assert "weight" in WeightedCrossEntropy(weight).state_dict()
    with pytest.raises(ValueError, match="3 classes but weight has 2"):
        WeightedCrossEntropy([1.0, 2.0])(logits, labels)


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("pattern", ["mixed", "imbalanced"])
def test_raw_inner_products_match_naive_loop(name, pattern):
    """normalize=False: Eq. 1/2 on the rows as given (an unnormalised z = e_pre - e_post)."""
    labels = LABEL_PATTERNS[pattern]
    gen = torch.Generator().manual_seed(3)
    # rows of very different lengths, as differences of unit vectors are (0 to 2)
    feats = torch.randn(len(labels), 6, generator=gen, dtype=torch.float64)
    feats = feats * torch.linspace(0.05, 2.0, len(labels), dtype=torch.float64)[:, None]
    y = torch.tensor(labels)
    raw = LOSSES[name](0.5, normalize=False)(feats, y).item()
    expected = naive_loss(feats.numpy(), labels, 0.5, name == "ocl", normalize=False)
    assert raw == pytest.approx(expected, rel=1e-9)
    cosine = LOSSES[name](0.5)(feats, y).item()
    assert abs(raw - cosine) > 1e-3  # the lengths matter once rows are not normalised
    unit = torch.nn.functional.normalize(feats, dim=1)
    assert LOSSES[name](0.5, normalize=False)(unit, y).item() == pytest.approx(
        LOSSES[name](0.5)(unit, y).item(), rel=1e-9
    )
