"""Assessing one chip pair for the web app's chip mode: class probabilities and a heatmap of
the latent feature-correlation map over the post chip, for models exported with ``--change-map``.

Plain functions, no Gradio (:mod:`app.web.app` lays them out as the "Chip" tab and the HTTP API
endpoint ``assess_chip``); the tile mode is :mod:`app.web.assess`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from app.web.assess import DISPLAY_SIZE, app_max_pixels, check_image, short_message
from app.web.sessions import AppError
from data_prep.imagery import ImageError, read_rgb_pair

if TYPE_CHECKING:
    from runtime.predictor import Predictor


@dataclass
class ChipResult:
    """What assessing one chip pair produced.

    Attributes:
        probabilities: class name -> probability (sums to 1).
        damage: the most probable class.
        heatmap: uint8 ``[DISPLAY_SIZE, DISPLAY_SIZE, 3]``: the post chip with the latent
            correlation map (absolute value, scaled to its maximum) blended over it in the
            ``jet`` colour map; the post chip alone when the model has no change map.
        change_map: ``[S_L, S_L]`` float32 raw map, None when the model does not output it.
    """

    probabilities: dict[str, float]
    damage: str
    heatmap: np.ndarray
    change_map: np.ndarray | None


def read_chip_pair(
    pre: str | os.PathLike, post: str | os.PathLike, max_pixels: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Read a pre/post chip pair into uint8 ``[S, S, 3]`` arrays (one radiometric rule for both,
    :func:`data_prep.imagery.read_rgb_pair`).

    Raises:
        AppError: not an image, too large, truncated, not square, or pre and post of different
            sizes.
    """
    limit = app_max_pixels(max_pixels)
    sizes = [check_image(pre, "pre chip", limit), check_image(post, "post chip", limit)]
    if sizes[0] != sizes[1]:
        raise AppError(
            f"pre chip {Path(pre).name} is {sizes[0][0]}x{sizes[0][1]} px but post chip "
            f"{Path(post).name} is {sizes[1][0]}x{sizes[1][1]} px; a chip pair must be the same "
            "window of both images"
        )
    if sizes[0][0] != sizes[0][1]:
        raise AppError(
            f"pre chip {Path(pre).name} is {sizes[0][0]}x{sizes[0][1]} px; chips are square "
            "(cut by `local-damage prepare`); use tile mode for whole tiles"
        )
    try:
        pre_rgb, post_rgb, _ = read_rgb_pair(pre, post, limit)
        return pre_rgb, post_rgb
    except ImageError as exc:
        raise AppError(short_message(str(exc))) from exc


def heatmap_overlay(post: np.ndarray, change_map: np.ndarray | None, size: int = DISPLAY_SIZE):
    """The post chip at ``size`` px with ``|change_map|`` (``[S_L, S_L]``) blended over it.

    Returns:
        uint8 ``[size, size, 3]`` RGB; 55% chip, 45% ``jet`` colours (red = most change).
    """
    import cv2

    base = cv2.resize(post, (size, size), interpolation=cv2.INTER_LINEAR)
    if change_map is None:
        return base
    heat = np.abs(np.asarray(change_map, dtype=np.float32))
    top = float(heat.max())
    heat = heat / top if top > 0 else heat
    heat = cv2.resize(heat, (size, size), interpolation=cv2.INTER_CUBIC)
    colours = cv2.applyColorMap(np.clip(heat * 255, 0, 255).astype(np.uint8), cv2.COLORMAP_JET)
    colours = cv2.cvtColor(colours, cv2.COLOR_BGR2RGB)
    return cv2.addWeighted(colours, 0.45, base, 0.55, 0.0)


def assess_chip(
    predictor: Predictor, pre: str | os.PathLike, post: str | os.PathLike
) -> ChipResult:
    """Grade one pre/post chip pair and draw where the model saw change.

    Args:
        predictor: the loaded ONNX model.
        pre, post: square chip images of equal size (PNG, JPEG or GeoTIFF).

    Returns:
        The :class:`ChipResult`.

    Raises:
        AppError: see :func:`read_chip_pair`.
    """
    a, b = read_chip_pair(pre, post)
    pred = predictor.predict(a[None], b[None], change_map=True)
    probs = pred.probabilities[0]
    change = None if pred.change_map is None else pred.change_map[0, 0]
    names = predictor.class_names
    return ChipResult(
        probabilities={n: float(p) for n, p in zip(names, probs, strict=True)},
        damage=names[int(np.argmax(probs))],
        heatmap=heatmap_overlay(b, change),
        change_map=change,
    )
