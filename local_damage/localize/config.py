"""The localiser's config: one dataclass per section, loaded from YAML like the damage model's.

Unknown keys are errors and ``--set section.key=value`` overrides any field
(:func:`local_damage.config.load_yaml`); the resolved config is saved with every run and inside
the exported model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from local_damage.train.config import OptimConfig


@dataclass
class UnetConfig:
    """The U-Net (segmentation-models-pytorch ``Unet``).

    Attributes:
        encoder: smp encoder name (``resnet18``, ``resnet34``, ...).
        encoder_weights: None for random initialisation, or the path of a local weights file
            (``.pth``/``.safetensors``; see :mod:`local_damage.models.encoders`).
        decoder_channels: channels of the five decoder blocks, deepest first.
        flip_tta: at inference (validation, the threshold search and the exported graph),
            average the building probability over the window and its horizontal, vertical and
            double flips: four passes of the network per window for a steadier mask.
    """

    encoder: str = "resnet18"
    encoder_weights: str | None = None
    decoder_channels: list[int] = field(default_factory=lambda: [128, 64, 32, 16, 16])
    flip_tta: bool = False

    def __post_init__(self) -> None:
        if len(self.decoder_channels) != 5:
            raise ValueError(
                f"model.decoder_channels needs 5 values (one per decoder block), "
                f"got {self.decoder_channels}"
            )


@dataclass
class LossConfig:
    """``bce_weight * BCE + dice_weight * soft Dice`` on the building logits."""

    bce_weight: float = 1.0
    dice_weight: float = 1.0


@dataclass
class TileDataConfig:
    """How tiles become training batches.

    Attributes:
        scale: factor tiles are resized by before training and inference (1.0 = native, 0.5 =
            half the side); the exported model carries it and the runtime resizes inputs by it.
        crop_size: side of the random training crops, in pixels after scaling (multiple of 32).
        crops_per_tile: random crops drawn from each training tile per epoch.
        augment: flips, 90-degree rotations and mild brightness/contrast on the crops.
        tile_size: side of the window the model runs on at inference, in model-input pixels
            (after scaling; multiple of 32); larger images are run window by window.
    """

    scale: float = 0.5
    crop_size: int = 256
    crops_per_tile: int = 16
    augment: bool = True
    tile_size: int = 512

    def __post_init__(self) -> None:
        if not 0 < self.scale <= 2:
            raise ValueError(f"data.scale must be in (0, 2], got {self.scale}")
        for name in ("crop_size", "tile_size"):
            value = getattr(self, name)
            if value < 32 or value % 32:
                raise ValueError(f"data.{name} must be a positive multiple of 32, got {value}")


@dataclass
class LoopConfig:
    """The loop.

    Attributes:
        epochs: number of epochs (each ``crops_per_tile`` crops of every training tile).
        batch_size: crops per step.
        seed: seed of weights init, crops and augmentation.
        threads: torch intra-op threads (0 = PyTorch's default).
        val_every: validate on the validation tiles every this many epochs (and after the last).
        keep: ``"best"`` (the epoch of highest validation pixel F1) or ``"last"``.
        amp: ``"bf16"``: training steps under bfloat16 autocast (several times faster on CPUs
            with AVX-512 BF16 or AMX; validation and export stay fp32), ``"off"``, or
            ``"auto"``: bf16 where the CPU computes bfloat16 natively, else off (a CPU without
            it emulates bfloat16, about ten times slower than fp32:
            :func:`local_damage.localize.train.training_precision`). On a CUDA device ``auto``
            and ``bf16`` are bfloat16 autocast (float16 where the GPU lacks bfloat16).
        device: ``"cpu"``, ``"cuda[:N]"``, or ``"auto"`` (CUDA when available, else the CPU);
            validation runs there too, export always on the CPU.
    """

    epochs: int = 30
    batch_size: int = 8
    seed: int = 0
    threads: int = 0
    val_every: int = 2
    keep: str = "best"
    amp: str = "off"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.keep not in ("best", "last"):
            raise ValueError(f"train.keep must be best or last, got {self.keep!r}")
        if self.amp not in ("auto", "bf16", "off"):
            raise ValueError(f"train.amp must be auto, bf16 or off, got {self.amp!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"train.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.batch_size < 1 or self.epochs < 1 or self.val_every < 1:
            raise ValueError("train.batch_size, train.epochs and train.val_every must be >= 1")


@dataclass
class CalibrationConfig:
    """The grids searched on the validation tiles for the threshold and the smallest blob.

    Attributes:
        thresholds: building-probability thresholds tried.
        min_areas: smallest connected blob kept, in native (full-resolution) pixels.
    """

    thresholds: list[float] = field(
        default_factory=lambda: [0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85]
    )
    min_areas: list[int] = field(default_factory=lambda: [0, 20, 40, 80, 120, 160, 240, 320])


@dataclass
class LocalizeConfig:
    """A whole localiser run: model, loss, data, optimiser, loop and threshold search."""

    model: UnetConfig = field(default_factory=UnetConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: TileDataConfig = field(default_factory=TileDataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, warmup_epochs=1))
    train: LoopConfig = field(default_factory=LoopConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
