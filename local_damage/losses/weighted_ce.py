"""Weighted cross-entropy with inverse-class-frequency weights (the WCE term of LOCAL, Eq. 6)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def class_counts(labels: Sequence[int] | np.ndarray | torch.Tensor, num_classes: int) -> np.ndarray:
    """Count integer labels per class.

    Args:
        labels: [N] integer class labels in ``[0, num_classes)``.
        num_classes: K.

    Returns:
        [K] int64 counts.

    Raises:
        ValueError: a label outside ``[0, num_classes)`` or a non-integer label.
    """
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    arr = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    arr = arr.reshape(-1)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.equal(np.mod(arr, 1), 0)):
            raise ValueError(f"labels must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
    bad = arr[(arr < 0) | (arr >= num_classes)]
    if bad.size:
        raise ValueError(
            f"labels must lie in [0, {num_classes}), found {sorted(set(bad.tolist()))[:10]}"
        )
    return np.bincount(arr.astype(np.int64), minlength=num_classes)


def class_weights(
    labels_or_counts: Sequence[int] | np.ndarray | torch.Tensor | Mapping[int, int],
    num_classes: int,
    *,
    counts: bool = False,
    power: float = 1.0,
) -> torch.Tensor:
    """Inverse-class-frequency weights, normalised to average 1 over the classes present.

    ``w_c = n_c^-p / mean_{c' : n_c' > 0} n_c'^-p`` with ``p = power``: 1 is the paper's inverse
    frequency, 0.5 the square root (a rare class weighs less against a common one, so fewer
    common-class buildings are called rare on imagery unlike the training data), 0 no weighting. A class absent from the training set
    (``n_c = 0``) gets weight 0: it never occurs as a target in training, and weight 0 keeps it
    out of the normalisation.

    Args:
        labels_or_counts: the training labels [N] (default), or with ``counts=True`` the
            per-class counts [K]; a mapping ``{class_index: count}`` is always read as counts.
        num_classes: K.
        counts: read ``labels_or_counts`` as per-class counts instead of labels.
        power: the exponent ``p`` (>= 0).

    Returns:
        [K] float32 weights.

    Raises:
        ValueError: labels out of range, negative or wrongly sized counts, or no samples at all.
    """
    if isinstance(labels_or_counts, Mapping):
        n = np.zeros(num_classes, dtype=np.float64)
        for key, value in labels_or_counts.items():
            if not 0 <= int(key) < num_classes:
                raise ValueError(f"class index {key} outside [0, {num_classes})")
            n[int(key)] = float(value)
    elif counts:
        src = labels_or_counts
        src = src.detach().cpu().numpy() if isinstance(src, torch.Tensor) else src
        n = np.asarray(src, dtype=np.float64).reshape(-1)
        if n.shape != (num_classes,):
            raise ValueError(f"counts must have {num_classes} entries, got {n.shape[0]}")
    else:
        n = class_counts(labels_or_counts, num_classes).astype(np.float64)
    if not np.all(np.isfinite(n)) or np.any(n < 0):
        raise ValueError(f"class counts must be finite and >= 0, got {n.tolist()}")
    if not float(power) >= 0:
        raise ValueError(f"class weight power must be >= 0, got {power}")
    present = n > 0
    if not present.any():
        raise ValueError("cannot compute class weights: no training samples (all counts are 0)")
    inv = np.zeros_like(n)
    inv[present] = n[present] ** -float(power)
    inv /= inv[present].mean()
    return torch.as_tensor(inv, dtype=torch.float32)


class WeightedCrossEntropy(nn.Module):
    """Cross-entropy with fixed per-class weights (``F.cross_entropy(weight=...)``).

    The batch value is the weighted mean ``sum_i w_{y_i} CE_i / sum_i w_{y_i}``, as
    `torch.nn.CrossEntropyLoss` computes it. The weights are a buffer, so they follow
    ``.to(device)`` and are saved in the state dict.

    Args:
        weight: [K] per-class weights (e.g. from `class_weights`), or None for plain CE.

    Shape:
        - logits: [B, K] unnormalised scores.
        - labels: [B] integer targets in ``[0, K)``.
        - output: scalar.
    """

    def __init__(self, weight: torch.Tensor | Sequence[float] | None = None) -> None:
        super().__init__()
        if weight is not None:
            weight = torch.as_tensor(weight, dtype=torch.float32)
            if (
                weight.ndim != 1
                or not bool(torch.isfinite(weight).all())
                or bool((weight < 0).any())
            ):
                raise ValueError("weight must be a 1-D tensor of finite values >= 0")
        self.register_buffer("weight", weight)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if logits.ndim != 2 or labels.shape != logits.shape[:1]:
            raise ValueError(
                f"expected logits [B, K] and labels [B], got {tuple(logits.shape)} and "
                f"{tuple(labels.shape)}"
            )
        weight = self.weight
        if weight is not None and weight.shape[0] != logits.shape[1]:
            raise ValueError(
                f"logits have {logits.shape[1]} classes but weight has {weight.shape[0]}"
            )
        if weight is not None:
            weight = weight.to(device=logits.device, dtype=torch.float32)
        return F.cross_entropy(logits.float(), labels.long(), weight=weight)

    def extra_repr(self) -> str:
        return "weight=None" if self.weight is None else f"weight={self.weight.tolist()}"
