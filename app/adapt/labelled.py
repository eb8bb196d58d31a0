"""Buildings of a new event, with or without analysts' labels, as chip pairs (no torch).

Three sources, each cut with the model's chip spec by the code the scoring path uses:

- :func:`from_chip_store`: a chip store of ``data_prep`` (``manifest.csv`` + shards), optionally
  one fold of its ``splits.csv`` and one event.
- :func:`from_scene` / :func:`from_xbd`: a labelled footprint file on georeferenced pre/post
  imagery (label in an attribute, as for ``prepare scene --label-field``), or an xBD label JSON
  (``subtype``) on its pixel-aligned image pair; the scene is aligned as ``score`` aligns it.
- the corrections the web app saves: :mod:`app.adapt.corrections`.

Every error names the file at fault and what is wrong (:class:`LabelError`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from app.scoring.common import bounded_gdal_cache
from data_prep.alignment import align_images, align_scene
from data_prep.errors import LocalDamageError, not_found
from data_prep.footprints import load_footprints
from data_prep.imagery import ImageError
from data_prep.mosaic import SceneError, open_scene
from data_prep.quality import blank_reason
from data_prep.report import PrepareReport
from data_prep.scene import CHIP, check_overlap, iter_building_chips, pixel_centroids
from data_prep.spec import ChipSpec
from data_prep.split import fold_indices
from data_prep.store import MANIFEST, ChipReader, read_manifest
from data_prep.windows import cut_building
from data_prep.xbd_tiles import parse_buildings, read_tile_pair

#: Manifest columns a chip store must have to give labelled chips.
STORE_COLUMNS = ("chip_id", "event", "label", "pre_file", "post_file", "index")


class LabelError(LocalDamageError, ValueError):
    """Labelled buildings that cannot be used; the message names the file and the problem."""


class BuildingRef(NamedTuple):
    """A building as its user knows it: the file it comes from, its own id there (the
    footprints' ``uid`` attribute when unique, else the feature id; an xBD label's ``uid``; a
    chip store's ``chip_id``) and its row (the position among the file's features, which is
    also the row of the scored output; None for a chip store)."""

    file: str
    id: str
    row: int | None


@dataclass
class Buildings:
    """``N`` buildings: ids, events, labels (-1 unlabelled) and their uint8 chip pairs.

    Attributes:
        ids: building ids (chip ids of a store; ``<scene>:<uid>`` otherwise).
        events: event name of each building.
        labels: int64 ``[N]`` class ids, -1 when unlabelled.
        pre, post: uint8 ``[N, S, S, 3]`` chips.
        sources: one line per input read.
        refs: each building as its user knows it (:class:`BuildingRef`); empty: its id only.
    """

    ids: list[str]
    events: list[str]
    labels: np.ndarray
    pre: np.ndarray
    post: np.ndarray
    sources: list[str] = field(default_factory=list)
    refs: list[BuildingRef] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def labelled(self) -> np.ndarray:
        return self.labels >= 0

    def ref(self, i: int) -> BuildingRef:
        """Building ``i`` as its user knows it."""
        return self.refs[i] if self.refs else BuildingRef("", self.ids[i], None)

    def subset(self, mask: np.ndarray) -> Buildings:
        idx = np.flatnonzero(mask)
        return Buildings(
            [self.ids[i] for i in idx],
            [self.events[i] for i in idx],
            self.labels[idx],
            self.pre[idx],
            self.post[idx],
            list(self.sources),
            [self.ref(i) for i in idx],
        )

    def tiles(self) -> list[str]:
        """The ``<tile>`` of each ``<tile>:<uid>`` id: a chip store's tile, an xBD tile, a
        scene (the groups of the heads' cross-validation, :func:`app.adapt.fit.adapt_head`)."""
        return [str(i).partition(":")[0] for i in self.ids]

    def groups(self) -> list[str]:
        """The group of each building in the heads' cross-validation: its tile
        (:meth:`tiles`), with the file it was read from when it has one (buildings read from
        footprints on a scene carry the event in their ids, so two scenes' files are two
        groups)."""
        tiles = self.tiles()
        if not self.refs:
            return tiles
        return [f"{t}|{r.file}" if r.file else t for t, r in zip(tiles, self.refs, strict=True)]

    def counts(self, class_names: Sequence[str]) -> dict[str, object]:
        """``n``, ``per_class``, ``events`` and ``tiles`` (the ``<tile>`` of each ``<tile>:<uid>``
        id: a chip store's tile, an xBD tile, a scene) of the labelled buildings, and
        ``sources``."""
        lab = self.labels[self.labelled]
        ev = [e for e, ok in zip(self.events, self.labelled, strict=True) if ok]
        tiles = [t for t, ok in zip(self.tiles(), self.labelled, strict=True) if ok]
        groups = {g for g, ok in zip(self.groups(), self.labelled, strict=True) if ok}
        return {
            "n": int(len(lab)),
            "per_class": {n: int(np.sum(lab == i)) for i, n in enumerate(class_names)},
            "events": dict(Counter(ev)),
            "tiles": sorted(set(tiles)),
            "groups": len(groups),
            "sources": list(self.sources),
        }


def concat(parts: Sequence[Buildings], size: int) -> Buildings:
    """One :class:`Buildings` of several (chips of side ``size`` when there are none)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        empty = np.zeros((0, size, size, 3), np.uint8)
        return Buildings([], [], np.zeros(0, np.int64), empty, empty.copy())
    return Buildings(
        [i for p in parts for i in p.ids],
        [e for p in parts for e in p.events],
        np.concatenate([p.labels for p in parts]).astype(np.int64),
        np.concatenate([p.pre for p in parts]),
        np.concatenate([p.post for p in parts]),
        [s for p in parts for s in p.sources],
        [p.ref(i) for p in parts for i in range(len(p))],
    )


def _stack(chips: list[np.ndarray], size: int) -> np.ndarray:
    return np.stack(chips) if chips else np.zeros((0, size, size, 3), np.uint8)


def class_id(value: object, class_names: Sequence[str], where: str) -> int | None:
    """The class id of a label given as a class name or an id; None when empty.

    Raises:
        LabelError: naming ``where`` for a value that is not one of ``class_names``.
    """
    if value is None or (isinstance(value, float) and value != value):
        return None
    text = str(value).strip().lower()
    if text in ("", "none", "nan", "un-classified"):
        return None
    names = [n.lower() for n in class_names]
    if text in names:
        return names.index(text)
    if text.lstrip("-").isdigit() and 0 <= int(text) < len(names):
        return int(text)
    raise LabelError(
        f"{where}: unknown class {value!r}; the model's classes are {', '.join(class_names)} "
        f"(or 0-{len(class_names) - 1})"
    )


# --------------------------------------------------------------------------------------------
# chip store


def from_chip_store(
    chips: str | os.PathLike,
    class_names: Sequence[str],
    fold: int | None = None,
    event: str | None = None,
) -> Buildings:
    """Every building of a chip store (or of fold ``fold`` of its splits, of event ``event``).

    Raises:
        LabelError: no store, a manifest missing a column, a fold or event the store does not
            have, a label that is not a class of the model.
    """
    import csv

    root = Path(chips)
    path = root / MANIFEST
    if not path.is_file():
        raise LabelError(f"{path}: no manifest; is {root} a chip store of `local-damage prepare`?")
    with open(path, newline="") as fh:
        header = next(csv.reader(fh), [])
    missing = [c for c in STORE_COLUMNS if c not in header]
    if missing:
        raise LabelError(
            f"{path}: missing column(s) {', '.join(missing)}; a chip store written by "
            "`local-damage prepare` has them"
        )
    try:
        frame = read_manifest(root)
    except (ValueError, KeyError) as exc:
        raise LabelError(f"{path}: not a readable manifest ({exc})") from exc
    what = str(root)
    if fold is not None:
        try:
            wanted = set(fold_indices(root, fold)[1])
        except (FileNotFoundError, ValueError) as exc:
            raise LabelError(str(exc)) from exc
        frame = frame[frame["chip_id"].isin(wanted)]
        what += f" fold {fold}"
    if event is not None:
        events = sorted(set(frame["event"]))
        frame = frame[frame["event"] == event]
        if frame.empty:
            raise LabelError(f"{path}: no building of event {event!r}; its events are {events}")
        what += f" event {event}"
    bad = frame[(frame["label"] >= len(class_names)) | (frame["label"] < -1)]
    if len(bad):
        raise LabelError(
            f"{path}: label {int(bad['label'].iloc[0])} of chip {bad['chip_id'].iloc[0]!r} is not "
            f"a class of the model ({', '.join(class_names)})"
        )
    reader = ChipReader(root)
    records = frame.to_dict("records")
    pairs = [reader.pair(r) for r in records]
    size = pairs[0][0].shape[0] if pairs else 1
    return Buildings(
        [str(r["chip_id"]) for r in records],
        [str(r["event"]) for r in records],
        frame["label"].to_numpy(np.int64),
        _stack([p[0] for p in pairs], size),
        _stack([p[1] for p in pairs], size),
        [f"chip store {what}: {len(records)} buildings"],
        [BuildingRef(str(root), str(r["chip_id"]), None) for r in records],
    )


# --------------------------------------------------------------------------------------------
# footprints on imagery


@dataclass(frozen=True)
class ReadOptions:
    """How :func:`from_scene` and :func:`from_xbd` read the buildings of a labelled file.

    Attributes:
        event: event name (None: from the file, see each function).
        align: ``auto`` (measure the post-to-pre shift, correct it when confident) or ``off``,
            as for ``score``.
        max_pixels: pixel limit per image and read (None: :func:`data_prep.quality.max_pixels`).
    """

    event: str | None = None
    align: str = "auto"
    max_pixels: int | None = None


def from_scene(
    pre: Sequence[str | os.PathLike],
    post: Sequence[str | os.PathLike],
    buildings: str | os.PathLike,
    spec: ChipSpec,
    class_names: Sequence[str],
    label_field: str | None = None,
    rows: dict[int, int] | None = None,
    options: ReadOptions | None = None,
) -> Buildings:
    """Buildings of a footprint file on georeferenced pre/post tiles, cut as ``score`` cuts them.

    Args:
        pre, post: the GeoTIFF tiles.
        buildings: footprint file (GeoJSON, GeoPackage, Shapefile).
        spec: the model's chip spec.
        class_names: the model's classes (labels are class names or ids).
        label_field: the attribute holding the label; None: every building unlabelled.
        rows: feature row -> class id, labels given from elsewhere (the app's corrections); only
            these rows are read.
        options: event name (default: the footprint file's stem), alignment and pixel limit
            (:class:`ReadOptions`).

    Raises:
        LabelError: a missing or unreadable file, a missing label attribute, an unknown class.
    """
    options = options or ReadOptions()
    path = Path(buildings)
    event = options.event or path.stem
    ids, labels, pres, posts, refs = [], [], [], [], []
    try:
        with bounded_gdal_cache(), open_scene(list(pre), list(post), options.max_pixels) as scene:
            fp = load_footprints(path, scene.grid.crs, label_field=label_field)
            bad = [s for s in fp.skipped if s.reason.startswith("field ")]
            if bad:
                raise LabelError(f"{bad[0].item}: {bad[0].reason}")
            if rows is not None:
                keep = np.isin(fp.rows, list(rows))
                fp.geometries = fp.geometries[keep]
                fp.uids = [u for u, k in zip(fp.uids, keep, strict=True) if k]
                fp.labels = np.array([rows[int(r)] for r in fp.rows[keep]], np.int64)
                fp.rows = fp.rows[keep]
            if len(fp) == 0:
                raise LabelError(f"{path}: none of the corrected buildings has a usable polygon")
            check_overlap(fp, scene)
            align_scene(scene, pixel_centroids(scene.grid, fp), options.align)
            for b in iter_building_chips(scene, fp, spec, progress=False):
                if b.status == CHIP:
                    ids.append(f"{event}:{b.uid}")
                    refs.append(BuildingRef(str(path), b.uid, int(fp.rows[b.index])))
                    labels.append(b.label)
                    pres.append(b.pre)
                    posts.append(b.post)
    except (SceneError, ImageError) as exc:
        raise LabelError(str(exc)) from exc
    size = spec.chip_size
    return Buildings(
        ids,
        [event] * len(ids),
        np.asarray(labels, np.int64),
        _stack(pres, size),
        _stack(posts, size),
        [f"footprints {path} on {len(pre)} pre / {len(post)} post tile(s): {len(ids)} buildings"],
        refs,
    )


def from_xbd(
    pre: str | os.PathLike,
    post: str | os.PathLike,
    labels: str | os.PathLike,
    spec: ChipSpec,
    class_names: Sequence[str],
    with_labels: bool = True,
    options: ReadOptions | None = None,
) -> Buildings:
    """Buildings of an xBD label JSON on its pixel-aligned pre/post images, cut as ``score``
    cuts them; ``subtype`` is the label when ``with_labels`` (``un-classified``: unlabelled).
    ``options``: event name (default: the label's disaster, else its file name), alignment and
    pixel limit (:class:`ReadOptions`).

    Raises:
        LabelError: a missing or unreadable file, an unknown subtype.
    """
    options = options or ReadOptions()
    path = Path(labels)
    if not path.is_file():
        raise LabelError(f"{path}: {not_found(path, 'label file not found')}")
    report = PrepareReport()
    try:
        disaster, buildings = parse_buildings(
            path, report, include_unclassified=True, ignore_labels=not with_labels
        )
        bad = [s for s in report.skipped if s.reason.startswith("unknown damage label")]
        if bad:
            raise LabelError(f"{bad[0].item}: {bad[0].reason}")
        pre_img, post_img = read_tile_pair(pre, post, options.max_pixels)
    except (OSError, ValueError, ImageError) as exc:
        if isinstance(exc, LabelError):
            raise
        raise LabelError(f"{path}: {exc}" if str(path) not in str(exc) else str(exc)) from exc
    if pre_img.shape != post_img.shape:
        raise LabelError(f"{post}: not the size of the pre image {pre}; xBD pairs are aligned")
    post_img, _ = align_images(pre_img, post_img, options.align)
    event = options.event or disaster or path.stem.replace("_post_disaster", "")
    rows = _xbd_rows(path)
    ids, labs, pres, posts, refs = [], [], [], [], []
    for b in buildings:
        chips = cut_building(pre_img, post_img, b, spec)
        if chips is None:
            continue
        _, a, c = chips
        if blank_reason(a, c):
            continue
        ids.append(f"{path.stem.replace('_post_disaster', '')}:{b.uid}")
        refs.append(BuildingRef(str(path), b.uid, rows.get(b.uid)))
        labs.append(b.label if with_labels else -1)
        pres.append(a)
        posts.append(c)
    size = spec.chip_size
    return Buildings(
        ids,
        [event] * len(ids),
        np.asarray(labs, np.int64),
        _stack(pres, size),
        _stack(posts, size),
        [f"xBD labels {path}: {len(ids)} buildings"],
        refs,
    )


def _xbd_rows(path: Path) -> dict[str, int]:
    """uid -> row of each building of an xBD label file: its position among the building
    features of ``features.xy``, the row ``score`` writes it in."""
    rows: dict[str, int] = {}
    row = 0
    for i, f in enumerate(json.loads(path.read_text())["features"]["xy"]):
        props = (f.get("properties") if isinstance(f, dict) else None) or {}
        if props.get("feature_type", "building") == "building":
            rows.setdefault(str(props.get("uid") or f"#{i}"), row)
            row += 1
    return rows
