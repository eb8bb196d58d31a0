"""Random crops of unlabelled imagery for pretraining, and their augmented views.

Sources are every pre and post image of xBD folders (``ROOT/images/*_{pre,post}_disaster.*``)
and every GeoTIFF under raster folders (such as the Joplin and Puerto Rico tiles), read with
:func:`data_prep.imagery.read_rgb` (rasterio) as uint8 RGB. Labels are never read.

A :class:`CropPool` keeps a few decoded images in memory and cuts random square windows from
them, replacing one image every few batches, so memory stays bounded whatever the number of
sources while a batch still mixes several images. Two kinds of view pairs:

- ``"augment"`` (SimCLR): the same window twice, augmented independently;
- ``"prepost"``: the same window of an xBD tile's pre and post images (co-registered), each
  augmented: pre against post of the same place. Most windows show no damage, so this pulls an
  unchanged place's two dates together; GeoTIFF sources have no pairs and are not used.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.transforms import functional as TF

from data_prep.errors import LocalDamageError
from data_prep.imagery import read_rgb

log = logging.getLogger(__name__)

VIEW_MODES = ("augment", "prepost")
RASTER_SUFFIXES = (".tif", ".tiff")
#: Windows with more than this share of zero (no-data) pixels are drawn again.
MAX_EMPTY = 0.5


class PretrainError(LocalDamageError, ValueError):
    """Pretraining that cannot run as asked: a folder without images, no pairs for prepost, a bad setting."""


@dataclass(frozen=True)
class Source:
    """One image to crop from, and for xBD its co-registered other date (``pair``)."""

    path: Path
    pair: Path | None = None


def find_sources(
    xbd: list[str | os.PathLike], rasters: list[str | os.PathLike], views: str = "augment"
) -> list[Source]:
    """Every usable image: xBD pre and post images (each paired with the other date) and
    GeoTIFFs under ``rasters``; for ``views="prepost"`` the xBD pre images with their post.

    Raises:
        PretrainError: a folder holds no image, or no source is left for ``views``.
    """
    if views not in VIEW_MODES:
        raise PretrainError(f"unknown views {views!r}; expected one of {', '.join(VIEW_MODES)}")
    sources: list[Source] = []
    for root in map(Path, xbd):
        pres = sorted((root / "images").glob("*_pre_disaster.*"))
        if not pres:
            raise PretrainError(f"{root}: no images/*_pre_disaster.* (not an xBD folder)")
        for pre in pres:
            post = pre.with_name(pre.name.replace("_pre_disaster", "_post_disaster"))
            has_post = post.is_file()
            sources.append(Source(pre, post if has_post else None))
            if has_post and views == "augment":
                sources.append(Source(post, pre))
    for folder in map(Path, rasters):
        found = sorted(p for p in folder.rglob("*") if p.suffix.lower() in RASTER_SUFFIXES)
        if not found:
            raise PretrainError(f"{folder}: no GeoTIFF (*.tif, *.tiff) under it")
        if views == "augment":
            sources += [Source(p) for p in found]
    if views == "prepost":
        sources = [s for s in sources if s.pair is not None]
    if not sources:
        raise PretrainError(f"no image to pretrain on for views {views!r}")
    return sources


class CropPool:
    """Random ``crop x crop`` windows (uint8 ``[N, crop, crop, 3]``) from a pool of images.

    Args:
        sources: from :func:`find_sources`.
        crop: window side in source pixels.
        views: ``"augment"`` or ``"prepost"``.
        pool_size: images held decoded at once.
        refresh_every: batches between replacing one pooled image by a random source.
        seed: seed of every random choice.
    """

    def __init__(
        self,
        sources: list[Source],
        crop: int = 128,
        views: str = "augment",
        pool_size: int = 8,
        refresh_every: int = 4,
        seed: int = 0,
    ) -> None:
        if crop < 8:
            raise ValueError(f"crop must be at least 8 px, got {crop}")
        self.sources, self.crop, self.views = sources, crop, views
        self.refresh_every = max(1, refresh_every)
        self.rng = np.random.default_rng(seed)
        picks = self.rng.choice(len(sources), size=min(pool_size, len(sources)), replace=False)
        self.pool = [self._load(int(i)) for i in picks]
        self.batches = 0

    def _load(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        source = self.sources[index]
        image = read_rgb(source.path)
        other = read_rgb(source.pair) if self.views == "prepost" else None
        if other is not None and other.shape != image.shape:
            raise PretrainError(
                f"{source.path} and {source.pair}: pre and post differ in size "
                f"({image.shape[:2]} vs {other.shape[:2]}); prepost needs co-registered pairs"
            )
        if min(image.shape[:2]) < self.crop:
            raise PretrainError(
                f"{source.path}: {image.shape[1]}x{image.shape[0]} px, smaller than the "
                f"{self.crop} px crop; use a smaller --crop"
            )
        return image, other

    def _window(self, image: np.ndarray) -> tuple[int, int]:
        h, w = image.shape[:2]
        for _ in range(10):
            y = int(self.rng.integers(0, h - self.crop + 1))
            x = int(self.rng.integers(0, w - self.crop + 1))
            cut = image[y : y + self.crop, x : x + self.crop]
            if (cut.max(axis=2) == 0).mean() <= MAX_EMPTY:
                break
        return y, x

    def batch(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Two uint8 arrays ``[n, crop, crop, 3]``: row ``i`` of each is one view pair."""
        self.batches += 1
        if self.batches % self.refresh_every == 0 and len(self.sources) > len(self.pool):
            slot = int(self.rng.integers(len(self.pool)))
            self.pool[slot] = self._load(int(self.rng.integers(len(self.sources))))
        a, b = [], []
        for _ in range(n):
            image, other = self.pool[int(self.rng.integers(len(self.pool)))]
            y, x = self._window(image)
            a.append(image[y : y + self.crop, x : x + self.crop])
            second = other if other is not None else image
            b.append(second[y : y + self.crop, x : x + self.crop])
        return np.stack(a), np.stack(b)


#: How strongly :func:`augment` changes a view: ``light`` (crops of 0.4-1 of the area, brightness
#: and contrast +-30%), the augmentation of the recorded pretraining runs; ``simclr``, the strength
#: of SimCLR (Chen et al. 2020, appendix A), which its ablations found the contrastive task needs.
AUGMENT_STRENGTHS = ("light", "simclr")


def augment(
    crops: np.ndarray,
    size: int,
    generator: torch.Generator,
    min_scale: float | None = None,
    strength: str = "light",
) -> torch.Tensor:
    """Augmented views of uint8 crops ``[N, C, C, 3]`` as float ``[N, 3, size, size]`` (0-255).

    Per crop, ``light``: a random square sub-window of ``min_scale`` (0.4) to 1 of the area,
    resized to ``size`` (bilinear, antialiased); a random flip and quarter turn (overhead imagery
    has no up); brightness and contrast jitter of up to 30%; grey with probability 0.2.

    ``simclr``: a sub-window of 0.08 (``min_scale``) to 1 of the area with an aspect ratio of
    3/4 to 4/3, resized to ``size``; the flip and quarter turn; with probability 0.8 colour
    jitter of SimCLR's strength 1 (brightness, contrast and saturation by a factor of 0.2-1.8,
    hue turned by up to 0.2 of the circle; torchvision's functional colour adjustments); grey
    with probability 0.2; with probability 0.5 a Gaussian blur of sigma 0.1-2 (kernel a tenth of
    ``size``, odd; :func:`torchvision.transforms.functional.gaussian_blur`).
    """
    if strength not in AUGMENT_STRENGTHS:
        raise PretrainError(
            f"unknown augmentation {strength!r}; expected one of {', '.join(AUGMENT_STRENGTHS)}"
        )
    strong = strength == "simclr"
    if min_scale is None:
        min_scale = 0.08 if strong else 0.4
    x = torch.from_numpy(np.ascontiguousarray(crops)).permute(0, 3, 1, 2).float()
    out = []
    side = x.shape[-1]

    def u(lo: float, hi: float) -> float:
        return lo + (hi - lo) * float(torch.rand(1, generator=generator))

    for img in x:
        area = u(min_scale, 1.0)
        ratio = math.exp(u(math.log(3 / 4), math.log(4 / 3))) if strong else 1.0
        h = min(side, max(8, int(round(side * math.sqrt(area / ratio)))))
        w = min(side, max(8, int(round(side * math.sqrt(area * ratio)))))
        y0 = int(torch.randint(0, side - h + 1, (1,), generator=generator))
        x0 = int(torch.randint(0, side - w + 1, (1,), generator=generator))
        v = img[:, y0 : y0 + h, x0 : x0 + w][None]
        v = F.interpolate(v, size=(size, size), mode="bilinear", antialias=True)[0]
        if u(0, 1) < 0.5:
            v = v.flip(-1)
        v = torch.rot90(v, int(torch.randint(0, 4, (1,), generator=generator)), dims=(1, 2))
        if strong:
            if u(0, 1) < 0.8:
                v = _colour_jitter(v, u)
        else:
            mean = v.mean()
            v = (v - mean) * u(0.7, 1.3) + mean * u(0.7, 1.3)
        if u(0, 1) < 0.2:
            v = v.mean(dim=0, keepdim=True).expand(3, -1, -1)
        if strong and u(0, 1) < 0.5:
            k = max(3, (size // 10) | 1)
            v = TF.gaussian_blur(v[None], [k, k], [u(0.1, 2.0)] * 2)[0]
        out.append(v.clamp(0, 255))
    return torch.stack(out)


def _colour_jitter(v: torch.Tensor, u) -> torch.Tensor:
    """SimCLR's colour jitter of strength 1 (torchvision's ``ColorJitter(0.8, 0.8, 0.8, 0.2)``,
    the factors drawn from ``u``) on one float view ``[3, H, W]`` (0-255)."""
    v = v.clamp(0, 255) / 255.0
    v = TF.adjust_brightness(v, u(0.2, 1.8))
    v = TF.adjust_contrast(v, u(0.2, 1.8))
    v = TF.adjust_saturation(v, u(0.2, 1.8))
    v = TF.adjust_hue(v, u(-0.2, 0.2))
    return v * 255.0
