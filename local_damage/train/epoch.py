"""One epoch: a training pass over the loader, then validation with the class-mean geometry.

Both record the geometry of the class means of the normalised embeddings ``z``
(:func:`runtime.metrics.gram_summary`): ``train_*`` from the embeddings the loss saw during
the epoch (augmented, the weights moving), ``val_*`` from the validation chips under the weights
the epoch ends with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from data_prep.spec import CLASS_NAMES
from local_damage.data import normalize
from local_damage.train.config import Config
from local_damage.train.device import autocast_context, peak_memory_mb, reset_peak
from local_damage.train.distributed import DistInfo, gather_labels, gather_with_grad
from local_damage.train.loaders import start_epoch
from runtime.metrics import (
    class_mean_gram,
    classification_metrics,
    gram_of_sums,
    gram_summary,
    unit_rows,
)


@dataclass
class Learner:
    """What training updates, on one device: the model (``ddp_model`` is its DistributedDataParallel
    wrapper under torchrun, else the model itself), the objective built with ``class_weights``
    ``[K]``, the optimiser, its learning-rate schedule and the gradient scaler."""

    model: torch.nn.Module
    ddp_model: torch.nn.Module
    objective: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    device: torch.device
    dist: DistInfo
    class_weights: torch.Tensor


def set_encoder_trainable(model: torch.nn.Module, trainable: bool) -> None:
    for p in model.encoder.parameters():
        p.requires_grad_(trainable)


def train_step(
    learner: Learner,
    cfg: Config,
    pre: torch.Tensor,
    post: torch.Tensor,
    y: torch.Tensor,
    alpha: float,
):
    """One optimiser step on a batch (uint8 ``[B, 3, S, S]`` pairs, labels ``[B]``); returns the
    model output and the loss terms."""
    device, dist = learner.device, learner.dist
    pre, post, y = (
        normalize(pre.to(device, non_blocking=True)),
        normalize(post.to(device, non_blocking=True)),
        y.to(device),
    )
    with autocast_context(cfg.train.amp, device):
        output = learner.ddp_model(pre, post)
    z = gather_with_grad((output.z if cfg.loss.normalize_z else output.z_raw).float(), dist)
    lat = gather_with_grad(output.l.float(), dist) if output.l is not None else None
    loss, parts = learner.objective(
        output.logits.float(), y, z=z, l=lat, alpha=alpha, contrastive_labels=gather_labels(y, dist)
    )
    optimizer, scaler = learner.optimizer, learner.scaler
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    if cfg.optim.grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(learner.model.parameters(), cfg.optim.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    return output, y, parts


def train_epoch(
    learner: Learner, loader: DataLoader, cfg: Config, epoch: int, show_progress: bool
) -> dict[str, Any]:
    """Train one epoch (at most ``train.max_steps_per_epoch`` steps) and step the schedule.

    Returns:
        The epoch's metrics.csv fields from training: epoch, alpha, lr, the mean loss terms,
        ``train_*`` class-mean geometry, pairs_per_s (all replicas), peak_memory_mb, seconds.
    """
    model, device, dist = learner.model, learner.device, learner.dist
    alpha = cfg.loss.alpha(epoch, cfg.train.epochs)
    set_encoder_trainable(model, epoch >= cfg.train.freeze_encoder_epochs)
    start_epoch(loader, epoch, cfg.train.seed, dist.rank)
    learner.ddp_model.train()
    if epoch < cfg.train.freeze_encoder_epochs:
        model.encoder.eval()  # frozen means batch-norm statistics too
    reset_peak(device)
    sums: dict[str, float] = {}
    # Per-class sums of this replica's normalised z as the loss saw them (augmented, the
    # weights moving during the epoch): the class-mean geometry of the training embeddings.
    z_sums = None
    steps, t0 = 0, time.perf_counter()
    total_steps = (
        len(loader)
        if not cfg.train.max_steps_per_epoch
        else min(len(loader), cfg.train.max_steps_per_epoch)
    )
    bar = tqdm(
        total=total_steps,
        desc=f"epoch {epoch + 1}/{cfg.train.epochs}",
        disable=not show_progress,
        unit="step",
        leave=False,
    )
    for pre, post, y in loader:
        if steps >= total_steps:
            break
        output, y, parts = train_step(learner, cfg, pre, post, y, alpha)
        steps += 1
        z_batch = output.z.detach().double()  # summed where it lives: no copy per step
        if z_sums is None:
            z_sums = z_batch.new_zeros(cfg.model.num_classes, z_batch.shape[1])
        z_sums.index_add_(0, y, z_batch)
        for k, v in parts.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        bar.set_postfix(
            loss=f"{sums['total'] / steps:.3f}",
            pairs_s=f"{steps * cfg.train.batch_size / (time.perf_counter() - t0):.1f}",
        )
        bar.update()
    bar.close()
    learner.scheduler.step()
    seconds = time.perf_counter() - t0

    def mean(key: str, empty: float = 0.0) -> float:
        return sums.get(key, empty) / max(steps, 1)

    return {
        "epoch": epoch,
        "alpha": round(alpha, 6),
        "lr": learner.optimizer.param_groups[0]["lr"],
        "train_loss": mean("total"),
        "wce": mean("wce"),
        "contrastive_z": mean("contrastive_z", float("nan")),
        "contrastive_l": mean("contrastive_l", float("nan")),
        **(geometry_fields("train", gram_of_sums(z_sums.cpu().numpy())[0]) if steps else {}),
        "pairs_per_s": steps * cfg.train.batch_size * dist.world_size / seconds,
        "peak_memory_mb": peak_memory_mb(device),
        "seconds": seconds,
    }


@torch.no_grad()
def predict_loader(model, loader, device, amp: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(labels [N], predictions [N], z [N, D]) over a loader."""
    model.eval()
    ys, preds, zs = [], [], []
    for pre, post, y in loader:
        with autocast_context(amp, device):
            logits, z = model.predict(normalize(pre.to(device)), normalize(post.to(device)))
        ys.append(y.numpy())
        preds.append(logits.float().argmax(1).cpu().numpy())
        zs.append(z.float().cpu().numpy())
    return np.concatenate(ys), np.concatenate(preds), np.concatenate(zs)


def validate(
    model: torch.nn.Module, loader: DataLoader, device: torch.device, cfg: Config
) -> dict[str, float]:
    """The epoch's metrics.csv fields from validation: val_accuracy, val_macro_f1 and the
    ``val_*`` class-mean geometry of the validation chips' ``z``."""
    num_classes = cfg.model.num_classes
    ys, preds, val_z = predict_loader(model, loader, device, cfg.train.amp)
    metrics = classification_metrics(ys, preds, CLASS_NAMES[:num_classes])
    unit, directed = unit_rows(val_z)  # z = 0 (no change seen) has no direction
    gram = class_mean_gram(unit[directed], ys[directed], num_classes)[0]
    return {
        "val_accuracy": metrics["accuracy"],
        "val_macro_f1": metrics["macro_f1"],
        **geometry_fields("val", gram),
    }


def geometry_fields(prefix: str, gram: np.ndarray) -> dict[str, float]:
    """``PREFIX_max_abs_cos`` and ``PREFIX_mean_offdiag_cos`` of a class-mean Gram matrix."""
    return {f"{prefix}_{k}": v for k, v in gram_summary(gram).items()}
