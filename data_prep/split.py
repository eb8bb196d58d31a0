"""Cross-validation folds for a chip store: `local-damage split`.

Folds are formed from whole tiles, never from single buildings, so that neighbouring buildings of
one image (which share look, date and often damage) never sit on both sides of a split:

- ``by="tile"``: k folds of tiles, stratified by class as far as whole tiles allow. The
  assignment is the greedy of scikit-learn's ``StratifiedGroupKFold`` (each tile goes to the fold
  where it least unbalances the per-class shares, ties to the smallest fold; each chip's label is
  its stratum, unlabelled chips a stratum of their own), with the tiles taken in a seeded random
  order that still favours large, unbalanced tiles first. ``StratifiedGroupKFold`` itself sorts
  tiles by their class imbalance and uses its shuffle only to break exact ties, so with real tiles
  every seed gives the same folds; here each seed gives its own, equally stratified folds.
- ``by="tile", stratify="event"``: the same greedy, except that a tile goes first to a fold
  holding the fewest tiles of its event, and only among those to the one it least unbalances:
  the tiles of every event are dealt round the folds, so each fold holds tiles of each event
  that has at least as many tiles as there are folds, and an event with fewer tiles has each in
  a fold of its own.
- ``by="block"``: the same greedy over spatial blocks instead of tiles. A block is a connected
  group of tiles whose centres (the mean lon/lat of their buildings) lie within ``block_km`` of
  a neighbour's, so no tile has a neighbour in another fold (xBD tiles are about 0.5 km wide:
  with the default 1 km two tiles of different blocks are at least a tile's width apart). The
  tile folds put neighbouring tiles of one town on both sides of a split; these measure what a
  model does on an area it never saw. Tiles without coordinates are blocks of their own.
- ``by="event"``: leave one event out; fold ``i`` is the ``i``-th event in sorted order.

:func:`inner_folds` deals the training tiles of one outer fold into inner folds the same way, for
choices (of a recipe, a threshold) that must never see the outer test fold.

The result is ``CHIPS/splits.csv`` with columns chip_id, tile, event, fold, in manifest order, and
``group``: the unit that was dealt (the tile, the block or the event), which the inner folds of
:func:`inner_folds` keep together too.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from data_prep.spec import CLASS_NAMES
from data_prep.store import StoreError, StoreNotFoundError, atomic_path, read_manifest

SPLITS = "splits.csv"
SPLIT_COLUMNS = ("chip_id", "tile", "event", "fold")
#: Written after SPLIT_COLUMNS: the unit dealt into folds (older splits.csv files lack it).
GROUP_COLUMN = "group"
BY_CHOICES = ("tile", "block", "event")
#: Default largest distance (km) between the centres of two tiles of one spatial block.
BLOCK_KM = 1.0
STRATIFY_CHOICES = ("class", "event")

log = logging.getLogger(__name__)


class SplitError(StoreError):
    """Folds that cannot be made or used as asked (too few tiles or events, an unknown fold,
    splits.csv out of date with the manifest); the message says what to change."""


def assign_folds(
    manifest,
    folds: int = 5,
    by: str = "tile",
    seed: int = 0,
    stratify: str = "class",
    block_km: float = BLOCK_KM,
    groups=None,
):
    """Assign every chip of a manifest to a fold.

    Args:
        manifest: DataFrame with at least chip_id, tile, event and label (``read_manifest``);
            lon and lat for ``by="block"``.
        folds: number of folds for ``by="tile"`` or ``"block"`` (ignored for ``by="event"``).
        by: ``"tile"`` (grouped, stratified k-fold), ``"block"`` (the same over spatial blocks of
            tiles) or ``"event"`` (leave one event out).
        seed: random seed for the order in which tiles (blocks) are dealt to folds.
        stratify: for ``by="tile"``/``"block"``, balance the folds' shares of each class
            (``"class"``) or of each event and class together (``"event"``).
        block_km: for ``by="block"``, tiles whose centres are closer than this join one block.
        groups: for ``by="tile"``, a mapping tile -> group that deals whole groups instead of
            tiles (the inner folds of a block split keep its blocks together).

    Returns:
        DataFrame with columns chip_id, tile, event, fold (int) and group (the unit dealt), one
        row per chip in manifest order.

    Raises:
        SplitError: for an unknown ``by``, fewer than 2 folds, fewer tiles (blocks) than folds,
            fewer than 2 events for ``by="event"``, or a tile listed under two events.
    """
    import pandas as pd

    if by not in BY_CHOICES:
        raise SplitError(f"unknown split --by {by!r}: expected one of {', '.join(BY_CHOICES)}")
    if stratify not in STRATIFY_CHOICES:
        raise SplitError(
            f"unknown split --stratify {stratify!r}: expected one of {', '.join(STRATIFY_CHOICES)}"
        )
    if len(manifest) == 0:
        raise SplitError("the manifest has no chips to split")
    frame = manifest[["chip_id", "tile", "event"]].copy()
    if frame["chip_id"].duplicated().any():
        dup = frame.loc[frame["chip_id"].duplicated(), "chip_id"].iloc[0]
        raise SplitError(f"chip_id {dup!r} appears more than once in the manifest")
    events_per_tile = frame.groupby("tile")["event"].nunique()
    if (events_per_tile > 1).any():
        tile = events_per_tile[events_per_tile > 1].index[0]
        raise SplitError(
            f"tile {tile!r} appears under more than one event; tiles must belong to one event"
        )

    if by == "event":
        events = sorted(frame["event"].unique())
        if len(events) < 2:
            raise SplitError(
                f"leave-one-event-out needs at least 2 events, the store has {len(events)} "
                f"({', '.join(events)}); use --by tile"
            )
        index = {e: i for i, e in enumerate(events)}
        frame["fold"] = frame["event"].map(index).astype(int)
        frame[GROUP_COLUMN] = frame["event"]
        return frame.reset_index(drop=True)

    if folds < 2:
        raise SplitError(f"--folds must be at least 2, got {folds}")
    if by == "block":
        groups = spatial_blocks(manifest, block_km)
    unit = frame["tile"].map(groups) if groups is not None else frame["tile"]
    if unit.isna().any():
        raise SplitError(f"tile {frame.loc[unit.isna(), 'tile'].iloc[0]!r} has no group")
    frame[GROUP_COLUMN] = unit.astype(str)
    what = "spatial blocks" if by == "block" else "tiles" if groups is None else "tile groups"
    n_units = frame[GROUP_COLUMN].nunique()
    if n_units < folds:
        raise SplitError(
            f"{folds} folds need at least {folds} {what}, the store has {n_units}; "
            "use fewer --folds (or more tiles"
            + (", or a smaller --block-km)" if by == "block" else ")")
        )
    fold = stratified_group_folds(
        manifest["label"].to_numpy(),
        frame[GROUP_COLUMN].to_numpy(),
        folds,
        seed,
        events=frame["event"].to_numpy() if stratify == "event" else None,
    )
    if len(np.unique(fold)) < folds:
        raise SplitError(
            f"could not deal the {n_units} {what} into {folds} non-empty folds; use fewer --folds"
        )
    frame["fold"] = pd.Series(fold, index=frame.index).astype(int)
    return frame.reset_index(drop=True)


def tile_centres(manifest):
    """Per tile, the mean lon/lat of its buildings (DataFrame indexed by tile; NaN when the tile
    has no coordinates)."""
    import pandas as pd

    lonlat = manifest[["tile", "event"]].copy()
    for c in ("lon", "lat"):
        column = manifest[c] if c in manifest.columns else np.nan
        lonlat[c] = pd.to_numeric(column, errors="coerce")
    return lonlat.groupby("tile").agg(
        event=("event", "first"), lon=("lon", "mean"), lat=("lat", "mean")
    )


def spatial_blocks(manifest, block_km: float = BLOCK_KM) -> dict[str, str]:
    """Tile -> spatial block: the connected groups of tiles whose centres lie within ``block_km``
    of each other (single linkage), named ``<event>:block<k>`` in the order of their first tile.

    A tile without coordinates is a block of its own, named after the tile.

    Raises:
        SplitError: ``block_km`` is not positive.
    """
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components
    from scipy.spatial import cKDTree

    if not block_km > 0:
        raise SplitError(f"--block-km must be positive, got {block_km}")
    centres = tile_centres(manifest).sort_index()
    placed = centres.dropna(subset=["lon", "lat"])
    out = {t: f"{t}:alone" for t in centres.index.difference(placed.index)}
    if len(placed):
        # local equirectangular km (a block spans a few km: the error is far below a tile)
        lat0 = np.radians(placed["lat"].to_numpy())
        xy = np.column_stack(
            [placed["lon"].to_numpy() * 111.32 * np.cos(lat0), placed["lat"].to_numpy() * 110.57]
        )
        pairs = cKDTree(xy).query_pairs(r=float(block_km), output_type="ndarray")
        n = len(placed)
        graph = coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])), shape=(n, n))
        _, comp = connected_components(graph, directed=False)
        events = placed["event"].to_numpy()
        names: dict[int, str] = {}
        counter: dict[str, int] = {}
        for tile, c, event in zip(placed.index, comp, events, strict=True):
            if c not in names:
                counter[event] = counter.get(event, -1) + 1
                names[c] = f"{event}:block{counter[event]}"
            out[tile] = names[c]
    return out


def inner_folds(
    splits, manifest, test_fold: int, folds: int, seed: int = 0, stratify: str = "event"
):
    """Inner folds of the training tiles of one outer fold (every fold but ``test_fold``).

    The units the outer split dealt (its ``group`` column: spatial blocks of a block split) stay
    together in the inner folds too, so an inner choice is made on areas as unseen as the outer
    test fold's.

    Args:
        splits: the outer splits (``load_splits``).
        manifest: the store's manifest (``read_manifest``).
        test_fold: the outer test fold, left out entirely.
        folds: number of inner folds (>= 2).
        seed: seed of the dealing order.
        stratify: as :func:`assign_folds`.

    Returns:
        DataFrame chip_id, tile, event, fold (the inner fold), group of the chips outside
        ``test_fold``.

    Raises:
        SplitError: no such outer fold, or fewer training tiles than inner folds.
    """
    if test_fold not in set(splits["fold"]):
        raise SplitError(
            f"no outer fold {test_fold}; the folds are {', '.join(map(str, sorted(set(splits['fold']))))}"
        )
    keep = set(splits.loc[splits["fold"] != test_fold, "chip_id"])
    part = manifest[manifest["chip_id"].isin(keep)].reset_index(drop=True)
    groups = None
    if GROUP_COLUMN in splits.columns:
        groups = dict(zip(splits["tile"], splits[GROUP_COLUMN], strict=True))
    try:
        return assign_folds(
            part, folds=folds, by="tile", seed=seed, stratify=stratify, groups=groups
        )
    except SplitError as exc:
        raise SplitError(f"inner folds of outer fold {test_fold}: {exc}") from exc


def inner_event_folds(splits, manifest, test_fold: int, folds: int):
    """Inner folds of the training tiles of one outer fold that hold out whole events: inner
    fold ``j`` is the ``j``-th training event by labelled buildings (most first, ties by name),
    so a recipe is chosen on events it never saw, as the product meets a new disaster. The other
    events' chips (fold ``-1``) are in the training part of every inner fold.

    Args:
        splits: the outer splits (``load_splits``).
        manifest: the store's manifest (``read_manifest``).
        test_fold: the outer test fold, left out entirely.
        folds: the number of events held out in turn (>= 2).

    Returns:
        DataFrame chip_id, tile, event, fold (the inner fold, -1: always trained on), group
        (the event) of the chips outside ``test_fold``.

    Raises:
        SplitError: no such outer fold, or fewer training events with labelled buildings than
            ``folds``.
    """
    if test_fold not in set(splits["fold"]):
        raise SplitError(
            f"no outer fold {test_fold}; the folds are {', '.join(map(str, sorted(set(splits['fold']))))}"
        )
    keep = set(splits.loc[splits["fold"] != test_fold, "chip_id"])
    part = manifest[manifest["chip_id"].isin(keep)].reset_index(drop=True)
    labelled = part[part["label"] >= 0]
    counts = labelled.groupby("event").size()
    ranked = sorted(counts.index, key=lambda e: (-int(counts[e]), str(e)))
    if len(ranked) < folds:
        raise SplitError(
            f"inner folds of outer fold {test_fold}: {folds} events to hold out in turn, but its "
            f"training tiles hold labelled buildings of {len(ranked)} "
            f"({', '.join(map(str, ranked)) or 'none'})"
        )
    fold_of = {e: j for j, e in enumerate(ranked[:folds])}
    out = part[["chip_id", "tile", "event"]].copy()
    out["fold"] = [fold_of.get(e, -1) for e in out["event"]]
    out["group"] = out["event"]
    return out


def stratified_group_folds(
    labels: np.ndarray,
    groups: np.ndarray,
    folds: int,
    seed: int,
    events: np.ndarray | None = None,
) -> np.ndarray:
    """Fold of every sample such that no group spans two folds and class shares stay even.

    Args:
        labels: [N] class of each sample (any hashable values).
        groups: [N] group (tile) of each sample.
        folds: number of folds.
        seed: seed of the order in which groups are dealt.
        events: [N] event of each sample (one per group), or None; when given, a group goes to
            a fold holding the fewest groups of its event (and, for the first of its event there,
            the fewest events) before class balance is weighed.

    Returns:
        [N] int fold index per sample, in 0..folds-1.
    """
    classes, y = np.unique(labels, return_inverse=True)
    names, g = np.unique(groups, return_inverse=True)
    counts = np.zeros((len(names), len(classes)))
    np.add.at(counts, (g, y), 1)
    totals = counts.sum(axis=0)
    rng = np.random.default_rng(seed)
    # scikit-learn's order (most unbalanced groups first), jittered by the seed
    order = np.argsort(-counts.std(axis=1) * rng.lognormal(0.0, 0.5, len(names)), kind="stable")
    per_fold = np.zeros((folds, len(classes)))
    group_fold = np.zeros(len(names), dtype=int)
    group_event = np.zeros(len(names), dtype=int)
    if events is not None:
        _, event_ids = np.unique(events, return_inverse=True)
        group_event[g] = event_ids
    event_load = np.zeros((folds, int(group_event.max()) + 1), dtype=int)
    for gi in order:
        best, best_key = 0, None
        for f in range(folds):
            per_fold[f] += counts[gi]
            spread = float(np.mean(np.std(per_fold / totals, axis=0)))
            per_fold[f] -= counts[gi]
            load = event_load[f, group_event[gi]] if events is not None else 0
            # a first tile of its event goes where the fewest events are yet (small events apart)
            present = int((event_load[f] > 0).sum()) if events is not None and load == 0 else 0
            key = (load, present, round(spread, 12), per_fold[f].sum())
            if best_key is None or key < best_key:
                best, best_key = f, key
        group_fold[gi] = best
        per_fold[best] += counts[gi]
        event_load[best, group_event[gi]] += 1
    return group_fold[g]


def split_summary(splits, manifest) -> str:
    """A short table: chips, tiles and chips per class in each fold."""
    merged = splits.merge(manifest[["chip_id", "label"]], on="chip_id", how="left")
    names = list(CLASS_NAMES) + (["unlabelled"] if (merged["label"] < 0).any() else [])
    header = f"{'fold':>4} {'tiles':>5} {'chips':>6} " + " ".join(f"{n:>13}" for n in names)
    lines = [header]
    for k, part in merged.groupby("fold"):
        counts = [int((part["label"] == c).sum()) for c in range(len(CLASS_NAMES))]
        if len(names) > len(CLASS_NAMES):
            counts.append(int((part["label"] < 0).sum()))
        events = ",".join(sorted(part["event"].unique())) if part["event"].nunique() <= 2 else ""
        lines.append(
            f"{k:>4} {part['tile'].nunique():>5} {len(part):>6} "
            + " ".join(f"{c:>13}" for c in counts)
            + (f"  {events}" if events else "")
        )
    return "\n".join(lines)


def fold_counts(chips: str | os.PathLike) -> list[dict]:
    """Per fold of ``CHIPS/splits.csv``: its number, tiles, chips and chips per class name
    (``unlabelled`` for chips without a label), as :func:`split_summary` tabulates them."""
    merged = load_splits(chips).merge(
        read_manifest(chips)[["chip_id", "label"]], on="chip_id", how="left"
    )
    out = []
    for k, part in merged.groupby("fold"):
        per_class = {n: int((part["label"] == c).sum()) for c, n in enumerate(CLASS_NAMES)}
        if (part["label"] < 0).any():
            per_class["unlabelled"] = int((part["label"] < 0).sum())
        out.append(
            {
                "fold": int(k),
                "tiles": int(part["tile"].nunique()),
                "chips": len(part),
                "per_class": per_class,
                "events": sorted(part["event"].unique()),
            }
        )
    return out


def make_splits(
    chips: str | os.PathLike,
    folds: int = 5,
    by: str = "tile",
    seed: int = 0,
    *,
    stratify: str = "class",
    block_km: float = BLOCK_KM,
    verbose: bool = True,
) -> Path:
    """Write ``CHIPS/splits.csv`` atomically and log a per-fold summary.

    Args:
        chips: chip store folder (with manifest.csv).
        folds: number of folds for ``by="tile"``.
        by: ``"tile"``, ``"block"`` or ``"event"`` (see :func:`assign_folds`).
        seed: random seed; the same seed gives the same folds.
        stratify: ``"class"`` or ``"event"`` (see :func:`assign_folds`).
        block_km: for ``by="block"``, the largest distance between neighbouring tile centres.
        verbose: log the summary (INFO).

    Returns:
        Path of the written splits.csv.

    Raises:
        StoreNotFoundError: when the store has no manifest.
        SplitError: as :func:`assign_folds`, prefixed with the store path.
    """
    root = Path(chips)
    manifest = read_manifest(root)
    try:
        splits = assign_folds(
            manifest, folds=folds, by=by, seed=seed, stratify=stratify, block_km=block_km
        )
    except SplitError as exc:
        raise SplitError(f"{root}: {exc}") from exc
    out = root / SPLITS
    with atomic_path(out, suffix=".csv") as tmp:
        splits.to_csv(tmp, index=False, columns=[*SPLIT_COLUMNS, GROUP_COLUMN])
    if verbose:
        what = f"{splits['fold'].nunique()} folds by {by}" + (
            f" (seed {seed}, stratified by {stratify})" if by != "event" else ""
        )
        if by == "block":
            what += f", {splits[GROUP_COLUMN].nunique()} blocks of tiles within {block_km:g} km"
        log.info(f"{len(splits)} chips in {what}:")
        log.info(split_summary(splits, manifest))
    return out


def load_splits(chips: str | os.PathLike):
    """``CHIPS/splits.csv`` as a DataFrame (chip_id, tile, event as str; fold as int).

    Raises:
        StoreNotFoundError: when the store has no splits yet.
        SplitError: when the file lacks a column, or lists chips the manifest does not have (the
            store was prepared again after splitting).
    """
    import pandas as pd

    root = Path(chips)
    path = root / SPLITS
    if not path.is_file():
        raise StoreNotFoundError(f"{path}: no splits; run `local-damage split {root}` first")
    df = pd.read_csv(
        path,
        dtype={"chip_id": str, "tile": str, "event": str, GROUP_COLUMN: str},
        keep_default_na=False,
    )
    missing = [c for c in SPLIT_COLUMNS if c not in df.columns]
    if missing:
        raise SplitError(
            f"{path}: missing column(s) {', '.join(missing)}; run `local-damage split` again"
        )
    df["fold"] = df["fold"].astype(int)
    manifest_path = root / "manifest.csv"
    if manifest_path.is_file():
        known = set(read_manifest(root)["chip_id"])
        stale = [c for c in df["chip_id"] if c not in known]
        if stale:
            raise SplitError(
                f"{path}: {len(stale)} chip(s) (e.g. {stale[0]!r}) are not in the manifest; the store "
                f"was prepared again after splitting: run `local-damage split {root}` again"
            )
    return df


def fold_indices(
    chips: str | os.PathLike, fold: int | None, holdout: int | None = None
) -> tuple[list[str], list[str]]:
    """Chip ids for training and validation when holding out ``fold``.

    Args:
        chips: chip store folder with splits.csv.
        fold: the validation fold; None: no validation (every chip outside ``holdout`` trains).
        holdout: a test fold left out of both training and validation (its chips are never seen).

    Returns:
        ``(train_ids, val_ids)``: chip_id lists in splits order; validation is every chip of
        ``fold``, training every chip of the other folds except ``holdout``.

    Raises:
        SplitError: when ``fold`` or ``holdout`` is not one of the folds in splits.csv, or both
            name the same fold.
    """
    df = load_splits(chips)
    available = sorted(df["fold"].unique())
    for name, k in (("fold", fold), ("holdout fold", holdout)):
        if k is not None and k not in available:
            raise SplitError(
                f"{Path(chips) / SPLITS}: no {name} {k}; the folds are {', '.join(map(str, available))}"
            )
    if fold is not None and fold == holdout:
        raise SplitError(f"fold {fold} cannot be both the validation and the held-out fold")
    folds = df["fold"].to_numpy()
    val = folds == fold if fold is not None else np.zeros(len(df), bool)
    train = ~val & (folds != holdout if holdout is not None else True)
    return df.loc[train, "chip_id"].tolist(), df.loc[val, "chip_id"].tolist()
