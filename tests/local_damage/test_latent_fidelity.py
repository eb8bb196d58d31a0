"""LOCAL's latent term as the paper defines it: OCL on ``l`` must differ from SCL on ``l``.

With ``model.latent_abs`` every entry of ``l`` is ``>= 0``, so every ``<l_i, l_n>`` is ``>= 0`` and
the absolute value OCL puts on negatives (Eq. 2) changes nothing: OCL(l) is SCL(l) on any batch.
``model.latent_centre`` centres ``l`` over its positions before it is normalised, so inner
products take both signs and OCL pushes negatives to perpendicular from both sides.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from local_damage.config import load_yaml
from local_damage.losses import OrthonormalContrastiveLoss, SupConLoss
from local_damage.models import LatentCorrelation, ModelConfig, build_model, parse_blocks
from local_damage.train.config import Config, fidelity_notes
from tests.conftest import REPO

LABELS = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])


def latent(seed: int = 0, **kw) -> torch.Tensor:
    """``l`` of a randomly initialised ResNet-18 LOCAL model on 8 random 64 px pairs."""
    torch.manual_seed(seed)
    net = build_model(ModelConfig(encoder="resnet18", **kw)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    pre, post = torch.randn(8, 3, 64, 64, generator=g), torch.randn(8, 3, 64, 64, generator=g)
    with torch.no_grad():
        return net(pre, post).l


def negative_inner(l_emb: torch.Tensor) -> torch.Tensor:
    return (l_emb @ l_emb.T)[LABELS[:, None] != LABELS[None, :]]


def test_absolute_latent_makes_ocl_exactly_scl():
    """The reading of configs/default.yaml (the recipe of the model bundled before
    configs/cpu-local.yaml): OCL on l is SCL on l."""
    l_emb = latent(latent_abs=True)
    assert bool((l_emb >= 0).all())
    assert bool((negative_inner(l_emb) >= 0).all())
    ocl = OrthonormalContrastiveLoss(0.1)(l_emb, LABELS)
    scl = SupConLoss(0.1)(l_emb, LABELS)
    assert torch.equal(ocl, scl)


@pytest.mark.parametrize("centre", [False, True], ids=["signed", "signed-centred"])
def test_signed_latent_makes_ocl_differ_from_scl(centre):
    l_emb = latent(latent_abs=False, latent_centre=centre)
    if centre:
        torch.testing.assert_close(l_emb.sum(dim=1), torch.zeros(8), atol=1e-5, rtol=0)
    torch.testing.assert_close(l_emb.norm(dim=1), torch.ones(8), atol=1e-5, rtol=0)
    inner = negative_inner(l_emb)
    assert bool((inner < 0).any()) and bool((inner > 0).any())
    ocl = OrthonormalContrastiveLoss(0.1)(l_emb, LABELS)
    scl = SupConLoss(0.1)(l_emb, LABELS)
    assert float(ocl) > float(scl) + 1e-4  # |s| > s on the negatives below 0


def test_centring_keeps_the_change_map_and_the_map_the_naive_way(encoders_block_features):
    channels, fp, fq = encoders_block_features
    blocks = parse_blocks("1-2-3-4")
    plain = LatentCorrelation(channels, blocks, 8, absolute=True)
    centred = LatentCorrelation(channels, blocks, 8, absolute=True, centre=True)
    with torch.no_grad():
        l_plain, m_plain = plain(fp, fq)
        l_centred, m_centred = centred(fp, fq)
    torch.testing.assert_close(m_centred, m_plain)  # the displayed change map is not centred
    flat = m_plain.flatten(1)
    expected = F.normalize(flat - flat.mean(dim=1, keepdim=True), dim=1)
    torch.testing.assert_close(l_centred, expected)
    assert not torch.allclose(l_centred, l_plain, atol=1e-3)


@pytest.fixture(scope="module")
def encoders_block_features():
    from local_damage.models import build_encoder

    torch.manual_seed(0)
    enc = build_encoder("resnet18").eval()
    g = torch.Generator().manual_seed(1)
    pre, post = torch.randn(2, 3, 64, 64, generator=g), torch.randn(2, 3, 64, 64, generator=g)
    with torch.no_grad():
        return enc.out_channels, enc(pre), enc(post)


@pytest.mark.parametrize("start", [-0.6, 0.6])
def test_an_ocl_step_brings_a_negative_towards_perpendicular_from_either_side(start):
    """One gradient step on a negative n: OCL shrinks |<a, n>| whether it starts below or above
    0; SCL pushes a negative inner product further below 0 (towards opposite)."""
    a = torch.tensor([1.0, 0.0, 0.0])
    p = F.normalize(torch.tensor([0.9, 0.3, 0.0]), dim=0)
    n0 = torch.tensor([start, (1 - start**2) ** 0.5, 0.0])
    labels = torch.tensor([0, 0, 1])

    def stepped(loss_fn) -> float:
        n = n0.clone().requires_grad_(True)
        loss_fn(torch.stack([a, p, n]), labels).backward()
        moved = F.normalize(n.detach() - 0.05 * n.grad, dim=0)
        return float(moved @ a)

    ocl = stepped(OrthonormalContrastiveLoss(0.1))
    scl = stepped(SupConLoss(0.1))
    assert abs(ocl) < abs(start)
    if start < 0:
        assert scl < start  # SCL: away from the anchor, towards -1
    else:
        assert scl < start and abs(scl) < abs(start)


def test_fidelity_notes_name_what_departs_from_the_paper():
    previous = load_yaml(Config, REPO / "configs" / "default.yaml")
    notes = fidelity_notes(previous)
    assert any("OCL on l is exactly SCL on l" in n for n in notes)
    assert any("normalize_z=false" in n for n in notes)
    faithful = load_yaml(Config, REPO / "configs" / "cpu-local.yaml")
    assert fidelity_notes(faithful) == []
    assert faithful.loss.method == "local" and faithful.loss.normalize_z
    centred = load_yaml(
        Config,
        REPO / "configs" / "default.yaml",
        ["model.latent_centre=true", "loss.normalize_z=true"],
    )
    assert fidelity_notes(centred) == []
    scl = load_yaml(Config, REPO / "configs" / "default.yaml", ["loss.method=scl"])
    assert not any("SCL on l" in n for n in fidelity_notes(scl))


def _recipe_model(stem: str):
    cfg = load_yaml(Config, REPO / "configs" / f"{stem}.yaml")
    torch.manual_seed(0)
    return build_model(cfg.model), cfg


def _latent_grads(net, loss_fn, pre, post) -> torch.Tensor:
    net.zero_grad()
    loss_fn(net(pre, post).l, LABELS).backward()
    return torch.cat([p.grad.flatten() for p in net.encoder.parameters() if p.grad is not None])


@pytest.mark.slow
def test_the_previous_recipe_trains_its_latent_term_as_scl_the_bundled_one_does_not():
    """Encoder gradients of the latent term: OCL's equal SCL's under configs/default.yaml (the
    previous recipe: latent_abs), and differ under configs/cpu-local.yaml and
    configs/cpu-local-general.yaml (the bundled model's recipe: the paper's signed map)."""
    g = torch.Generator().manual_seed(5)
    pre, post = torch.randn(8, 3, 64, 64, generator=g), torch.randn(8, 3, 64, 64, generator=g)
    for stem, same in (("default", True), ("cpu-local", False), ("cpu-local-general", False)):
        net, cfg = _recipe_model(stem)
        net.train()
        t = cfg.loss.temperature
        ocl = _latent_grads(net, OrthonormalContrastiveLoss(t), pre, post)
        scl = _latent_grads(net, SupConLoss(t), pre, post)
        assert torch.equal(ocl, scl) is same, stem
