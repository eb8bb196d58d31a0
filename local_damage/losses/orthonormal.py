"""Orthonormal contrastive loss (OCL; Eq. 2 of the LOCAL paper)."""

from __future__ import annotations

import torch
from torch import nn

from local_damage.losses.masks import (
    check_features_labels,
    check_temperature,
    contrastive_reduce,
    cosine_similarity_matrix,
    label_masks,
)


class OrthonormalContrastiveLoss(nn.Module):
    """Orthonormal contrastive loss: SCL with ``|<z_i, z_n>|`` for negatives in the denominator.

    For anchor i with positives P(i) and ``s_ij = <z_i, z_j>``::

        L_i = -1/|P(i)| * sum_{p in P(i)} log( exp(s_ip / t) / sum_{a != i} exp(s'_ia / t) )

    with ``s'_ia = s_ia`` for positives and ``s'_ia = |s_ia|`` for negatives, so negatives are
    pushed towards perpendicular rather than opposite. The loss is the mean of ``L_i`` over the
    anchors that have at least one positive (0, connected to the graph, when none has). Its
    minimum, ``mean_i log(l_i - 1 + (|B| - l_i) exp(-1/t))`` with ``l_i`` the count of the anchor's
    class in the batch, is reached exactly when every sample equals its class's vector and the
    class vectors are orthonormal (Theorem 3.2), whatever the class balance.

    Args:
        temperature: t > 0 (default 0.1).
        normalize: compare rows by cosine (L2-normalised inside, the default); False uses the
            raw inner products of the rows as given (for embeddings whose norm carries meaning,
            such as an unnormalised difference ``e_pre - e_post``).

    Shape:
        - features: [B, D] embeddings (L2-normalised inside; any float dtype, computed in float32).
        - labels: [B] integer class labels.
        - output: scalar.
    """

    def __init__(self, temperature: float = 0.1, normalize: bool = True) -> None:
        super().__init__()
        self.temperature = check_temperature(temperature)
        self.normalize = bool(normalize)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        check_features_labels(features, labels)
        sim = cosine_similarity_matrix(features, normalize=self.normalize)
        masks = label_masks(labels)
        denominator = torch.where(masks.negative, sim.abs(), sim)
        return contrastive_reduce(sim, denominator, masks, self.temperature, features)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, normalize={self.normalize}"
