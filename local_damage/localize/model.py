"""The localiser network: an smp U-Net with a ResNet encoder, and its uint8-in ONNX wrapper."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from local_damage.data import MEAN, STD
from local_damage.localize.config import UnetConfig


def build_unet(cfg: UnetConfig) -> nn.Module:
    """A U-Net with one output channel (building logits) at the input's resolution.

    Args:
        cfg: encoder name, optional local encoder weights file and decoder widths.

    Returns:
        ``nn.Module`` mapping normalised ``[N, 3, H, W]`` (H, W multiples of 32) to logits
        ``[N, 1, H, W]``.

    Raises:
        ValueError: unknown encoder name (the message lists the valid ones).
        FileNotFoundError: ``cfg.encoder_weights`` names a file that does not exist.
    """
    import segmentation_models_pytorch as smp

    from local_damage.models.encoders import _check_name, load_encoder_weights

    path = None
    if cfg.encoder_weights:
        path = Path(cfg.encoder_weights)
        if not path.is_file():
            raise FileNotFoundError(
                f"model.encoder_weights: {path} not found; pass the path of a local encoder "
                "weights file (.pth / .safetensors) or leave it empty for random initialisation"
            )
    _check_name(cfg.encoder)
    net = smp.Unet(
        cfg.encoder,
        encoder_weights=None,
        decoder_channels=list(cfg.decoder_channels),
        classes=1,
    )
    if path is not None:
        load_encoder_weights(net.encoder, path)
    return net


class UInt8Localizer(nn.Module):
    """uint8 RGB ``[N, H, W, 3]`` in, building probability ``[N, H, W]`` float32 out.

    Normalisation (:data:`local_damage.data.MEAN` / ``STD``) and the sigmoid are inside, so the
    exported graph takes plain pixels; H and W must be multiples of 32.
    """

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.register_buffer("mean", torch.tensor(MEAN, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(STD, dtype=torch.float32).view(1, 3, 1, 1))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = (image.permute(0, 3, 1, 2).float() - self.mean) / self.std
        return torch.sigmoid(self.net(x)).squeeze(1)


def normalize(image: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, H, W, 3]`` to the network's normalised float ``[N, 3, H, W]``."""
    mean = torch.tensor(MEAN, dtype=torch.float32, device=image.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float32, device=image.device).view(1, 3, 1, 1)
    return (image.permute(0, 3, 1, 2).float() - mean) / std
