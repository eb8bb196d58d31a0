"""The LOCAL objective and its baselines: the right terms per method, and the alpha schedules."""

from __future__ import annotations

import pytest
import torch

from local_damage.losses import (
    METHODS,
    LossConfig,
    OrthonormalContrastiveLoss,
    SupConLoss,
    WeightedCrossEntropy,
    alpha_at,
    build_objective,
    class_weights,
    uses_latent,
)


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    labels = torch.tensor([0, 0, 1, 1, 2, 3, 3, 0])
    return {
        "logits": torch.randn(8, 4, generator=g),
        "labels": labels,
        "z": torch.randn(8, 16, generator=g),
        "l": torch.randn(8, 49, generator=g),
        "weights": class_weights([0] * 7 + [1] * 2 + [2] + [3] * 3, 4),
    }


def _expected(method, b, alpha, beta, t):
    wce = WeightedCrossEntropy(b["weights"])(b["logits"], b["labels"])
    ocl, scl = OrthonormalContrastiveLoss(t), SupConLoss(t)
    y = b["labels"]
    if method == "ce":
        return wce
    if method == "scl":
        return alpha * scl(b["z"], y) + (1 - alpha) * wce
    con = ocl if method == "local" else scl
    return alpha * (con(b["z"], y) + beta * con(b["l"], y)) + (1 - alpha) * wce


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("alpha,beta,t", [(0.5, 1.0, 0.1), (0.2, 0.3, 0.5), (1.0, 2.0, 0.07)])
def test_objective_terms_per_method(batch, method, alpha, beta, t):
    obj = build_objective(method, temperature=t, beta=beta, class_weights=batch["weights"])
    z = batch["z"].clone().requires_grad_(True)
    logits = batch["logits"].clone().requires_grad_(True)
    total, parts = obj(logits, batch["labels"], z, batch["l"], alpha)
    want = _expected(method, batch, alpha, beta, t)
    assert total.item() == pytest.approx(want.item(), rel=1e-6)
    assert parts["total"].item() == pytest.approx(total.item())
    assert not parts["total"].requires_grad
    expected_keys = {"wce", "total"}
    if method != "ce":
        expected_keys |= {"alpha", "contrastive_z"}
    if uses_latent(method):
        expected_keys.add("contrastive_l")
    assert set(parts) == expected_keys
    total.backward()
    assert (z.grad is None) == (method == "ce")
    assert (logits.grad.abs().sum() > 0) == (alpha < 1 or method == "ce")


def test_latent_term_only_for_latent_methods(batch):
    for method in METHODS:
        obj = build_objective(method, class_weights=batch["weights"])
        args = (batch["logits"], batch["labels"], batch["z"])
        a, _ = obj(*args, batch["l"], alpha=0.5)
        b, _ = obj(*args, -batch["l"] + torch.randn_like(batch["l"]), alpha=0.5)
        assert (a.item() != pytest.approx(b.item())) == uses_latent(method), method


def test_uses_latent_and_registry():
    assert set(METHODS) == {"local", "l-scl", "scl", "ce"}
    assert [m for m in sorted(METHODS) if uses_latent(m)] == ["l-scl", "local"]
    assert METHODS["local"].contrastive == "ocl" and METHODS["scl"].contrastive == "scl"
    with pytest.raises(ValueError, match="valid methods: ce, l-scl, local, scl"):
        uses_latent("ocl")
    with pytest.raises(ValueError, match="unknown loss method 'LOCAL'"):
        build_objective("LOCAL")


def test_objective_errors(batch):
    obj = build_objective("local", class_weights=batch["weights"])
    with pytest.raises(ValueError, match="latent embedding l"):
        obj(batch["logits"], batch["labels"], batch["z"], None, 0.5)
    with pytest.raises(ValueError, match="needs alpha"):
        obj(batch["logits"], batch["labels"], batch["z"], batch["l"])
    with pytest.raises(ValueError, match=r"alpha in \[0, 1\]"):
        obj(batch["logits"], batch["labels"], batch["z"], batch["l"], 1.5)
    with pytest.raises(ValueError, match="needs the embedding z"):
        build_objective("scl")(batch["logits"], batch["labels"], None, None, 0.5)
    with pytest.raises(ValueError, match="beta"):
        build_objective("local", beta=-1)
    # CE needs neither embeddings nor alpha
    total, parts = build_objective("ce")(batch["logits"], batch["labels"])
    assert total.item() == pytest.approx(
        torch.nn.functional.cross_entropy(batch["logits"], batch["labels"]).item()
    )


def test_alpha_schedules():
    assert [alpha_at(e, schedule="constant", alpha0=0.3) for e in range(3)] == [0.3, 0.3, 0.3]
    inv = [alpha_at(e, schedule="inverse", alpha0=0.6) for e in range(4)]
    assert inv == pytest.approx([0.6, 0.3, 0.2, 0.15])
    assert alpha_at(9, schedule="inverse", alpha0=1.0, alpha_min=0.25) == 0.25
    lin = [alpha_at(e, schedule="linear", alpha0=0.9, alpha_min=0.1, epochs=5) for e in range(7)]
    assert lin == pytest.approx([0.9, 0.7, 0.5, 0.3, 0.1, 0.1, 0.1])
    assert alpha_at(0, schedule="linear", alpha0=0.4, epochs=1) == 0.4
    # defaults: inverse from 0.5
    assert [LossConfig().alpha(e) for e in range(3)] == pytest.approx([0.5, 0.25, 0.5 / 3])
    with pytest.raises(ValueError, match="valid schedules: constant, inverse, linear"):
        alpha_at(0, schedule="cosine")
    with pytest.raises(ValueError, match="needs epochs"):
        alpha_at(0, schedule="linear")
    with pytest.raises(ValueError, match="0-based"):
        alpha_at(-1)
    with pytest.raises(ValueError, match="alpha_min"):
        alpha_at(0, alpha0=0.3, alpha_min=0.5)


def test_loss_config(batch):
    cfg = LossConfig()
    assert (cfg.method, cfg.temperature, cfg.beta, cfg.alpha_schedule) == (
        "local",
        0.1,
        1.0,
        "inverse",
    )
    assert LossConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown loss config keys \['tau'\]"):
        LossConfig.from_dict({"tau": 0.2})
    with pytest.raises(ValueError, match="valid methods"):
        LossConfig(method="supcon")
    with pytest.raises(ValueError, match="valid schedules"):
        LossConfig(alpha_schedule="exp")
    obj = LossConfig(method="l-scl", temperature=0.2, beta=0.5).build(batch["weights"])
    total, _ = obj(batch["logits"], batch["labels"], batch["z"], batch["l"], 0.4)
    assert total.item() == pytest.approx(_expected("l-scl", batch, 0.4, 0.5, 0.2).item(), rel=1e-6)


def test_contrastive_labels_for_gathered_embeddings(batch):
    """z and l gathered from several processes carry their own labels; WCE keeps the local ones."""
    obj = build_objective("local", class_weights=batch["weights"])
    g = torch.Generator().manual_seed(1)
    z_all = torch.cat([batch["z"], torch.randn(8, 16, generator=g)])
    l_all = torch.cat([batch["l"], torch.randn(8, 49, generator=g)])
    y_all = torch.cat([batch["labels"], torch.tensor([3, 2, 1, 0, 0, 1, 2, 3])])
    total, parts = obj(
        batch["logits"], batch["labels"], z_all, l_all, 0.3, contrastive_labels=y_all
    )
    ocl = OrthonormalContrastiveLoss(0.1)
    wce = WeightedCrossEntropy(batch["weights"])(batch["logits"], batch["labels"])
    want = 0.3 * (ocl(z_all, y_all) + ocl(l_all, y_all)) + 0.7 * wce
    assert total.item() == pytest.approx(want.item(), rel=1e-6)
    assert parts["wce"].item() == pytest.approx(wce.item())
