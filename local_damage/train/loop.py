"""The training loop: one readable function, config in, run folder out.

``train`` builds the data, model and objective from a :class:`Config`, runs epochs with the alpha
schedule, validates each epoch, keeps the best weights by validation macro-F1, stops early, and
writes everything a run needs to be resumed, evaluated or exported (see
:mod:`local_damage.train.checkpoint` for the layout).
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from data_prep.spec import CLASS_NAMES
from local_damage.config import save_yaml, to_dict
from local_damage.data import ChipPairDataset, balanced_sampler, class_counts, normalize
from local_damage.losses import class_weights
from local_damage.losses.objective import uses_latent
from local_damage.metrics import (
    class_mean_gram,
    classification_metrics,
    gram_of_sums,
    gram_summary,
    unit_rows,
)
from local_damage.models import build_model
from local_damage.train import checkpoint as ckpt
from local_damage.train.config import Config
from local_damage.train.distributed import (
    DistInfo,
    all_reduce_sum,
    cleanup,
    gather_labels,
    gather_with_grad,
    init_distributed,
)
from local_damage.train.memory import peak_memory_mb, reset_peak

METRICS_CSV = "metrics.csv"
SUMMARY = "summary.json"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"train.device={name!r} but CUDA is not available on this machine")
    return device


def autocast_context(amp: str, device: torch.device):
    """The autocast context for ``train.amp`` on ``device`` (a null context when off)."""
    if amp == "off" or (amp == "auto" and device.type != "cuda"):
        return contextlib.nullcontext()
    if amp == "auto":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    else:
        dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


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
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
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


def set_encoder_trainable(model: torch.nn.Module, trainable: bool) -> None:
    for p in model.encoder.parameters():
        p.requires_grad_(trainable)


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


def train(
    cfg: Config,
    chips: str | Path,
    out: str | Path,
    fold: int | None = None,
    init: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    holdout: int | None = None,
    ids: tuple[list[str], list[str]] | None = None,
) -> dict[str, Any]:
    """Train a model on a chip store and write the run folder ``out``.

    Args:
        cfg: the resolved config (saved as ``out/config.yaml``).
        chips: chip store folder (manifest.csv; splits.csv when ``fold`` is given).
        out: run folder.
        fold: hold out this fold of splits.csv for validation; None trains on every labelled chip
            without validation (the last epoch's weights become ``best.safetensors``).
        holdout: a fold of splits.csv never used, neither for training nor for validation: the
            test tiles of a model whose figures must not be tuned on (``evaluate --fold``).
        init: start from the weights of a run folder or .safetensors file (fine-tuning).
        resume: continue from ``out``'s last checkpoint exactly (same config, optimiser, RNG).
        ids: ``(train_ids, val_ids)`` chip ids chosen by the caller instead of ``fold`` and
            ``holdout`` (e.g. the other events of a leave-one-event-out comparison); an empty
            ``val_ids`` trains without validation.

    Returns:
        The run summary (also written to ``out/summary.json``).
    """
    from tqdm import tqdm

    out = Path(out)
    device = resolve_device(cfg.train.device)
    dist_info: DistInfo = init_distributed(device.type)
    if dist_info.enabled and device.type == "cuda":
        device = torch.device("cuda", dist_info.local_rank)
        torch.cuda.set_device(device)
    seed_everything(cfg.train.seed, cfg.train.deterministic)

    # Data: training and validation chip ids, labelled chips only.
    if ids is not None:
        if fold is not None or holdout is not None:
            raise ValueError("give chip ids or a fold/holdout of splits.csv, not both")
        train_ids, val_ids = list(ids[0]), list(ids[1])
    elif fold is not None or holdout is not None:
        from data_prep.split import fold_indices

        train_ids, val_ids = fold_indices(chips, fold, holdout)
    else:
        from data_prep.store import read_manifest

        train_ids, val_ids = read_manifest(chips)["chip_id"].tolist(), []
    size = cfg.data.input_size
    train_ds = ChipPairDataset(
        chips, train_ids, size, augment=cfg.data.augment, seed=cfg.train.seed
    )
    keep = np.flatnonzero(train_ds.labels >= 0)
    if len(keep) < len(train_ds):
        train_ds = ChipPairDataset(
            chips,
            [train_ds.records[i]["chip_id"] for i in keep],
            size,
            augment=cfg.data.augment,
            seed=cfg.train.seed,
        )
    if len(train_ds) < cfg.train.batch_size:
        raise ValueError(
            f"{chips}: only {len(train_ds)} labelled training chips, fewer than one batch of {cfg.train.batch_size}"
        )
    num_classes = cfg.model.num_classes
    if cfg.data.balanced_sampling:
        per_replica = len(train_ds) // dist_info.world_size
        sampler = balanced_sampler(train_ds.labels, num_classes, cfg.train.seed, per_replica)
    elif dist_info.enabled:
        sampler = torch.utils.data.DistributedSampler(
            train_ds, dist_info.world_size, dist_info.rank, shuffle=True, seed=cfg.train.seed
        )
    else:
        sampler = torch.utils.data.RandomSampler(
            train_ds, generator=torch.Generator().manual_seed(cfg.train.seed)
        )
    loader_kw = {
        "num_workers": cfg.data.num_workers,
        "persistent_workers": cfg.data.num_workers > 0,
        "pin_memory": device.type == "cuda",
    }
    train_loader = DataLoader(
        train_ds, batch_size=cfg.train.batch_size, sampler=sampler, drop_last=True, **loader_kw
    )
    val_loader = None
    if val_ids:
        val_ds = ChipPairDataset(chips, val_ids, size, augment=False)
        keep = [r["chip_id"] for r in val_ds.records if int(r["label"]) >= 0]
        val_ds = ChipPairDataset(chips, keep, size, augment=False)
        val_loader = DataLoader(
            val_ds, batch_size=cfg.train.eval_batch_size, shuffle=False, **loader_kw
        )

    # Model, objective, optimiser.
    model_cfg = model_config_for(cfg)
    model = build_model(model_cfg).to(device)
    if init is not None:
        missing, unexpected = ckpt.load_weights(model, ckpt.resolve_weights(init), strict=False)
        if unexpected or missing:
            print(
                f"init from {init}: {len(missing)} missing, {len(unexpected)} unexpected weight(s)"
            )
    counts = class_counts(train_ds.labels, num_classes)
    if cfg.data.balanced_sampling:
        # Every present class is drawn equally often, so the batches already carry the
        # reciprocal-frequency weighting; weighting the loss as well would correct twice.
        counts = (counts > 0).astype(np.int64)
    weights = class_weights(counts, num_classes, counts=True)
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

    start_epoch, best_score, best_epoch, stale = 0, -1.0, -1, 0
    if resume:
        state = ckpt.load_training_state(out, model)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"])
        start_epoch, best_score, best_epoch, stale = (
            state["epoch"] + 1,
            state["best_score"],
            state["best_epoch"],
            state["stale"],
        )
    elif dist_info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_yaml(cfg, out / "config.yaml")
        (out / METRICS_CSV).unlink(missing_ok=True)

    writer = _tensorboard_writer(out) if dist_info.is_main else None
    fields = [
        "epoch",
        "alpha",
        "lr",
        "train_loss",
        "wce",
        "contrastive_z",
        "contrastive_l",
        "val_accuracy",
        "val_macro_f1",
        "train_max_abs_cos",
        "train_mean_offdiag_cos",
        "val_max_abs_cos",
        "val_mean_offdiag_cos",
        "pairs_per_s",
        "peak_memory_mb",
        "seconds",
    ]
    for epoch in range(start_epoch, cfg.train.epochs):
        alpha = cfg.loss.alpha(epoch, cfg.train.epochs)
        set_encoder_trainable(model, epoch >= cfg.train.freeze_encoder_epochs)
        train_ds.set_epoch(epoch)
        if isinstance(sampler, torch.utils.data.DistributedSampler):
            sampler.set_epoch(epoch)
        else:  # the epoch's draw depends on (seed, epoch) only, so --resume repeats it exactly
            sampler.generator.manual_seed(
                cfg.train.seed * 1_000_003 + epoch * 1009 + dist_info.rank
            )
        ddp_model.train()
        if epoch < cfg.train.freeze_encoder_epochs:
            model.encoder.eval()  # frozen means batch-norm statistics too
        reset_peak(device)
        sums: dict[str, float] = {}
        # Per-class sums of this replica's normalised z as the loss saw them (augmented, the
        # weights moving during the epoch): the class-mean geometry of the training embeddings.
        z_sums = None
        steps, t0 = 0, time.perf_counter()
        total_steps = (
            len(train_loader)
            if not cfg.train.max_steps_per_epoch
            else min(len(train_loader), cfg.train.max_steps_per_epoch)
        )
        bar = tqdm(
            total=total_steps,
            desc=f"epoch {epoch + 1}/{cfg.train.epochs}",
            disable=not (progress and dist_info.is_main),
            unit="step",
            leave=False,
        )
        for pre, post, y in train_loader:
            if steps >= total_steps:
                break
            pre, post, y = (
                normalize(pre.to(device, non_blocking=True)),
                normalize(post.to(device, non_blocking=True)),
                y.to(device),
            )
            with autocast_context(cfg.train.amp, device):
                output = ddp_model(pre, post)
            z = gather_with_grad(
                (output.z if cfg.loss.normalize_z else output.z_raw).float(), dist_info
            )
            lat = gather_with_grad(output.l.float(), dist_info) if output.l is not None else None
            loss, parts = objective(
                output.logits.float(),
                y,
                z=z,
                l=lat,
                alpha=alpha,
                contrastive_labels=gather_labels(y, dist_info),
            )
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if cfg.optim.grad_clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            steps += 1
            z_batch = output.z.detach().double()  # summed where it lives: no copy per step
            if z_sums is None:
                z_sums = z_batch.new_zeros(num_classes, z_batch.shape[1])
            z_sums.index_add_(0, y, z_batch)
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            bar.set_postfix(
                loss=f"{sums['total'] / steps:.3f}",
                pairs_s=f"{steps * cfg.train.batch_size / (time.perf_counter() - t0):.1f}",
            )
            bar.update()
        bar.close()
        scheduler.step()
        seconds = time.perf_counter() - t0
        row = {
            "epoch": epoch,
            "alpha": round(alpha, 6),
            "lr": optimizer.param_groups[0]["lr"],
            "train_loss": sums.get("total", 0.0) / max(steps, 1),
            "wce": sums.get("wce", 0.0) / max(steps, 1),
            "contrastive_z": sums.get("contrastive_z", float("nan")) / max(steps, 1),
            "contrastive_l": sums.get("contrastive_l", float("nan")) / max(steps, 1),
            **(_geometry_fields("train", gram_of_sums(z_sums.cpu().numpy())[0]) if steps else {}),
            "pairs_per_s": steps * cfg.train.batch_size * dist_info.world_size / seconds,
            "peak_memory_mb": peak_memory_mb(device),
            "seconds": seconds,
        }
        improved = True
        if val_loader is not None and dist_info.is_main:
            ys, preds, val_z = predict_loader(model, val_loader, device, cfg.train.amp)
            metrics = classification_metrics(ys, preds, CLASS_NAMES[:num_classes])
            row["val_accuracy"], row["val_macro_f1"] = metrics["accuracy"], metrics["macro_f1"]
            unit, directed = unit_rows(val_z)  # z = 0 (no change seen) has no direction
            gram = class_mean_gram(unit[directed], ys[directed], num_classes)[0]
            row.update(_geometry_fields("val", gram))
            improved = metrics["macro_f1"] > best_score or cfg.train.keep == "last"
        score = row.get("val_macro_f1", float(epoch))
        if dist_info.is_main:
            if improved:
                best_score, best_epoch, stale = score, epoch, 0
                ckpt.save_weights(model, out / ckpt.BEST, metadata={"epoch": str(epoch)})
            else:
                stale += 1
            ckpt.save_training_state(
                out,
                model,
                {
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": ckpt.rng_state(),
                    "epoch": epoch,
                    "best_score": best_score,
                    "best_epoch": best_epoch,
                    "stale": stale,
                },
            )
            _append_csv(out / METRICS_CSV, fields, row)
            if writer is not None:
                for k, v in row.items():
                    if k != "epoch" and isinstance(v, int | float) and v == v:
                        writer.add_scalar(k, v, epoch)
            if progress:
                shown = ", ".join(
                    f"{k} {row[k]:.4g}"
                    for k in (
                        "train_loss",
                        "val_accuracy",
                        "val_macro_f1",
                        "pairs_per_s",
                        "peak_memory_mb",
                    )
                    if k in row
                )
                print(f"epoch {epoch + 1}/{cfg.train.epochs}: {shown}")
        if dist_info.enabled:  # every replica takes the same early-stopping decision
            stale = int(
                all_reduce_sum(torch.tensor([stale if dist_info.is_main else 0]), dist_info).item()
            )
        if val_loader is not None and cfg.train.patience and stale >= cfg.train.patience:
            if progress and dist_info.is_main:
                print(f"early stop: no better validation macro-F1 for {stale} epochs")
            break

    from data_prep.store import read_meta

    summary = {
        "chip_spec": read_meta(chips).get("spec"),
        "chips": str(chips),
        "events": sorted(set(train_ds.frame["event"])),
        "best_epoch": best_epoch,
        "best_val_macro_f1": best_score if val_loader is not None else None,
        "fold": fold,
        "holdout": holdout,
        "train_chips": len(train_ds),
        "val_chips": len(val_loader.dataset) if val_loader else 0,
        "class_weights": weights.tolist(),
        "config": to_dict(cfg),
        "world_size": dist_info.world_size,
        "device": str(device),
    }
    if dist_info.enabled:  # replicas must hold identical weights; record the evidence
        checksum = torch.tensor([float(sum(p.detach().double().sum() for p in model.parameters()))])
        gathered = [torch.zeros(1, dtype=checksum.dtype) for _ in range(dist_info.world_size)]
        torch.distributed.all_gather(gathered, checksum)
        summary["replica_checksums"] = [float(g.item()) for g in gathered]
    if dist_info.is_main:
        from data_prep.store import write_json

        write_json(out / SUMMARY, summary)
        _plot_curves(out)
    if writer is not None:
        writer.close()
    cleanup(dist_info)
    return summary


def _geometry_fields(prefix: str, gram: np.ndarray) -> dict[str, float]:
    """``PREFIX_max_abs_cos`` and ``PREFIX_mean_offdiag_cos`` of a class-mean Gram matrix."""
    return {f"{prefix}_{k}": v for k, v in gram_summary(gram).items()}


def _tensorboard_writer(run: Path):
    """A TensorBoard writer into RUN/tensorboard when tensorboard is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(run / "tensorboard"))


def _append_csv(path: Path, fields: list[str], row: dict[str, Any]) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow({k: row.get(k, "") for k in fields})


def _plot_curves(run: Path) -> None:
    """Training curves as RUN/curves.png: loss, validation metrics and class-mean geometry."""
    import pandas as pd
    from matplotlib.figure import Figure

    from data_prep.store import atomic_path

    df = pd.read_csv(run / METRICS_CSV)
    fig = Figure(figsize=(13, 3.5))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    for col in ("train_loss", "wce", "contrastive_z", "contrastive_l"):
        if col in df and df[col].notna().any():
            ax1.plot(df["epoch"] + 1, df[col], marker="o", label=col)
    ax1.set_xlabel("epoch")
    ax1.set_title("training loss")
    ax1.legend(fontsize=8)
    for col in ("val_accuracy", "val_macro_f1"):
        if col in df and df[col].notna().any():
            ax2.plot(df["epoch"] + 1, df[col], marker="o", label=col)
    ax2.set_xlabel("epoch")
    ax2.set_ylim(0, 1)
    ax2.set_title("validation")
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(fontsize=8)
    else:  # trained without validation (every chip, or --holdout alone)
        ax2.text(0.5, 0.5, "no validation fold", ha="center", va="center", transform=ax2.transAxes)
    for col, style in (
        ("train_max_abs_cos", "-"),
        ("train_mean_offdiag_cos", "--"),
        ("val_max_abs_cos", "-"),
        ("val_mean_offdiag_cos", "--"),
    ):
        if col in df and df[col].notna().any():
            ax3.plot(df["epoch"] + 1, df[col], style, marker=".", label=col)
    simplex = -1.0 / (len(CLASS_NAMES) - 1)  # SupCon's regular simplex over the grades
    if ax3.get_legend_handles_labels()[0]:
        ax3.axhline(0.0, color="grey", lw=0.8, label="OCL's orthogonal classes")
        ax3.axhline(simplex, color="grey", lw=0.8, ls=":", label=f"SCL's simplex ({simplex:.2f})")
    ax3.set_ylim(-1, 1)
    ax3.set_xlabel("epoch")
    ax3.set_title("class-mean cosines of z")
    if ax3.get_legend_handles_labels()[0]:
        ax3.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(run / "curves.png", suffix=".png") as tmp:
        fig.savefig(tmp, dpi=100, format="png")


def load_summary(run: str | Path) -> dict[str, Any]:
    return json.loads((Path(run) / SUMMARY).read_text())
