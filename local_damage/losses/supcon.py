"""Supervised contrastive loss (SCL; Khosla et al. 2020; Eq. 1 of the LOCAL paper)."""

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


class SupConLoss(nn.Module):
    """Supervised contrastive loss.

    For anchor i with positives P(i) (other samples with its label) and ``s_ij = <z_i, z_j>``::

        L_i = -1/|P(i)| * sum_{p in P(i)} log( exp(s_ip / t) / sum_{a != i} exp(s_ia / t) )

    and the loss is the mean of ``L_i`` over the anchors that have at least one positive. A batch
    in which no anchor has a positive gives 0 (still connected to the graph). At its minimum on a
    balanced batch the class embeddings form a regular simplex (Graf et al. 2021).

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
        return contrastive_reduce(sim, sim, masks, self.temperature, features)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, normalize={self.normalize}"
