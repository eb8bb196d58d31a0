"""Random crops of tiles and their building masks as training batches."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset


def build_transform(crop_size: int, augment: bool, seed: int):
    """albumentations pipeline: pad to the crop if needed, random crop, then flips, 90-degree
    rotations and mild brightness/contrast when ``augment``."""
    import albumentations as A
    import cv2

    steps = [
        A.PadIfNeeded(crop_size, crop_size, border_mode=cv2.BORDER_CONSTANT, fill=0, fill_mask=0),
        A.RandomCrop(crop_size, crop_size),
    ]
    if augment:
        steps += [
            A.HorizontalFlip(p=0.5),
            A.VerticalFlip(p=0.5),
            A.RandomRotate90(p=0.5),
            A.RandomBrightnessContrast(brightness_limit=0.1, contrast_limit=0.1, p=0.5),
        ]
    return A.Compose(steps, seed=seed)


class TileCrops(Dataset):
    """``crops_per_tile`` random crops of each tile per epoch.

    Args:
        images: uint8 ``[H, W, 3]`` per tile (already resized to the training scale).
        masks: uint8 ``[H, W]`` building masks of the same tiles.
        crop_size: crop side in pixels.
        crops_per_tile: crops drawn from each tile per epoch.
        augment: see :func:`build_transform`.
        seed: seed of the crops and augmentation.

    Items are ``(image uint8 [crop, crop, 3], mask float32 [crop, crop])``.
    """

    def __init__(
        self,
        images: Sequence[np.ndarray],
        masks: Sequence[np.ndarray],
        crop_size: int,
        crops_per_tile: int,
        augment: bool = True,
        seed: int = 0,
    ) -> None:
        if len(images) != len(masks) or not images:
            raise ValueError("TileCrops needs one mask per image and at least one tile")
        self.images, self.masks = list(images), list(masks)
        self.crops_per_tile = int(crops_per_tile)
        self.transform = build_transform(crop_size, augment, seed)

    def __len__(self) -> int:
        return len(self.images) * self.crops_per_tile

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = index % len(self.images)
        out = self.transform(image=self.images[k], mask=self.masks[k])
        image = torch.from_numpy(np.ascontiguousarray(out["image"]))
        mask = torch.from_numpy(np.ascontiguousarray(out["mask"])).float()
        return image, mask
