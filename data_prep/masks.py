"""Building masks of xBD tiles for the localiser: label polygons rasterised onto the pre image.

Every polygon of a tile's label file (``features.xy``, pixel WKT; buildings of any subtype,
un-classified ones included) is burnt into a uint8 mask, 1 inside a building and 0 elsewhere,
with :func:`rasterio.features.rasterize` (a pixel is inside when its centre is). The pre-disaster
label is used when present, else the post one: xBD draws the same polygons on both.

Masks can be rasterised at a scale other than the tile's own (``scale=0.5``: a 1024 px tile gives
a 512 px mask), by rasterising the same polygons on the coarser grid, which is what a model
trained on resized images sees.

Tiles are dealt to the cross-validation folds of the damage model: :func:`tile_folds` gives the
same tile -> fold mapping as ``local-damage split CHIPS --by tile`` on a store made by
``local-damage prepare xbd`` from the same tiles, so that a localiser and a damage model hold out
the same test tiles.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.errors import LocalDamageError
from data_prep.imagery import read_rgb
from data_prep.report import PrepareReport
from data_prep.split import stratified_group_folds
from data_prep.windows import outside_image
from data_prep.xbd_tiles import find_tiles, parse_buildings, roots_label


class MaskError(LocalDamageError, ValueError):
    """xBD tiles that cannot give the localiser its building masks; the message says why."""


@dataclass(frozen=True)
class MaskTile:
    """The files of one xBD tile used for localisation.

    Attributes:
        name: tile name (``<event>_<id>``).
        event: event name from the file name.
        image: the pre-disaster image.
        label: the label JSON whose polygons become the mask (pre label, else post).
        post_label: the post-disaster label (damage classes; used to reproduce the folds).
    """

    name: str
    event: str
    image: Path
    label: Path
    post_label: Path


def find_mask_tiles(root: str | os.PathLike | Sequence[str | os.PathLike]) -> list[MaskTile]:
    """Tiles below an xBD root that have a pre image and a label file, sorted by name.

    Raises:
        XbdRootError: the root does not exist or holds no xBD tiles.
        MaskError: no tile has both a pre image and a label file.
    """
    tiles, _ = find_tiles(root)
    out = []
    for t in tiles:
        if t.pre is None:
            continue
        pre_label = t.label.with_name(f"{t.name}_pre_disaster.json")
        label = pre_label if pre_label.is_file() else t.label
        if not label.is_file():
            continue
        out.append(MaskTile(t.name, t.event, Path(t.pre), label, t.label))
    if not out:
        raise MaskError(
            f"{roots_label(root)}: no tile has both a pre image "
            "(images/<tile>_pre_disaster.png) and a label file "
            "(labels/<tile>_pre_disaster.json or _post_disaster.json)"
        )
    return out


def building_polygons(label: str | os.PathLike) -> list:
    """Shapely polygons (pixel coordinates) of every building of an xBD label file.

    Raises:
        MaskError: naming the file, when it is not an xBD label file.
    """
    import shapely

    path = Path(label)
    try:
        data = json.loads(path.read_bytes())
        xy = data["features"]["xy"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MaskError(f"{path}: not an xBD label file with features.xy ({exc})") from exc
    wkts = [
        f.get("wkt")
        for f in xy
        if isinstance(f, dict)
        and isinstance(f.get("wkt"), str)
        and (f.get("properties") or {}).get("feature_type", "building") == "building"
    ]
    geoms = shapely.from_wkt(np.array(wkts, dtype=object), on_invalid="ignore")
    return [g for g in geoms if g is not None and not g.is_empty]


def largest_building_px(tiles: Sequence[MaskTile]) -> int | None:
    """The largest building footprint of ``tiles``' labels, in native pixels (rounded up); None
    when they hold no building. A localiser trained on them has never seen a larger building."""
    import shapely

    areas = [float(shapely.area(building_polygons(t.label)).max(initial=0.0)) for t in tiles]
    largest = max(areas, default=0.0)
    return math.ceil(largest) if largest > 0 else None


def rasterize_mask(polygons: Sequence, shape: tuple[int, int], scale: float = 1.0) -> np.ndarray:
    """Burn building polygons into a uint8 mask (1 = building).

    Args:
        polygons: shapely polygons in pixel coordinates of the full-resolution tile.
        shape: ``(height, width)`` of the mask, already scaled.
        scale: mask pixels per tile pixel (0.5: the mask is half the tile's size).

    Returns:
        uint8 ``[height, width]``; a pixel is 1 when its centre lies in a polygon.
    """
    from affine import Affine
    from rasterio.features import rasterize

    height, width = int(shape[0]), int(shape[1])
    if not polygons:
        return np.zeros((height, width), np.uint8)
    return rasterize(
        [(g, 1) for g in polygons],
        out_shape=(height, width),
        transform=Affine.scale(1.0 / scale),
        fill=0,
        dtype="uint8",
    )


def scaled_shape(shape: tuple[int, ...], scale: float) -> tuple[int, int]:
    """``(height, width)`` of an image of ``shape`` resized by ``scale`` (rounded, at least 1)."""
    return max(1, round(shape[0] * scale)), max(1, round(shape[1] * scale))


def resize_image(image: np.ndarray, scale: float) -> np.ndarray:
    """uint8 ``[H, W, 3]`` resized by ``scale`` (area averaging when shrinking, else bilinear)."""
    if scale == 1.0:
        return image
    import cv2

    height, width = scaled_shape(image.shape, scale)
    interp = cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR
    return cv2.resize(image, (width, height), interpolation=interp)


def load_mask_tile(tile: MaskTile, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The tile's pre image and building mask, both resized by ``scale``.

    Returns:
        ``(image uint8 [h, w, 3], mask uint8 [h, w])``.
    """
    image = read_rgb(tile.image)
    mask = rasterize_mask(
        building_polygons(tile.label), scaled_shape(image.shape, scale), scale=scale
    )
    return resize_image(image, scale), mask


def tile_folds(tiles: Sequence[MaskTile], folds: int = 5, seed: int = 14) -> dict[str, int]:
    """Fold of every tile, as ``local-damage split --by tile`` deals a chip store of the same tiles.

    The split is stratified by the damage classes of the buildings that ``prepare xbd`` keeps
    (post label, un-classified buildings excluded, polygons at least partly inside the tile), so
    the folds equal those of the damage model's store made from the same tiles.

    Args:
        tiles: the tiles (each needs its post label).
        folds: number of folds.
        seed: the split's seed (the damage model's default store uses 14).

    Returns:
        ``{tile name: fold}``; tiles without a gradable building get no fold (absent).
    """
    labels: list[int] = []
    groups: list[str] = []
    for t in tiles:
        if not t.post_label.is_file():
            continue
        import rasterio

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", rasterio.errors.NotGeoreferencedWarning)
            with rasterio.open(t.image) as src:
                width, height = src.width, src.height
        _, buildings = parse_buildings(t.post_label, PrepareReport())
        for b in buildings:
            if outside_image(b.bbox, height, width):
                continue
            labels.append(b.label)
            groups.append(t.name)
    if len(set(groups)) < folds:
        raise MaskError(
            f"{folds} folds need at least {folds} tiles with labelled buildings, "
            f"got {len(set(groups))}"
        )
    fold = stratified_group_folds(np.array(labels), np.array(groups), folds, seed)
    return {g: int(f) for g, f in zip(groups, fold, strict=True)}


def read_store_folds(splits_csv: str | os.PathLike) -> dict[str, int]:
    """``{tile: fold}`` from a chip store's ``splits.csv`` (to take folds from an existing store)."""
    import pandas as pd

    df = pd.read_csv(splits_csv, dtype={"tile": str}, keep_default_na=False)
    return {str(t): int(f) for t, f in df.groupby("tile")["fold"].first().items()}


def fold_map(
    tiles: Sequence[MaskTile],
    folds: int = 5,
    seed: int = 14,
    splits: str | os.PathLike | None = None,
) -> dict[str, int]:
    """``{tile: fold}``: from a store's ``splits.csv`` when given, else :func:`tile_folds`."""
    return read_store_folds(splits) if splits else tile_folds(tiles, folds, seed)
