"""xView2 scoring rasters of an xBD tile: building and damage targets drawn from its label polygons.

The challenge scorer (``xview2_metrics.py`` of https://github.com/DIUx-xView/xView2_scoring)
reads, per tile, a localisation target (0 background, 1 building) and a damage target (0
background, 1 no-damage, 2 minor-damage, 3 major-damage, 4 destroyed). The challenge shipped them
as PNGs without the code that drew them; here they are drawn from the post label's polygons
(``features.xy``, pixel WKT, x = column, y = row) the way the published solutions do (e.g.
``create_masks.py`` of https://github.com/vdurnov/xview2_1st_place_solution):

- every building polygon, whatever its subtype, is a building of the localisation target;
- its damage value is :data:`XVIEW2_VALUES` of ``properties.subtype``; ``un-classified``
  buildings (ones the annotators could not grade) take 1, as in that solution;
- polygons are burnt in file order, a later one winning where two overlap.

Polygons are burnt with :func:`rasterio.features.rasterize` (a pixel belongs to a polygon when its
centre lies inside), the rule the scoring outputs use (:func:`app.outputs.write_class_raster`) and
the localiser's masks (:mod:`data_prep.masks`); OpenCV's ``fillPoly`` on rounded vertices, which
those solutions use, also takes boundary pixels, so their masks are a little larger.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data_prep.spec import CLASS_NAMES, UNCLASSIFIED

#: xView2 damage value of each xBD subtype (0 is background).
XVIEW2_VALUES: dict[str, int] = {
    **{name: i + 1 for i, name in enumerate(CLASS_NAMES)},
    UNCLASSIFIED: 1,
}


@dataclass
class XView2Targets:
    """The scoring targets of one tile.

    Attributes:
        localization: uint8 [H, W], 1 on building pixels, 0 elsewhere.
        damage: uint8 [H, W], the building's xView2 damage value 1-4, 0 elsewhere.
        buildings: building polygons drawn.
        unclassified: how many of them were ``un-classified`` (drawn as 1).
        skipped: ``(uid, reason)`` of polygons that could not be drawn (invalid or empty WKT).
    """

    localization: np.ndarray
    damage: np.ndarray
    buildings: int = 0
    unclassified: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)


def rasterize_values(
    geometries: Sequence, values: Sequence[int], shape: tuple[int, int]
) -> np.ndarray:
    """Burn pixel-coordinate polygons into a uint8 [H, W] raster, 0 where none lies.

    Args:
        geometries: shapely polygons in pixel coordinates (x = column, y = row); None entries
            are left out.
        values: value 1-255 of each polygon.
        shape: ``(height, width)``.

    Returns:
        uint8 [H, W]: the value of the last polygon whose interior holds the pixel's centre.
    """
    from rasterio.features import rasterize

    height, width = int(shape[0]), int(shape[1])
    pairs = [(g, int(v)) for g, v in zip(geometries, values, strict=True) if g is not None]
    pairs = [(g, v) for g, v in pairs if not g.is_empty]
    if not pairs:
        return np.zeros((height, width), np.uint8)
    return rasterize(pairs, out_shape=(height, width), fill=0, dtype="uint8")


def xview2_targets(label: str | os.PathLike, shape: tuple[int, int]) -> XView2Targets:
    """Localisation and damage targets of an xBD post-disaster label file.

    Args:
        label: the tile's ``*_post_disaster.json`` (``features.xy`` polygons with a damage
            ``subtype``).
        shape: ``(height, width)`` of the tile's image.

    Returns:
        The targets (see :class:`XView2Targets`).

    Raises:
        ValueError: naming the file, when it is not an xBD label file, or a building has no
            damage subtype (a pre-disaster label) or an unknown one.
    """
    import shapely

    path = Path(label)
    try:
        data = json.loads(path.read_bytes())
        xy = data["features"]["xy"]
        if not isinstance(xy, list):
            raise TypeError("features.xy is not a list")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not an xBD label file with features.xy ({exc})") from exc
    uids, wkts, values = [], [], []
    unclassified = 0
    for i, feature in enumerate(xy):
        props = (feature.get("properties") if isinstance(feature, dict) else None) or {}
        if props.get("feature_type", "building") != "building":
            continue
        uid = str(props.get("uid") or f"#{i}")
        subtype = str(props.get("subtype") or "").strip().lower()
        if subtype not in XVIEW2_VALUES:
            what = f"damage subtype {subtype!r}" if subtype else "no damage subtype"
            raise ValueError(
                f"{path}: building {uid} has {what}; targets need a post-disaster label with "
                f"one of {', '.join(XVIEW2_VALUES)}"
            )
        unclassified += subtype == UNCLASSIFIED
        wkt = feature.get("wkt")
        uids.append(uid)
        wkts.append(wkt if isinstance(wkt, str) else None)
        values.append(XVIEW2_VALUES[subtype])
    geoms = shapely.from_wkt(np.array(wkts, dtype=object), on_invalid="ignore") if wkts else []
    skipped = [
        (uid, "invalid or empty polygon WKT")
        for uid, g in zip(uids, geoms, strict=True)
        if g is None or g.is_empty
    ]
    damage = rasterize_values(list(geoms), values, shape)
    return XView2Targets(
        localization=(damage > 0).astype(np.uint8),
        damage=damage,
        buildings=len(uids) - len(skipped),
        unclassified=unclassified,
        skipped=skipped,
    )
