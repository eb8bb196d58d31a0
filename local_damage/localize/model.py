"""The localiser network: an smp U-Net with a ResNet encoder, and its uint8-in ONNX wrapper."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from local_damage.data import MEAN, STD
from local_damage.localize.config import UnetConfig
from local_damage.models.encoders import (
    WeightsFileNotFoundError,
    check_name,
    load_encoder_weights,
)


def build_unet(cfg: UnetConfig) -> nn.Module:
    """A U-Net with one output channel (building logits) at the input's resolution.

    Args:
        cfg: encoder name, optional local encoder weights file and decoder widths.

    Returns:
        ``nn.Module`` mapping normalised ``[N, 3, H, W]`` (H, W multiples of 32) to logits
        ``[N, 1, H, W]``.

    Raises:
        EncoderError: unknown encoder name (the message lists the valid ones).
        WeightsFileNotFoundError: ``cfg.encoder_weights`` names a file that does not exist.
    """
    import segmentation_models_pytorch as smp

    path = None
    if cfg.encoder_weights:
        path = Path(cfg.encoder_weights)
        if not path.is_file():
            raise WeightsFileNotFoundError(
                f"model.encoder_weights: {path} not found; pass the path of a local encoder "
                "weights file (.pth / .safetensors) or leave it empty for random initialisation"
            )
    check_name(cfg.encoder)
    net = smp.Unet(
        cfg.encoder,
        encoder_weights=None,
        decoder_channels=list(cfg.decoder_channels),
        classes=1,
    )
    if path is not None:
        load_encoder_weights(net.encoder, path)
    return net


#: The flips averaged by ``flip_tta``: none, width, height, both (dims of ``[N, C, H, W]``).
FLIPS: tuple[tuple[int, ...], ...] = ((), (3,), (2,), (2, 3))


def building_probability(net: nn.Module, x: torch.Tensor, flip_tta: bool = False) -> torch.Tensor:
    """Sigmoid of the net's logits ``[N, H, W]`` for normalised ``x`` ``[N, 3, H, W]``; with
    ``flip_tta`` the mean over :data:`FLIPS` of the flipped input, flipped back (the flips go
    through the net as one batch, so each weight appears once in an exported graph)."""
    if not flip_tta:
        return torch.sigmoid(net(x)).squeeze(1)
    n = x.shape[0]
    batch = torch.cat([torch.flip(x, dims) if dims else x for dims in FLIPS], dim=0)
    p = torch.sigmoid(net(batch))
    parts = [p[i * n : (i + 1) * n] for i in range(len(FLIPS))]
    back = [torch.flip(q, dims) if dims else q for q, dims in zip(parts, FLIPS, strict=True)]
    return (torch.stack(back, dim=0).mean(dim=0)).squeeze(1)


class UInt8Localizer(nn.Module):
    """uint8 RGB ``[N, H, W, 3]`` in, building probability ``[N, H, W]`` float32 out.

    Normalisation (:data:`local_damage.data.MEAN` / ``STD``), the sigmoid and, with
    ``flip_tta``, the average over flips (:func:`building_probability`) are inside, so the
    exported graph takes plain pixels; H and W must be multiples of 32.
    """

    def __init__(self, net: nn.Module, flip_tta: bool = False) -> None:
        super().__init__()
        self.net = net
        self.flip_tta = bool(flip_tta)
        self.register_buffer("mean", torch.tensor(MEAN, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(STD, dtype=torch.float32).view(1, 3, 1, 1))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = (image.permute(0, 3, 1, 2).float() - self.mean) / self.std
        return building_probability(self.net, x, self.flip_tta)


def normalize(image: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, H, W, 3]`` to the network's normalised float ``[N, 3, H, W]``."""
    mean = torch.tensor(MEAN, dtype=torch.float32, device=image.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float32, device=image.device).view(1, 3, 1, 1)
    return (image.permute(0, 3, 1, 2).float() - mean) / std


def torch_model(net: nn.Module, flip_tta: bool = False):
    """A :data:`~runtime.evaluation.localizer.Model` function over a PyTorch U-Net (eval mode):
    uint8 ``[1, h, w, 3]`` in, building probability ``[1, h, w]`` out, averaged over flips with
    ``flip_tta`` (as the exported graph does)."""

    @torch.no_grad()
    def run(batch: np.ndarray) -> np.ndarray:
        net.eval()
        device = next(net.parameters()).device
        x = normalize(torch.from_numpy(batch).to(device))
        return building_probability(net, x, flip_tta).float().cpu().numpy()

    return run
