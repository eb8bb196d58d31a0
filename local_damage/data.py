"""Chip pairs from a chip store as training batches: dataset, augmentation and sampling.

Augmentation (albumentations) applies the same geometry (flips, 90-degree rotations, small
affine scale/rotation) to pre and post, so the pair stays aligned, while photometric changes
(brightness, contrast, hue, blur, noise) are drawn independently for each image, as two
acquisitions differ in light and sensor. Every sample is resized to the model's input size with
the resampler serving uses (:func:`data_prep.windows.resize_chip`).
Images stay uint8 until they reach the model (see :func:`normalize`), which keeps loader
memory and inter-process traffic small.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, WeightedRandomSampler

from data_prep.store import ChipReader, read_manifest
from data_prep.windows import resize_chip

#: Per-channel mean and std (0-255 scale) used to normalise RGB chips inside the model graph.
MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)


def normalize(x: torch.Tensor) -> torch.Tensor:
    """uint8 (or float 0-255) [B, 3, H, W] to the model's normalised float input."""
    mean = torch.tensor(MEAN, device=x.device, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=x.device, dtype=torch.float32).view(1, 3, 1, 1)
    return (x.float() - mean) / std


#: Augmentation strengths (``data.augment_strength``).
STRENGTHS = ("light", "strong")


def build_transforms(augment: bool, strength: str = "light"):
    """(paired geometric transform, per-image photometric transform), or (None, None).

    ``"light"`` is the bundled model's augmentation. ``"strong"`` is the domain randomisation a
    new sensor, season or event calls for: any rotation (overhead imagery has no up), scale
    0.75-1.33 and a small shift on the pair; and on each image independently, stronger
    brightness/contrast, gamma, hue/saturation and per-channel colour casts, blur or sharpening,
    sensor noise, JPEG artefacts and a coarser ground sampling distance (downscale), so that
    what differs between two acquisitions is not read as change.

    Resizing to the input size is not part of these: it is done with
    :func:`data_prep.windows.resize_chip`, the resampler serving uses, after the geometric step.
    """
    if not augment:
        return None, None
    if strength not in STRENGTHS:
        raise ValueError(f"data.augment_strength must be one of {STRENGTHS}, got {strength!r}")
    import albumentations as A
    import cv2

    if strength == "strong":
        return _strong_transforms(A, cv2)

    geometric = A.Compose(
        [
            A.HorizontalFlip(p=0.5),
            A.VerticalFlip(p=0.5),
            A.RandomRotate90(p=0.5),
            A.Affine(
                scale=(0.9, 1.1), rotate=(-15, 15), border_mode=cv2.BORDER_CONSTANT, fill=0, p=0.5
            ),
        ],
        additional_targets={"post": "image"},
    )
    photometric = A.Compose(
        [
            A.RandomBrightnessContrast(brightness_limit=0.15, contrast_limit=0.15, p=0.5),
            A.HueSaturationValue(hue_shift_limit=5, sat_shift_limit=10, val_shift_limit=5, p=0.3),
            A.GaussianBlur(blur_limit=(3, 3), p=0.1),
        ]
    )
    return geometric, photometric


def _strong_transforms(A, cv2):
    geometric = A.Compose(
        [
            A.HorizontalFlip(p=0.5),
            A.VerticalFlip(p=0.5),
            A.RandomRotate90(p=0.5),
            A.Affine(
                scale=(0.75, 1.33),
                rotate=(-45, 45),
                translate_percent=(-0.06, 0.06),
                border_mode=cv2.BORDER_REFLECT_101,
                p=0.7,
            ),
        ],
        additional_targets={"post": "image"},
    )
    photometric = A.Compose(
        [
            A.RandomBrightnessContrast(brightness_limit=0.3, contrast_limit=0.3, p=0.8),
            A.RandomGamma(gamma_limit=(70, 140), p=0.3),
            A.HueSaturationValue(hue_shift_limit=10, sat_shift_limit=30, val_shift_limit=15, p=0.5),
            A.RGBShift(r_shift_limit=15, g_shift_limit=15, b_shift_limit=15, p=0.3),
            A.OneOf([A.GaussianBlur(blur_limit=(3, 5)), A.Sharpen(alpha=(0.1, 0.3))], p=0.3),
            A.GaussNoise(std_range=(0.01, 0.05), p=0.2),
            A.Downscale(scale_range=(0.5, 0.9), p=0.2),
            A.ImageCompression(quality_range=(50, 95), p=0.2),
        ]
    )
    return geometric, photometric


class ChipPairDataset(Dataset):
    """Pre/post chip pairs of a chip store.

    Each item is ``(pre, post, label)``: uint8 tensors [3, S, S] at ``input_size`` and the int
    label (-1 when unlabelled). Augmentation is seeded per (seed, epoch, index), so a run is
    reproducible whatever the number of loader workers; call :meth:`set_epoch` each epoch.
    """

    def __init__(
        self,
        chips: str | Path,
        chip_ids: Sequence[str] | None = None,
        input_size: int = 128,
        augment: bool = False,
        seed: int = 0,
        augment_strength: str = "light",
    ):
        self.root = Path(chips)
        frame = read_manifest(self.root)
        if chip_ids is not None:
            wanted = set(chip_ids)
            missing = wanted - set(frame["chip_id"])
            if missing:
                raise KeyError(
                    f"{self.root}: {len(missing)} chip id(s) not in the manifest, e.g. {sorted(missing)[:3]}"
                )
            frame = frame[frame["chip_id"].isin(wanted)]
        self.frame = frame.reset_index(drop=True)
        # per chip only numbers: loader workers share them with the training process without
        # copying (a list of row dicts is copied page by page into every worker as it is read)
        self.chip_ids = self.frame["chip_id"].to_numpy(dtype=object)
        self.labels = self.frame["label"].to_numpy(dtype=np.int64)
        n = len(self.frame)
        names = np.concatenate(
            [self.frame["pre_file"].to_numpy(str), self.frame["post_file"].to_numpy(str)]
        )
        files, codes = np.unique(names, return_inverse=True)
        self._files = [str(f) for f in files]
        self._pre = codes[:n].astype(np.int32)
        self._post = codes[n:].astype(np.int32)
        self._index = self.frame["index"].to_numpy(dtype=np.int64)
        self.input_size = int(input_size)
        self.augment = bool(augment)
        self.seed = int(seed)
        # in shared memory: a loader's persistent workers hold copies of this dataset made when
        # they started, and read the epoch that set_epoch writes here later
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._reader: ChipReader | None = None
        self.geometric, self.photometric = build_transforms(self.augment, augment_strength)

    @property
    def epoch(self) -> int:
        return int(self._epoch[0])

    def set_epoch(self, epoch: int) -> None:
        self._epoch[0] = int(epoch)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        if self._reader is None:  # opened lazily, once per loader worker
            self._reader = ChipReader(self.root)
        files = self._files
        pre, post = self._reader.read(
            files[self._pre[index]], files[self._post[index]], int(self._index[index])
        )
        if self.augment:
            sample_seed = (self.seed * 1_000_003 + self.epoch * 100_003 + index) % (2**31)
            self.geometric.set_random_seed(sample_seed)
            out = self.geometric(image=pre, post=post)
            pre, post = out["image"], out["post"]
        pre, post = resize_chip(pre, self.input_size), resize_chip(post, self.input_size)
        if self.augment:
            self.photometric.set_random_seed(sample_seed + 1)
            pre = self.photometric(image=pre)["image"]
            self.photometric.set_random_seed(sample_seed + 2)
            post = self.photometric(image=post)["image"]
        to_chw = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))  # noqa: E731
        return to_chw(pre), to_chw(post), int(self.labels[index])


def class_counts(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Number of samples per class (labels < 0 ignored)."""
    labels = np.asarray(labels)
    return np.bincount(labels[labels >= 0], minlength=num_classes)[:num_classes]


def balanced_sampler(
    labels: np.ndarray, num_classes: int, seed: int, num_samples: int | None = None
) -> WeightedRandomSampler:
    """A sampler drawing each class equally often (with replacement), seeded."""
    labels = np.asarray(labels)
    counts = class_counts(labels, num_classes).astype(np.float64)
    per_class = np.where(counts > 0, 1.0 / np.maximum(counts, 1), 0.0)
    weights = np.where(labels >= 0, per_class[np.clip(labels, 0, num_classes - 1)], 0.0)
    generator = torch.Generator().manual_seed(int(seed))
    return WeightedRandomSampler(
        torch.as_tensor(weights, dtype=torch.double),
        num_samples or len(labels),
        replacement=True,
        generator=generator,
    )
