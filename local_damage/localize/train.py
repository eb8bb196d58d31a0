"""The localiser's training loop: config in, run folder out.

Layout of ``RUN/``: ``config.yaml`` (the resolved config), ``best.safetensors`` (U-Net weights of
the best validation epoch, or the last), ``last.safetensors``, ``metrics.csv`` (one row per
epoch) and ``summary.json`` (tiles and folds used, seconds per epoch, and the threshold and
smallest blob chosen on the validation tiles).

Tiles are split into the damage model's folds (:func:`data_prep.masks.fold_map`): ``fold`` is the
validation fold (the best epoch, the threshold and the smallest blob are chosen there), ``holdout``
a test fold never read.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch.nn import functional as F
from tqdm import tqdm

from data_prep.masks import find_mask_tiles, fold_map, load_mask_tile
from data_prep.xbd_tiles import as_roots, roots_label
from local_damage.config import save_yaml, to_dict
from local_damage.localize.config import LocalizeConfig
from local_damage.localize.data import TileCrops
from local_damage.localize.model import build_unet, normalize, torch_model
from local_damage.train.checkpoint import save_weights
from local_damage.train.device import resolve_device
from local_damage.train.loop import build_optimizer, seed_everything
from runtime.evaluation.localizer import (
    building_mask,
    choose_operating_point,
    pixel_counts,
    predict_probability,
    scores,
)
from runtime.localize_errors import LocalizeError

log = logging.getLogger(__name__)

BEST = "best.safetensors"
LAST = "last.safetensors"
SUMMARY = "summary.json"
METRICS_CSV = "metrics.csv"
#: The columns of metrics.csv (validation columns stay empty in epochs without validation).
FIELDS = ["epoch", "lr", "train_loss", "val_precision", "val_recall", "val_f1", "seconds"]


def bce_dice_loss(
    logits: torch.Tensor, target: torch.Tensor, bce_weight: float = 1.0, dice_weight: float = 1.0
) -> torch.Tensor:
    """``bce_weight * BCE + dice_weight * (1 - soft Dice)``; logits and target ``[N, H, W]``.

    The soft Dice is computed over the whole batch (smoothing 1), so crops without buildings do
    not give it an undefined term.
    """
    bce = F.binary_cross_entropy_with_logits(logits, target)
    prob = torch.sigmoid(logits)
    dice = (2 * (prob * target).sum() + 1) / (prob.sum() + target.sum() + 1)
    return bce_weight * bce + dice_weight * (1 - dice)


@dataclass(frozen=True)
class TileSplit:
    """Which tiles a localiser trains on and validates on (the defaults: the tile folds of
    ``local-damage split --folds 5 --seed 14``, every tile trained on, no validation).

    Attributes:
        fold: validation fold; None trains on every tile outside ``holdout`` without validation
            (the last weights are kept and the threshold stays 0.5, smallest blob 0).
        holdout: test fold, never read.
        folds: number of tile folds.
        split_seed: seed of the tile folds.
        splits: take the folds from this chip store ``splits.csv`` instead.
    """

    fold: int | None = None
    holdout: int | None = None
    folds: int = 5
    split_seed: int = 14
    splits: str | os.PathLike | None = None


def split_tiles(tiles, folds_of: dict[str, int], fold: int | None, holdout: int | None):
    """``(train, val)`` tiles: val is fold ``fold``; train every other tile outside ``holdout``."""
    if fold is not None and fold == holdout:
        raise LocalizeError(f"fold {fold} cannot be both the validation and the held-out fold")
    known = sorted(set(folds_of.values()))
    for name, k in (("fold", fold), ("holdout", holdout)):
        if k is not None and k not in known:
            raise LocalizeError(f"no {name} {k}; the folds are {', '.join(map(str, known))}")
    val = [t for t in tiles if fold is not None and folds_of.get(t.name) == fold]
    train = [
        t
        for t in tiles
        if folds_of.get(t.name) not in {fold, holdout} or folds_of.get(t.name) is None
    ]
    return train, val


def crop_loader(
    cfg: LocalizeConfig, pairs: list[tuple[np.ndarray, np.ndarray]]
) -> torch.utils.data.DataLoader:
    """Shuffled batches of random crops of the training ``(image, mask)`` pairs, seeded."""
    dataset = TileCrops(
        [p[0] for p in pairs],
        [p[1] for p in pairs],
        cfg.data.crop_size,
        cfg.data.crops_per_tile,
        augment=cfg.data.augment,
        seed=cfg.train.seed,
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=cfg.train.batch_size,
        shuffle=True,
        drop_last=len(dataset) >= cfg.train.batch_size,
        generator=torch.Generator().manual_seed(cfg.train.seed),
    )


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX tiles)."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def training_device(name: str) -> torch.device:
    """``train.device`` as a torch device, or a :class:`LocalizeError` saying why it cannot be
    used (checked before any tile is read)."""
    try:
        return resolve_device(name)
    except RuntimeError as exc:
        raise LocalizeError(str(exc)) from None


def training_precision(amp: str, device: torch.device | None = None) -> str:
    """``"bf16"``, ``"fp16"`` or ``"fp32"``: what the training steps run in for ``train.amp``.

    On a CUDA device ``auto`` and ``bf16`` are bf16 (fp16 on a GPU without bfloat16). On the
    CPU ``auto`` is bf16 only where the CPU computes it natively. An explicit ``bf16`` on a CPU that
    emulates it is kept (the figures of a bf16 recipe reproduce with it) with a warning: there,
    one localiser epoch took 316 s under bf16 against 32 s in fp32 (35 crops, one thread, an
    AVX2 CPU; docs/localize.md).
    """
    if amp == "off":
        return "fp32"
    if device is not None and device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    native = native_bf16()
    if amp == "bf16" and not native:
        log.warning(
            "train.amp=bf16 on a CPU without native bfloat16 (no AVX-512 BF16 or AMX): it is "
            "emulated and about ten times slower than fp32; --set train.amp=auto (or off) trains "
            "in fp32 here"
        )
    return "bf16" if amp == "bf16" or native else "fp32"


def train_epoch(
    net: torch.nn.Module,
    loader: torch.utils.data.DataLoader,
    optimizer: torch.optim.Optimizer,
    cfg: LocalizeConfig,
    epoch: int,
    progress: bool,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
) -> float:
    """One pass over the crops on the device of ``net`` (``precision`` ``bf16`` or ``fp16``:
    under autocast to that type, the loss in fp32; fp16 scales the loss with ``scaler``, kept
    across epochs by the caller); returns the mean loss."""
    device = next(net.parameters()).device
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    autocast = torch.autocast(device.type, dtype=dtype, enabled=precision != "fp32")
    scaler = scaler or torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    net.train()
    losses = []
    bar = tqdm(
        loader,
        desc=f"epoch {epoch + 1}/{cfg.train.epochs}",
        disable=not progress,
        leave=False,
        unit="batch",
    )
    for image, mask in bar:
        image = image.to(device, non_blocking=True)
        mask = mask.to(device, non_blocking=True)
        with autocast:
            logits = net(normalize(image)).squeeze(1)
        loss = bce_dice_loss(logits.float(), mask, cfg.loss.bce_weight, cfg.loss.dice_weight)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if cfg.optim.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.optim.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{np.mean(losses):.4f}")
    return float(np.mean(losses))


def validate(
    net: torch.nn.Module, val_pairs: list[tuple[np.ndarray, np.ndarray]], cfg: LocalizeConfig
) -> tuple[list[np.ndarray], dict[str, float]]:
    """Probabilities ``[H, W]`` of the validation tiles and their pooled pixel scores at 0.5."""
    run = torch_model(net, cfg.model.flip_tta)
    probs = [
        predict_probability(run, image, cfg.data.scale, cfg.data.tile_size)
        for image, _ in val_pairs
    ]
    counts = np.zeros(3, np.int64)
    for prob, (_, mask) in zip(probs, val_pairs, strict=True):
        counts += pixel_counts(building_mask(prob, 0.5), mask)
    return probs, scores(*map(int, counts))


def epoch_line(row: dict[str, Any], epochs: int) -> str:
    """``epoch E/N: loss L  val F1@0.5 F  Ss`` (the F1 part with validation only)."""
    shown = f"  val F1@0.5 {row['val_f1']:.4f}" if "val_f1" in row else ""
    return (
        f"epoch {row['epoch']}/{epochs}: loss {row['train_loss']:.4f}{shown}  {row['seconds']:.1f}s"
    )


def train_localizer(
    cfg: LocalizeConfig,
    root: str | os.PathLike | Sequence[str | os.PathLike],
    out: str | os.PathLike,
    split: TileSplit | None = None,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Train a localiser on the xBD tiles below ``root`` and write the run folder ``out``.

    Args:
        cfg: the resolved config (saved as ``out/config.yaml``).
        root: xBD root (images/ and labels/), or several (their tiles together).
        out: run folder.
        split: the validation fold, the test fold and the tile folds (:class:`TileSplit`; None:
            every tile of the default folds trained on, without validation).
        progress: show a progress bar and log one line per epoch.

    Returns:
        The run summary (also ``out/summary.json``).
    """
    out, split = Path(out), split or TileSplit()
    fold, holdout = split.fold, split.holdout
    device = training_device(cfg.train.device)
    seed_everything(cfg.train.seed, deterministic=False)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    tiles = find_mask_tiles(root)
    folds_of = fold_map(tiles, split.folds, split.split_seed, split.splits)
    train_tiles, val_tiles = split_tiles(tiles, folds_of, fold, holdout)
    if not train_tiles:
        raise LocalizeError(
            f"{roots_label(root)}: no training tiles left outside folds {fold} and {holdout}"
        )
    pairs = [load_mask_tile(t, cfg.data.scale) for t in train_tiles]
    val_pairs = [load_mask_tile(t, 1.0) for t in val_tiles]
    loader = crop_loader(cfg, pairs)
    net = build_unet(cfg.model).to(device)
    optimizer, scheduler = build_optimizer(cfg, net)
    out.mkdir(parents=True, exist_ok=True)
    save_yaml(cfg, out / "config.yaml")
    with open(out / METRICS_CSV, "w", newline="") as fh:
        csv.DictWriter(fh, FIELDS).writeheader()

    best_f1, best_epoch, epoch_seconds = -1.0, -1, []
    precision = training_precision(cfg.train.amp, device)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    for epoch in range(cfg.train.epochs):
        t0 = time.perf_counter()
        loss = train_epoch(net, loader, optimizer, cfg, epoch, progress, precision, scaler)
        lr = optimizer.param_groups[0]["lr"]
        scheduler.step()
        epoch_seconds.append(time.perf_counter() - t0)
        row: dict[str, Any] = {
            "epoch": epoch + 1,
            "lr": lr,
            "train_loss": loss,
            "seconds": round(epoch_seconds[-1], 2),
        }
        last = epoch + 1 == cfg.train.epochs
        if val_pairs and ((epoch + 1) % cfg.train.val_every == 0 or last):
            _, s = validate(net, val_pairs, cfg)
            row.update(val_precision=s["precision"], val_recall=s["recall"], val_f1=s["f1"])
            if cfg.train.keep == "best" and s["f1"] > best_f1:
                best_f1, best_epoch = s["f1"], epoch
                save_weights(net, out / BEST)
        save_weights(net, out / LAST)
        if cfg.train.keep == "last" or not val_pairs:
            save_weights(net, out / BEST)
            best_epoch = epoch
        with open(out / METRICS_CSV, "a", newline="") as fh:
            csv.DictWriter(fh, FIELDS).writerow(row)
        if progress:
            log.info(epoch_line(row, cfg.train.epochs))

    net.load_state_dict(load_file(str(out / BEST), device=str(device)))
    operating = {"threshold": 0.5, "min_area_px": 0, "chosen_on": None}
    if val_pairs:
        probs, _ = validate(net, val_pairs, cfg)
        c = cfg.calibration
        point = choose_operating_point(probs, [m for _, m in val_pairs], c.thresholds, c.min_areas)
        operating = {**point, "chosen_on": {"fold": fold, "tiles": [t.name for t in val_tiles]}}
    summary = {
        "root": [str(r) for r in as_roots(root)],
        "split": {
            "folds": split.folds,
            "by": "tile",
            "seed": split.split_seed,
            "splits": split.splits,
        },
        "fold": fold,
        "holdout": holdout,
        "train_tiles": [t.name for t in train_tiles],
        "val_tiles": [t.name for t in val_tiles],
        "train_folds": sorted({folds_of[t.name] for t in train_tiles if t.name in folds_of}),
        "events": sorted({t.event for t in train_tiles}),
        "epochs": cfg.train.epochs,
        "best_epoch": best_epoch + 1,
        "best_val_f1_at_0.5": best_f1 if best_f1 >= 0 else None,
        "seconds_per_epoch": float(np.median(epoch_seconds)),
        "precision": precision,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "operating_point": operating,
        "config": to_dict(cfg),
    }
    (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    return summary
