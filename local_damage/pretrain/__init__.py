"""Self-supervised pretraining of the Siamese encoder on unlabelled imagery (`local-damage pretrain`).

Importing this package imports torch; the CLI parser does not import it.
"""

from local_damage.pretrain.losses import PRETRAIN_LOSSES, BalancedContrastiveLoss, NTXentLoss

__all__ = ["PRETRAIN_LOSSES", "BalancedContrastiveLoss", "NTXentLoss"]
