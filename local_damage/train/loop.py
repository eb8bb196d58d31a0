"""The training loop: config in, run folder out, in one function that reads top to bottom.

``train`` builds the loaders (:mod:`~local_damage.train.loaders`), then the model, objective and
optimiser, and runs epochs (:mod:`~local_damage.train.epoch`: training with the alpha schedule,
then validation); it keeps the best weights by validation macro-F1, stops early, and writes
everything a run needs to be resumed, evaluated or exported: the checkpoints
(:mod:`~local_damage.train.checkpoint`, which also describes the layout), metrics.csv
(:mod:`~local_damage.train.records`), curves.png (:mod:`~local_damage.train.curves`) and
summary.json.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data_prep.store import read_meta, write_json
from local_damage.config import to_dict
from local_damage.data import class_counts
from local_damage.losses import class_weights
from local_damage.losses.objective import uses_latent
from local_damage.models import build_model
from local_damage.train import checkpoint as ckpt
from local_damage.train.checkpoint import Standing
from local_damage.train.config import Config, fidelity_notes
from local_damage.train.curves import plot_curves
from local_damage.train.device import resolve_device
from local_damage.train.distributed import (
    DistInfo,
    all_reduce_sum,
    cleanup,
    init_distributed,
    replica_checksums,
)
from local_damage.train.epoch import Learner, train_epoch, validate
from local_damage.train.loaders import ChipSplit, Loaders, build_loaders, split_chip_ids
from local_damage.train.records import EpochRecords, start_run_folder

log = logging.getLogger(__name__)

SUMMARY = "summary.json"


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 - seeds third-party users of the global RNG
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def model_config_for(cfg: Config):
    """The model config, with the latent module switched off for methods that do not use it."""
    if not uses_latent(cfg.loss.method) and cfg.model.latent_blocks:
        return replace(cfg.model, latent_blocks=None)
    return cfg.model


def build_optimizer(cfg: Config, model: torch.nn.Module):
    """The optimiser and its schedule: one parameter group, or two when
    ``optim.encoder_lr_scale`` < 1 (the encoder's at that share of ``optim.lr``; the schedule
    scales both alike)."""
    o = cfg.optim
    params: list = [p for p in model.parameters() if p.requires_grad]
    if o.encoder_lr_scale != 1.0 and hasattr(model, "encoder"):
        encoder = {id(p) for p in model.encoder.parameters()}
        params = [
            {"params": [p for p in params if id(p) not in encoder]},
            {
                "params": [p for p in params if id(p) in encoder],
                "lr": o.lr * o.encoder_lr_scale,
            },
        ]
    if o.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    else:
        opt = torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)
    epochs = cfg.train.epochs

    def factor(epoch: int) -> float:
        if epoch < o.warmup_epochs:
            return (epoch + 1) / (o.warmup_epochs + 1)
        e = epoch - o.warmup_epochs
        if o.schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * e / max(1, epochs - o.warmup_epochs)))
        if o.schedule == "step":
            return o.gamma ** (e // max(1, o.step_size))
        return 1.0

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def start_device(cfg: Config) -> tuple[torch.device, DistInfo]:
    """The device of ``train.device``, joining the process group when started by torchrun (each
    replica then takes the GPU of its local rank)."""
    device = resolve_device(cfg.train.device)
    dist_info = init_distributed(device.type)
    if dist_info.enabled and device.type == "cuda":
        device = torch.device("cuda", dist_info.local_rank)
        torch.cuda.set_device(device)
    return device, dist_info


def build_learner(
    cfg: Config,
    labels: np.ndarray,
    device: torch.device,
    dist_info: DistInfo,
    init: str | Path | None = None,
) -> Learner:
    """The model (from ``init``'s weights when given), the objective weighted by the training
    ``labels`` ``[N]``, the optimiser and schedule, DDP under torchrun, the gradient scaler."""
    num_classes = cfg.model.num_classes
    model = build_model(model_config_for(cfg)).to(device)
    if init is not None:
        missing, unexpected = ckpt.load_weights(model, ckpt.resolve_weights(init), strict=False)
        if unexpected or missing:
            log.warning(
                f"init from {init}: {len(missing)} missing, {len(unexpected)} unexpected weight(s)"
            )
    counts = class_counts(labels, num_classes)
    if cfg.data.balanced_sampling:
        # Every present class is drawn equally often, so the batches already carry the
        # reciprocal-frequency weighting; weighting the loss as well would correct twice.
        counts = (counts > 0).astype(np.int64)
    weights = class_weights(counts, num_classes, counts=True, power=cfg.loss.weight_power)
    weights = torch.as_tensor(weights, dtype=torch.float32)
    objective = cfg.loss.build(weights).to(device)
    optimizer, scheduler = build_optimizer(cfg, model)
    ddp_model = model
    if dist_info.enabled:
        ddp_model = torch.nn.parallel.DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=cfg.train.freeze_encoder_epochs > 0,
        )
    scaler = torch.amp.GradScaler(enabled=device.type == "cuda" and cfg.train.amp == "fp16")
    return Learner(
        model, ddp_model, objective, optimizer, scheduler, scaler, device, dist_info, weights
    )


def train(
    cfg: Config,
    chips: str | Path,
    out: str | Path,
    split: ChipSplit | None = None,
    init: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Train a model on a chip store and write the run folder ``out``.

    Args:
        cfg: the resolved config (saved as ``out/config.yaml``).
        chips: chip store folder (manifest.csv; splits.csv when a fold is given).
        out: run folder.
        split: which chips train and which validate (:class:`ChipSplit`: a validation ``fold``,
            a ``holdout`` fold, or the caller's chip ids); None trains on every labelled chip
            without validation (the last epoch's weights become ``best.safetensors``).
        init: start from the weights of a run folder or .safetensors file (fine-tuning).
        resume: continue from ``out``'s last checkpoint exactly (same config, optimiser, RNG).
        progress: show a progress bar and log one line per epoch.

    Returns:
        The run summary (also written to ``out/summary.json``).
    """
    out, split = Path(out), split or ChipSplit()
    device, dist_info = start_device(cfg)
    is_main = dist_info.is_main
    seed_everything(cfg.train.seed, cfg.train.deterministic)

    train_ids, val_ids = split_chip_ids(chips, split)
    loaders = build_loaders(cfg, chips, train_ids, val_ids, dist_info, device)
    learner = build_learner(cfg, loaders.train.dataset.labels, device, dist_info, init)
    model = learner.model

    start_epoch, standing = 0, Standing()
    if resume:
        start_epoch, standing = ckpt.resume_checkpoint(
            out, model, learner.optimizer, learner.scheduler
        )
    elif is_main:
        start_run_folder(out, cfg)
    if is_main:
        for note in fidelity_notes(cfg):
            log.warning(f"note: {note}")
    records = EpochRecords(out, cfg.train.epochs, progress) if is_main else None

    for epoch in range(start_epoch, cfg.train.epochs):
        row = train_epoch(learner, loaders.train, cfg, epoch, progress and is_main)
        improved = True
        if loaders.val is not None and is_main:
            row.update(validate(model, loaders.val, device, cfg))
            improved = row["val_macro_f1"] > standing.best_score or cfg.train.keep == "last"
        if is_main:
            if improved:
                standing = Standing(row.get("val_macro_f1", float(epoch)), epoch, 0)
                ckpt.save_weights(model, out / ckpt.BEST, metadata={"epoch": str(epoch)})
            else:
                standing.stale += 1
            ckpt.save_checkpoint(out, model, learner.optimizer, learner.scheduler, epoch, standing)
            records.add(row)
        if dist_info.enabled:  # every replica takes the same early-stopping decision
            stale = torch.tensor([standing.stale if is_main else 0])
            standing.stale = int(all_reduce_sum(stale, dist_info).item())
        if loaders.val is not None and cfg.train.patience and standing.stale >= cfg.train.patience:
            if progress and is_main:
                log.info(f"early stop: no better validation macro-F1 for {standing.stale} epochs")
            break

    summary = run_summary(cfg, chips, loaders, learner, standing, split)
    if dist_info.enabled:  # replicas must hold identical weights; record the evidence
        summary["replica_checksums"] = replica_checksums(model, dist_info)
    if is_main:
        write_json(out / SUMMARY, summary)
        plot_curves(out)
        records.close()
    cleanup(dist_info)
    return summary


def run_summary(
    cfg: Config,
    chips: str | Path,
    loaders: Loaders,
    learner: Learner,
    standing: Standing,
    split: ChipSplit,
) -> dict[str, Any]:
    """The summary.json of a run: data, best epoch, class weights, config and devices."""
    train_set = loaders.train.dataset
    return {
        "chip_spec": read_meta(chips).get("spec"),
        "chips": str(chips),
        "events": sorted(set(train_set.frame["event"])),
        # the tiles trained on, so that figures on them can be marked as in-sample later
        "train_tiles": sorted(set(train_set.frame["tile"].astype(str))),
        "best_epoch": standing.best_epoch,
        "best_val_macro_f1": standing.best_score if loaders.val is not None else None,
        "fold": split.fold,
        "holdout": split.holdout,
        "train_chips": len(train_set),
        "val_chips": len(loaders.val.dataset) if loaders.val else 0,
        "class_weights": learner.class_weights.tolist(),
        "config": to_dict(cfg),
        "world_size": learner.dist.world_size,
        "device": str(learner.device),
    }


def load_summary(run: str | Path) -> dict[str, Any]:
    return json.loads((Path(run) / SUMMARY).read_text())
