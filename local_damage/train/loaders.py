"""The training and validation loaders of a chip store: which chips, in which order.

Training reads the labelled chips of its ids, augmented; the sampler draws them uniformly, or each
class equally often with ``data.balanced_sampling`` (split over the replicas under torchrun), and
an epoch's draw depends on (seed, epoch, rank) only, so ``--resume`` repeats it exactly.
Validation reads the labelled chips of its ids in order, without augmentation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler

from data_prep.split import fold_indices
from data_prep.store import read_manifest
from local_damage.data import ChipPairDataset, balanced_sampler
from local_damage.train.config import Config
from local_damage.train.distributed import DistInfo
from local_damage.train.errors import TrainingError


@dataclass
class Loaders:
    """The training loader (its dataset a :class:`ChipPairDataset`) and the validation loader,
    None without validation chips."""

    train: DataLoader
    val: DataLoader | None


@dataclass(frozen=True)
class ChipSplit:
    """Which chips of a store a run trains on and validates on.

    With nothing set, every labelled chip of the manifest trains and there is no validation
    (the last epoch's weights become ``best.safetensors``).

    Attributes:
        fold: validate on this fold of splits.csv and train on the others.
        holdout: a fold of splits.csv never used, neither for training nor for validation: the
            test tiles of a model whose figures must not be tuned on (``evaluate --fold``).
        ids: ``(train_ids, val_ids)`` chip ids chosen by the caller instead of ``fold`` and
            ``holdout`` (e.g. the other events of a leave-one-event-out comparison); an empty
            ``val_ids`` trains without validation.
    """

    fold: int | None = None
    holdout: int | None = None
    ids: tuple[Sequence[str], Sequence[str]] | None = None


def split_chip_ids(chips: str | Path, split: ChipSplit) -> tuple[list[str], list[str]]:
    """``(train_ids, val_ids)``: the caller's ``ids``, the folds of splits.csv, or every chip of
    the manifest without validation."""
    fold, holdout, ids = split.fold, split.holdout, split.ids
    if ids is not None:
        if fold is not None or holdout is not None:
            raise ValueError("give chip ids or a fold/holdout of splits.csv, not both")
        return list(ids[0]), list(ids[1])
    if fold is not None or holdout is not None:
        return fold_indices(chips, fold, holdout)
    return read_manifest(chips)["chip_id"].tolist(), []


def training_set(cfg: Config, chips: str | Path, chip_ids: list[str]) -> ChipPairDataset:
    """The labelled chips of ``chip_ids``, augmented as ``cfg.data`` says: at least one batch."""
    size, data = cfg.data.input_size, cfg.data
    options = dict(
        augment=data.augment, seed=cfg.train.seed, augment_strength=data.augment_strength
    )
    dataset = ChipPairDataset(chips, chip_ids, size, **options)
    keep = np.flatnonzero(dataset.labels >= 0)
    if len(keep) < len(dataset):
        dataset = ChipPairDataset(chips, list(dataset.chip_ids[keep]), size, **options)
    if len(dataset) < cfg.train.batch_size:
        raise TrainingError(
            f"{chips}: only {len(dataset)} labelled training chips, fewer than one batch of {cfg.train.batch_size}"
        )
    return dataset


def validation_set(chips: str | Path, chip_ids: list[str], input_size: int) -> ChipPairDataset:
    """The labelled chips of ``chip_ids``, not augmented, in their order."""
    dataset = ChipPairDataset(chips, chip_ids, input_size, augment=False)
    keep = list(dataset.chip_ids[dataset.labels >= 0])
    return ChipPairDataset(chips, keep, input_size, augment=False)


def training_sampler(cfg: Config, dataset: ChipPairDataset, dist_info: DistInfo) -> Sampler:
    """Balanced (with replacement), distributed or plain random order, seeded by the config."""
    if cfg.data.balanced_sampling:
        per_replica = len(dataset) // dist_info.world_size
        return balanced_sampler(dataset.labels, cfg.model.num_classes, cfg.train.seed, per_replica)
    if dist_info.enabled:
        return DistributedSampler(
            dataset, dist_info.world_size, dist_info.rank, shuffle=True, seed=cfg.train.seed
        )
    return RandomSampler(dataset, generator=torch.Generator().manual_seed(cfg.train.seed))


def one_thread_worker(_worker_id: int) -> None:
    """A loader worker's OpenCV on one thread: the workers are the parallelism, and each of N
    workers starting a thread per core (OpenCV's default) puts N times as many threads on the
    cores (PyTorch does the same for its own threads in a worker)."""
    import cv2

    cv2.setNumThreads(1)


def build_loaders(
    cfg: Config,
    chips: str | Path,
    train_ids: list[str],
    val_ids: list[str],
    dist_info: DistInfo,
    device: torch.device,
) -> Loaders:
    """The loaders of a run: training batches of ``train.batch_size`` (the last partial one
    dropped), validation batches of ``train.eval_batch_size``."""
    train_set = training_set(cfg, chips, train_ids)
    options = {
        "num_workers": cfg.data.num_workers,
        "persistent_workers": cfg.data.num_workers > 0,
        "pin_memory": device.type == "cuda",
        "worker_init_fn": one_thread_worker if cfg.data.num_workers > 0 else None,
    }
    train = DataLoader(
        train_set,
        batch_size=cfg.train.batch_size,
        sampler=training_sampler(cfg, train_set, dist_info),
        drop_last=True,
        **options,
    )
    val = None
    if val_ids:
        val_set = validation_set(chips, val_ids, cfg.data.input_size)
        val = DataLoader(val_set, batch_size=cfg.train.eval_batch_size, shuffle=False, **options)
    return Loaders(train, val)


def start_epoch(loader: DataLoader, epoch: int, seed: int, rank: int) -> None:
    """Set a training loader to ``epoch``: the augmentation seeds and the sampler's draw."""
    loader.dataset.set_epoch(epoch)
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        sampler.set_epoch(epoch)
    else:  # the epoch's draw depends on (seed, epoch) only, so --resume repeats it exactly
        sampler.generator.manual_seed(seed * 1_000_003 + epoch * 1009 + rank)
