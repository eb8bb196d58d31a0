"""Running a localiser over whole tiles and scoring it: pixel precision / recall / F1.

Torch-free: the model is any function from uint8 ``[1, h, w, 3]`` (h, w multiples of 32) to
building probability ``[1, h, w]``, so the same code scores a PyTorch network during training and
an exported ONNX model (:func:`onnx_model`). The figures are xView2's localisation score: building
pixels predicted vs building pixels of the label polygons, counts pooled over all tiles.

Post-processing, as the runtime applies it: resize the image by the model's ``scale``, run it in
windows of ``tile_size``, bring the probabilities back to the image's size (bilinear), keep pixels
``>= threshold``, and drop 8-connected blobs smaller than ``min_area_px`` native pixels.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.masks import find_mask_tiles, fold_map, load_mask_tile, resize_image
from data_prep.xbd_tiles import roots_label
from runtime.contract import CPU_ONLY, open_session, read_metadata
from runtime.localize_errors import LocalizeError

Model = Callable[[np.ndarray], np.ndarray]


def predict_probability(
    model: Model, image: np.ndarray, scale: float = 1.0, tile_size: int = 512
) -> np.ndarray:
    """Building probability of every pixel of an image.

    Args:
        model: uint8 ``[1, h, w, 3]`` -> float ``[1, h, w]``; h, w multiples of 32.
        image: uint8 ``[H, W, 3]`` at native resolution.
        scale: the model's input scale (the image is resized by it first).
        tile_size: window side in model-input pixels; larger inputs are run window by window.

    Returns:
        float32 ``[H, W]`` probabilities at the image's own resolution.
    """
    import cv2

    height, width = image.shape[:2]
    small = np.ascontiguousarray(resize_image(image, scale))
    h, w = small.shape[:2]
    prob = np.zeros((h, w), np.float32)
    for r0 in range(0, h, tile_size):
        for c0 in range(0, w, tile_size):
            window = small[r0 : r0 + tile_size, c0 : c0 + tile_size]
            wh, ww = window.shape[:2]
            ph, pw = -wh % 32, -ww % 32
            if ph or pw:
                window = np.pad(window, ((0, ph), (0, pw), (0, 0)), mode="reflect")
            out = model(np.ascontiguousarray(window[None]))[0]
            prob[r0 : r0 + wh, c0 : c0 + ww] = out[:wh, :ww]
    if (h, w) != (height, width):
        prob = cv2.resize(prob, (width, height), interpolation=cv2.INTER_LINEAR)
    return prob


def remove_small_blobs(binary: np.ndarray, min_area: int) -> np.ndarray:
    """``binary`` (bool ``[H, W]``) without its 8-connected blobs of fewer than ``min_area`` px."""
    if min_area <= 1 or not binary.any():
        return binary
    import cv2

    count, labels, stats, _ = cv2.connectedComponentsWithStats(binary.astype(np.uint8), 8)
    keep = stats[:, cv2.CC_STAT_AREA] >= min_area
    keep[0] = False
    return keep[labels]


def building_mask(probability: np.ndarray, threshold: float, min_area: int = 0) -> np.ndarray:
    """Bool ``[H, W]``: pixels ``>= threshold``, blobs under ``min_area`` pixels removed."""
    return remove_small_blobs(probability >= threshold, min_area)


def pixel_counts(pred: np.ndarray, target: np.ndarray) -> tuple[int, int, int]:
    """``(tp, fp, fn)`` building pixels of a predicted vs a target mask (bool or 0/1)."""
    pred, target = pred.astype(bool), target.astype(bool)
    tp = int(np.count_nonzero(pred & target))
    return tp, int(np.count_nonzero(pred)) - tp, int(np.count_nonzero(target)) - tp


def scores(tp: int, fp: int, fn: int) -> dict[str, float]:
    """Precision, recall and F1 from pixel counts (0 where undefined)."""
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "tp": tp, "fp": fp, "fn": fn}


def choose_operating_point(
    probabilities: Sequence[np.ndarray],
    masks: Sequence[np.ndarray],
    thresholds: Sequence[float],
    min_areas: Sequence[int],
) -> dict[str, Any]:
    """The threshold and smallest blob with the highest pooled pixel F1 over some tiles.

    Returns:
        ``{threshold, min_area_px, precision, recall, f1, tp, fp, fn}``; ties go to the lower
        threshold and smaller blob.
    """
    best: dict[str, Any] | None = None
    for t in thresholds:
        for a in min_areas:
            counts = np.zeros(3, np.int64)
            for prob, mask in zip(probabilities, masks, strict=True):
                counts += pixel_counts(building_mask(prob, t, a), mask)
            s = scores(*map(int, counts))
            if best is None or s["f1"] > best["f1"] + 1e-12:
                best = {"threshold": float(t), "min_area_px": int(a), **s}
    assert best is not None, "empty threshold or blob grid"
    return best


def onnx_model(path: str | os.PathLike, threads: int | None = None):
    """``(model function, metadata)`` of an exported localiser run by ONNX Runtime on the CPU."""
    import onnx

    session = open_session(path, CPU_ONLY, threads)[0]
    meta = read_metadata(onnx.load(str(path), load_external_data=False))
    if meta.get("task") != "localize":
        raise LocalizeError(
            f"{path}: not a localiser model (metadata task is {meta.get('task')!r})"
        )

    def run(batch: np.ndarray) -> np.ndarray:
        return session.run(["building"], {"image": batch})[0]

    return run, meta


def evaluate_tiles(
    model: Model,
    tiles: Sequence,
    scale: float,
    tile_size: int,
    threshold: float,
    min_area: int,
) -> dict[str, Any]:
    """Pooled pixel precision / recall / F1 over tiles, per-tile figures and seconds per tile.

    Args:
        model: see :func:`predict_probability`.
        tiles: :class:`data_prep.masks.MaskTile` s (read at native resolution).
        scale, tile_size, threshold, min_area: the model's inference settings.
    """
    counts = np.zeros(3, np.int64)
    per_tile, seconds = [], []
    for tile in tiles:
        image, mask = load_mask_tile(tile, 1.0)
        t0 = time.perf_counter()
        pred = building_mask(
            predict_probability(model, image, scale, tile_size), threshold, min_area
        )
        seconds.append(time.perf_counter() - t0)
        c = pixel_counts(pred, mask)
        counts += c
        per_tile.append({"tile": tile.name, **scores(*c), "seconds": round(seconds[-1], 3)})
    return {
        **scores(*map(int, counts)),
        "tiles": [t.name for t in tiles],
        "per_tile": per_tile,
        "seconds_per_tile": float(np.median(seconds)) if seconds else None,
    }


def evaluate_model(
    model_path: str | os.PathLike,
    root: str | os.PathLike | Sequence[str | os.PathLike],
    fold: int,
    *,
    folds: int = 5,
    split_seed: int = 14,
    splits: str | os.PathLike | None = None,
    threads: int | None = None,
    out: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Score an exported localiser on the tiles of one fold (``local-damage localize evaluate``).

    Returns:
        The figures of :func:`evaluate_tiles` plus the fold, split and model; also written to
        ``out`` as JSON when given.
    """
    model, meta = onnx_model(model_path, threads=threads)
    tiles = find_mask_tiles(root)
    folds_of = fold_map(tiles, folds, split_seed, splits)
    chosen = [t for t in tiles if folds_of.get(t.name) == fold]
    if not chosen:
        raise LocalizeError(
            f"{roots_label(root)}: no tile in fold {fold} (folds: {sorted(set(folds_of.values()))})"
        )
    result = evaluate_tiles(
        model,
        chosen,
        float(meta["scale"]),
        int(meta["tile_size"]),
        float(meta["threshold"]),
        int(meta["min_area_px"]),
    )
    result = {
        "model": str(model_path),
        "fold": fold,
        "split": {"folds": folds, "by": "tile", "seed": split_seed, "splits": splits},
        "threshold": float(meta["threshold"]),
        "min_area_px": int(meta["min_area_px"]),
        **result,
    }
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def format_scores(result: Mapping[str, Any]) -> str:
    """One line: precision / recall / F1 over the tiles."""
    return (
        f"pixel precision {result['precision']:.4f}  recall {result['recall']:.4f}  "
        f"F1 {result['f1']:.4f}  over {len(result.get('tiles', []))} tile(s)"
    )
