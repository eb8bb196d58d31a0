"""Self-supervised contrastive losses on two views of a batch: SimCLR's NT-Xent and the balanced
contrastive loss of "Self-supervised representation learning as an approximation of supervised
representation learning" (``../shared/papers/004_86da291143218a5b.txt``, Sec. 6, Eq. 17).

Both take two ``[B, D]`` embeddings whose row ``i`` are two views of the same image (the positive
pair) and compare every row with every other by cosine similarity ``s``. For one of the ``2B``
representations ``u`` with positive ``u+`` and negatives ``N(u)`` (the other ``2B - 2`` rows):

- NT-Xent (Chen et al. 2020): ``-log( exp(s(u, u+) / t) / sum_{a != u} exp(s(u, a) / t) )``;
- balanced: ``-s(u, u+) + (lam / alpha) * log sum_{n in N(u)} exp(alpha * s(u, n))``: one
  attracting force against a smooth maximum of the repelling ones. ``alpha`` sets how much the
  most similar negatives dominate the repelling term (a log-sum-exp that tends to the maximum as
  ``alpha`` grows), ``lam`` the weight of repelling against attracting. The positive stays out of
  the repelling sum (the paper's decoupled form); with it included, ``lam = 1`` and
  ``alpha = 1 / t`` give ``t`` times NT-Xent (the paper's "generalized NT-Xent").

Our copy of the paper's text has lost its equations; the form above is our reading of its prose
(Sec. 4.3, 5.1 and 6), and a test checks it against a loop written from it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _pairs(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(similarity [2B, 2B], positive index [2B], self mask [2B, 2B])`` of two views."""
    if a.ndim != 2 or a.shape != b.shape or a.shape[0] < 2:
        raise ValueError(
            f"two views must be [B, D] of the same shape with B >= 2, got {tuple(a.shape)} "
            f"and {tuple(b.shape)}"
        )
    z = F.normalize(torch.cat([a, b]).float(), dim=1)
    n = a.shape[0]
    sim = z @ z.T
    positive = torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(a.device)
    eye = torch.eye(2 * n, dtype=torch.bool, device=a.device)
    return sim, positive, eye


class NTXentLoss(nn.Module):
    """SimCLR's NT-Xent over two views ``a``, ``b`` ``[B, D]``; mean over the ``2B`` rows.

    Args:
        temperature: t > 0 (SimCLR's usual 0.1-0.5; default 0.2).
    """

    def __init__(self, temperature: float = 0.2) -> None:
        super().__init__()
        if not float(temperature) > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        sim, positive, eye = _pairs(a, b)
        logits = (sim / self.temperature).masked_fill(eye, float("-inf"))
        return F.cross_entropy(logits, positive)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}"


class BalancedContrastiveLoss(nn.Module):
    """The balanced contrastive loss over two views ``a``, ``b`` ``[B, D]``; mean over ``2B`` rows.

    Args:
        alpha: sharpness of the repelling log-sum-exp (> 0); the paper's grid centres near 1/t.
        lam: weight of the repelling term against the attracting one (> 0).
    """

    def __init__(self, alpha: float = 5.0, lam: float = 1.0) -> None:
        super().__init__()
        if not float(alpha) > 0 or not float(lam) > 0:
            raise ValueError(f"alpha and lam must be > 0, got alpha={alpha}, lam={lam}")
        self.alpha, self.lam = float(alpha), float(lam)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        sim, positive, eye = _pairs(a, b)
        rows = torch.arange(sim.shape[0], device=sim.device)
        attract = sim[rows, positive]
        exclude = eye.clone()
        exclude[rows, positive] = True
        repel = torch.logsumexp((self.alpha * sim).masked_fill(exclude, float("-inf")), dim=1)
        return (-attract + self.lam / self.alpha * repel).mean()

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, lam={self.lam}"


#: The losses `local-damage pretrain --loss` offers.
PRETRAIN_LOSSES = ("balanced", "ntxent")
