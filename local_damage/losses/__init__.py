"""LOCAL losses: orthonormal and supervised contrastive losses, weighted CE, and the objective.

Importing this package imports torch; the CLI parser does not import it.
"""

from local_damage.losses.masks import LabelMasks, cosine_similarity_matrix, label_masks
from local_damage.losses.objective import (
    ALPHA_SCHEDULES,
    METHODS,
    LossConfig,
    MethodSpec,
    Objective,
    alpha_at,
    build_objective,
    check_method,
    uses_latent,
)
from local_damage.losses.orthonormal import OrthonormalContrastiveLoss
from local_damage.losses.supcon import SupConLoss
from local_damage.losses.weighted_ce import WeightedCrossEntropy, class_counts, class_weights

__all__ = [
    "ALPHA_SCHEDULES",
    "METHODS",
    "LabelMasks",
    "LossConfig",
    "MethodSpec",
    "Objective",
    "OrthonormalContrastiveLoss",
    "SupConLoss",
    "WeightedCrossEntropy",
    "alpha_at",
    "build_objective",
    "check_method",
    "class_counts",
    "class_weights",
    "cosine_similarity_matrix",
    "label_masks",
    "uses_latent",
]
