"""The training config: one dataclass per section, loaded from YAML (see local_damage.config)."""

from __future__ import annotations

from dataclasses import dataclass, field

from local_damage.data import STRENGTHS
from local_damage.losses.objective import LossConfig
from local_damage.models.local_net import ModelConfig
from runtime.grading import check_cost


@dataclass
class DataConfig:
    """How chips become batches.

    Attributes:
        input_size: side of the model input in pixels (chips are resized to it).
        augment: paired geometric and per-image photometric augmentation for training.
        augment_strength: "light" (the bundled model's) or "strong" (domain randomisation for
            new sensors and events; :func:`local_damage.data.build_transforms`).
        balanced_sampling: draw each class equally often (with replacement) instead of uniformly;
            the cross-entropy weights are then equal (the sampling already balances the classes).
        num_workers: DataLoader worker processes (0 = load in the training process).
    """

    input_size: int = 128
    augment: bool = True
    augment_strength: str = "light"
    balanced_sampling: bool = False
    num_workers: int = 0

    def __post_init__(self) -> None:
        if self.augment_strength not in STRENGTHS:
            raise ValueError(
                f"data.augment_strength must be one of {', '.join(STRENGTHS)}, got "
                f"{self.augment_strength!r}"
            )


@dataclass
class OptimConfig:
    """Optimiser and learning-rate schedule.

    Attributes:
        optimizer: "adamw" or "sgd".
        lr: peak learning rate.
        weight_decay: decoupled (AdamW) or L2 (SGD) weight decay.
        momentum: SGD momentum.
        schedule: "cosine" (to 0 over the epochs), "step" (x gamma every step_size epochs) or "constant".
        warmup_epochs: linear warm-up epochs before the schedule.
        step_size: epochs between decays of the step schedule.
        gamma: decay factor of the step schedule.
        grad_clip: max gradient norm (0 = no clipping).
        encoder_lr_scale: the encoder's learning rate as a share of ``lr`` (1: the same). Below 1
            when the encoder starts from pretrained weights (``model.weights`` or ``--init``), so
            fine-tuning does not wash out what pretraining learnt: the discriminative rates of
            ULMFiT (Howard and Ruder 2018) and of transfer learning generally; with
            ``train.freeze_encoder_epochs``, the encoder is first frozen, then trained at this
            share.
    """

    optimizer: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 1e-4
    momentum: float = 0.9
    schedule: str = "cosine"
    warmup_epochs: int = 0
    step_size: int = 10
    gamma: float = 0.1
    grad_clip: float = 0.0
    encoder_lr_scale: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.encoder_lr_scale) <= 1.0:
            raise ValueError(
                f"optim.encoder_lr_scale must be in [0, 1], got {self.encoder_lr_scale!r}"
            )
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optim.optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        if self.schedule not in ("cosine", "step", "constant"):
            raise ValueError(
                f"optim.schedule must be 'cosine', 'step' or 'constant', got {self.schedule!r}"
            )


@dataclass
class TrainConfig:
    """The loop.

    Attributes:
        epochs: maximum number of epochs.
        batch_size: pairs per step per process (the paper's "BS").
        seed: seed of weights init, sampling and augmentation.
        deterministic: ask PyTorch for deterministic kernels (slower on GPU).
        amp: mixed precision: "auto" (bf16 on CUDA when supported, else fp16; off on CPU),
            "bf16", "fp16" or "off". On CPU "bf16" runs autocast on the CPU.
        device: "auto", "cpu" or "cuda[:N]".
        patience: stop after this many epochs without a better validation macro-F1 (0 = never).
        freeze_encoder_epochs: keep the encoder frozen for the first epochs (fine-tuning with --init).
        max_steps_per_epoch: cap on steps per epoch (0 = the whole training set).
        eval_batch_size: batch size for validation.
        keep: which weights become ``best.safetensors`` when there is a validation fold: "best"
            (the epoch of highest validation macro-F1) or "last" (the last epoch, as without
            validation, so that a fold can be evaluated without selecting on it).
    """

    epochs: int = 20
    batch_size: int = 8
    seed: int = 0
    deterministic: bool = False
    amp: str = "auto"
    device: str = "auto"
    patience: int = 5
    freeze_encoder_epochs: int = 0
    max_steps_per_epoch: int = 0
    eval_batch_size: int = 64
    keep: str = "best"

    def __post_init__(self) -> None:
        if self.keep not in ("best", "last"):
            raise ValueError(f"train.keep must be best or last, got {self.keep!r}")
        if self.amp not in ("auto", "bf16", "fp16", "off"):
            raise ValueError(f"train.amp must be auto, bf16, fp16 or off, got {self.amp!r}")
        if self.batch_size < 2:
            raise ValueError(
                f"train.batch_size must be at least 2 for contrastive pairs, got {self.batch_size}"
            )


@dataclass
class GradeConfig:
    """How the trained model grades: part of the recipe, not of training (weights do not depend
    on it; a run is reused under another grade rule and evaluated again).

    Attributes:
        false_alarm_cost: a damaged grade only where at least this many times as probable as
            no-damage (:mod:`runtime.grading`; 1: the most probable grade). Evaluations of the
            run grade with it, and ``export`` writes it as the model's own rule (metadata
            ``grade_rule``), which ``score`` and the app use when the analyst sets no cost.
    """

    false_alarm_cost: float = 1.0

    def __post_init__(self) -> None:
        check_cost(self.false_alarm_cost)


@dataclass
class Config:
    """A whole training run: model, loss, data, optimiser, loop and grade rule."""

    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    grade: GradeConfig = field(default_factory=GradeConfig)


def fidelity_notes(cfg: Config) -> list[str]:
    """Where a config's objective departs from the LOCAL paper (Sec. 3.2-3.4), one line each.

    - ``model.latent_abs`` without ``model.latent_centre`` for LOCAL: every entry of
      ``l`` is ``>= 0``, so every ``<l_i, l_n>`` is ``>= 0``, the absolute value on negatives
      changes nothing, and OCL on ``l`` is exactly SCL on ``l`` (no orthonormal latent term).
    - ``loss.normalize_z: false`` for a contrastive method: ``z = e_pre - e_post`` is compared by
      raw inner products (norms up to 2, inner products up to 4), where the paper's theorems
      (3.1, 3.2) take unit vectors.

    Empty when the config follows the paper on both points.
    """
    notes = []
    method = cfg.loss.method
    model = cfg.model
    if method == "local" and model.latent_blocks and model.latent_abs and not model.latent_centre:
        notes.append(
            "model.latent_abs=true makes every latent vector l non-negative, so every "
            "<l_i, l_n> >= 0 and OCL on l is exactly SCL on l; model.latent_abs=false (the "
            "paper's signed map) gives the orthonormal latent term"
        )
    if method != "ce" and not cfg.loss.normalize_z:
        notes.append(
            "loss.normalize_z=false compares z = e_pre - e_post by raw inner products (up to 4); "
            "the paper's theorems take unit vectors (loss.normalize_z=true)"
        )
    return notes
