"""The pretraining loop: two views of random crops through the shared encoder, a projection head,
and a self-supervised contrastive loss; the encoder's weights are written for `train`.

``OUT/encoder.safetensors`` holds the encoder's state dict as :func:`build_encoder` names it, so
a training config takes it with ``model.weights: OUT/encoder.safetensors`` (both branches of the
Siamese network share that encoder). ``OUT/pretrain.yaml`` is the resolved config,
``OUT/log.csv`` the loss every ``log_every`` steps and ``OUT/summary.json`` what was run on.
"""

from __future__ import annotations

import csv
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from torch import nn

from data_prep.store import atomic_path, write_json
from local_damage.data import normalize
from local_damage.models.encoders import build_encoder, feature_channels
from local_damage.pretrain.crops import (
    AUGMENT_STRENGTHS,
    VIEW_MODES,
    CropPool,
    PretrainError,
    augment,
    find_sources,
)
from local_damage.pretrain.losses import PRETRAIN_LOSSES, BalancedContrastiveLoss, NTXentLoss
from local_damage.train.device import resolve_device

log = logging.getLogger(__name__)

ENCODER_FILE = "encoder.safetensors"


@dataclass
class PretrainConfig:
    """Settings of a pretraining run (saved as ``OUT/pretrain.yaml``).

    Attributes:
        encoder: smp encoder name (the one `train` will use).
        loss: ``"balanced"`` (paper 004) or ``"ntxent"`` (SimCLR).
        alpha, lam: the balanced loss's sharpness and repelling weight.
        temperature: NT-Xent's temperature.
        views: ``"augment"`` (two augmentations of one crop) or ``"prepost"`` (pre and post of
            the same window of an xBD tile).
        crop: window side in source pixels; input_size: side the views are resized to.
        augment: how strongly each view is changed: ``light`` or ``simclr``
            (:data:`~local_damage.pretrain.crops.AUGMENT_STRENGTHS`).
        batch_size: view pairs per step; steps: optimiser steps.
        lr, weight_decay: AdamW.
        proj_hidden, embed_dim: the projection head (dropped after pretraining).
        pool_size, refresh_every: see :class:`~local_damage.pretrain.crops.CropPool`.
        seed: seed of weights, crops and augmentations.
        log_every: steps between lines of log.csv.
        device: ``auto`` (CUDA when available, else the CPU), ``cpu`` or ``cuda``.
    """

    encoder: str = "resnet18"
    loss: str = "balanced"
    alpha: float = 5.0
    lam: float = 1.0
    temperature: float = 0.2
    views: str = "augment"
    crop: int = 128
    input_size: int = 64
    augment: str = "light"
    batch_size: int = 32
    steps: int = 1000
    lr: float = 1e-3
    weight_decay: float = 1e-4
    proj_hidden: int = 512
    embed_dim: int = 128
    pool_size: int = 8
    refresh_every: int = 4
    seed: int = 0
    log_every: int = 10
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.loss not in PRETRAIN_LOSSES:
            raise ValueError(
                f"unknown loss {self.loss!r}; expected one of {', '.join(PRETRAIN_LOSSES)}"
            )
        if self.augment not in AUGMENT_STRENGTHS:
            raise ValueError(
                f"unknown augment {self.augment!r}; expected one of {', '.join(AUGMENT_STRENGTHS)}"
            )
        if self.views not in VIEW_MODES:
            raise ValueError(
                f"unknown views {self.views!r}; expected one of {', '.join(VIEW_MODES)}"
            )
        for name in ("crop", "input_size", "batch_size", "steps", "pool_size", "log_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"unknown device {self.device!r}; expected auto, cpu or cuda")
        if self.batch_size < 2:
            raise ValueError(f"batch_size must be at least 2 (negatives), got {self.batch_size}")

    def build_loss(self) -> nn.Module:
        if self.loss == "balanced":
            return BalancedContrastiveLoss(self.alpha, self.lam)
        return NTXentLoss(self.temperature)


class PretrainNet(nn.Module):
    """The shared encoder, global average pooling and a projection MLP: ``[N, 3, H, W] -> [N, D]``."""

    def __init__(self, cfg: PretrainConfig) -> None:
        super().__init__()
        self.encoder = build_encoder(cfg.encoder)
        d = feature_channels(self.encoder)[-1]
        self.head = nn.Sequential(
            nn.Linear(d, cfg.proj_hidden),
            nn.ReLU(inplace=True),
            nn.Linear(cfg.proj_hidden, cfg.embed_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.encoder(x)[-1].mean(dim=(2, 3))
        return self.head(F.normalize(r, dim=1))


def save_encoder(encoder: nn.Module, path: str | os.PathLike) -> Path:
    """Write ``encoder``'s state dict as safetensors, atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    state = {k: v.detach().cpu().contiguous() for k, v in encoder.state_dict().items()}
    with atomic_path(path, suffix=".safetensors") as tmp:
        save_file(state, str(tmp))
    return path


def pretrain(
    cfg: PretrainConfig,
    xbd: list[str | os.PathLike],
    rasters: list[str | os.PathLike],
    out: str | os.PathLike,
    progress: bool = True,
) -> dict[str, Any]:
    """Pretrain an encoder on random crops of the sources and write ``out`` (see the module).

    Returns:
        The summary also written to ``out/summary.json``: sources, steps, first and last loss,
        seconds, and the weights file.
    """
    # refused before the imagery is searched and anything is written
    try:
        device = resolve_device(cfg.device)
    except RuntimeError as exc:
        raise PretrainError(f"pretrain: device {cfg.device!r}: CUDA is not available here") from exc
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    sources = find_sources(xbd, rasters, cfg.views)
    log.info(f"pretraining on {len(sources)} images ({cfg.views} views, {cfg.loss} loss)")
    pool = CropPool(sources, cfg.crop, cfg.views, cfg.pool_size, cfg.refresh_every, cfg.seed)
    net = PretrainNet(cfg).to(device)
    loss_fn = cfg.build_loss()
    optimizer = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.steps)
    generator = torch.Generator().manual_seed(cfg.seed)
    with atomic_path(out / "pretrain.yaml", suffix=".yaml") as tmp:
        tmp.write_text(yaml.safe_dump(asdict(cfg), sort_keys=False))
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    net.train()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc="pretrain", unit="step")
    data_seconds = 0.0  # crops and augmentation, in this process on the CPU
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        a, b = pool.batch(cfg.batch_size)
        va = augment(a, cfg.input_size, generator, strength=cfg.augment)
        vb = augment(b, cfg.input_size, generator, strength=cfg.augment)
        views = torch.cat([va, vb]).to(device)
        data_seconds += time.perf_counter() - t0
        emb = net(normalize(views))
        loss = loss_fn(emb[: cfg.batch_size], emb[cfg.batch_size :])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        value = float(loss.detach())  # waits for the step (CUDA included)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            rows.append({"step": step, "loss": value, "seconds": time.perf_counter() - start})
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{value:.3f}")
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - start
    weights = save_encoder(net.encoder, out / ENCODER_FILE)
    with atomic_path(out / "log.csv", suffix=".csv") as tmp, open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["step", "loss", "seconds"])
        writer.writeheader()
        writer.writerows(rows)
    summary = {
        "sources": [str(s.path) for s in sources],
        "xbd": [str(p) for p in xbd],
        "rasters": [str(p) for p in rasters],
        "steps": cfg.steps,
        "first_loss": rows[0]["loss"],
        "last_loss": rows[-1]["loss"],
        "seconds": seconds,
        "device": str(device),
        "steps_per_s": round(cfg.steps / seconds, 3),
        "data_seconds": round(data_seconds, 3),
        "weights": str(weights),
    }
    write_json(out / "summary.json", summary)
    return summary
