"""Similarity, label masks and reduction shared by the supervised contrastive losses.

Split as pytorch-metric-learning splits them: one function builds the cosine-similarity matrix,
one the positive/negative/self masks, one reduces a (possibly modified) denominator similarity to
the per-batch loss. `SupConLoss` and `OrthonormalContrastiveLoss` differ only in the
denominator similarity they pass to `contrastive_reduce`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class LabelMasks(NamedTuple):
    """Boolean pair masks of a batch, each [B, B].

    Attributes:
        positive: ``y_i == y_j`` and ``i != j`` (the anchor's positives P(i)).
        negative: ``y_i != y_j``.
        self: the diagonal ``i == j``.
    """

    positive: torch.Tensor
    negative: torch.Tensor
    self: torch.Tensor


def check_features_labels(features: torch.Tensor, labels: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``features`` is [B, D] floating and ``labels`` is integer [B]."""
    if features.ndim != 2:
        raise ValueError(f"features must be [B, D], got shape {tuple(features.shape)}")
    if not torch.is_floating_point(features):
        raise ValueError(f"features must be a floating tensor, got {features.dtype}")
    if labels.ndim != 1 or labels.shape[0] != features.shape[0]:
        raise ValueError(
            f"labels must be [B] with B = {features.shape[0]} (the rows of features), "
            f"got shape {tuple(labels.shape)}"
        )
    if torch.is_floating_point(labels) or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")


def cosine_similarity_matrix(features: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """Pairwise cosine similarities ``s_ij = <z_i, z_j>`` of L2-normalised rows.

    Computed in float32 (or float64 when given float64) whatever the input dtype, so float16 and
    bfloat16 features give the same loss as their float32 copies up to rounding of the input.

    Args:
        features: [B, D] embeddings; normalised here, so already-normalised input is unchanged.
        normalize: False returns the raw inner products ``<f_i, f_j>`` instead.

    Returns:
        [B, B] similarities in [-1, 1].
    """
    dtype = torch.float64 if features.dtype == torch.float64 else torch.float32
    z = features.to(dtype)
    if normalize:
        z = F.normalize(z, dim=1)
    return z @ z.T


def label_masks(labels: torch.Tensor) -> LabelMasks:
    """Positive, negative and self masks ([B, B] bool each) from integer labels [B]."""
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(labels.shape[0], dtype=torch.bool, device=labels.device)
    return LabelMasks(positive=same & ~eye, negative=~same, self=eye)


def contrastive_reduce(
    similarity: torch.Tensor,
    denominator_similarity: torch.Tensor,
    masks: LabelMasks,
    temperature: float,
    zero_like: torch.Tensor,
) -> torch.Tensor:
    """Mean over anchors with a positive of ``-1/|P(i)| sum_p log(exp(s_ip/t) / sum_{a!=i} exp(s'_ia/t))``.

    Per anchor this equals ``logsumexp_{a != i}(s'_ia / t) - mean_{p in P(i)} s_ip / t``; the
    log-sum-exp runs over the denominator similarities with the diagonal set to ``-inf`` (self
    excluded exactly, never subtracted), restricted to anchors that have a positive so that no
    all ``-inf`` row ever enters the graph.

    Args:
        similarity: [B, B] similarities ``s`` used for the positives in the numerator.
        denominator_similarity: [B, B] similarities ``s'`` summed in the denominator.
        masks: the batch's `LabelMasks`.
        temperature: t > 0.
        zero_like: a tensor connected to the inputs; ``zero_like.sum() * 0`` is returned when no
            anchor has a positive, so the result still carries a (zero) gradient.

    Returns:
        Scalar loss (float32, or float64 for float64 input).
    """
    pos_count = masks.positive.sum(dim=1)
    anchors = pos_count > 0
    if not bool(anchors.any()):
        return zero_like.sum().to(similarity.dtype) * 0.0 + 0.0  # + 0.0 turns -0.0 into 0.0
    logits = (denominator_similarity / temperature).masked_fill(masks.self, float("-inf"))
    log_denominator = torch.logsumexp(logits[anchors], dim=1)
    pos = masks.positive[anchors]
    mean_pos = (similarity[anchors] * pos).sum(dim=1) / pos_count[anchors] / temperature
    return (log_denominator - mean_pos).mean()


def check_temperature(temperature: float) -> float:
    """Return ``temperature`` as float, raising ``ValueError`` unless it is finite and > 0."""
    t = float(temperature)
    if not t > 0 or t == float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return t
