"""`split --by block`: folds of spatial blocks of neighbouring tiles, so no tile has a neighbour
in another fold; inner folds keep the blocks together."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from data_prep.spec import CLASS_NAMES
from data_prep.split import (
    GROUP_COLUMN,
    SplitError,
    assign_folds,
    inner_folds,
    load_splits,
    make_splits,
    spatial_blocks,
)
from data_prep.store import read_manifest, write_manifest

#: degrees of latitude per km (the tests place tiles on a km grid)
KM = 1 / 110.57


def town(event: str, lon0: float, lat0: float, shape: tuple[int, int], gap: int = 0, name=""):
    """Tile centres of a town: a grid of tiles 0.5 km apart, ``gap`` empty columns in the middle."""
    rows, cols = shape
    out = []
    for r in range(rows):
        for c in range(cols + gap):
            if gap and cols // 2 <= c < cols // 2 + gap:
                continue
            lat = lat0 + r * 0.5 * KM
            lon = lon0 + c * 0.5 * KM / np.cos(np.radians(lat0))
            out.append((event, f"{event}{name}_{r}_{c}", lon, lat))
    return out


def write_towns(root, tiles, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = []
    for event, tile, lon, lat in tiles:
        for i in range(int(rng.integers(3, 12))):
            label = int(rng.integers(len(CLASS_NAMES)))
            rows.append(
                {
                    "chip_id": f"{tile}:{i}",
                    "event": event,
                    "tile": tile,
                    "uid": str(i),
                    "label": label,
                    "label_name": CLASS_NAMES[label],
                    # buildings scattered within the tile (0.5 km wide)
                    "lon": lon + rng.uniform(-0.2, 0.2) * KM,
                    "lat": lat + rng.uniform(-0.2, 0.2) * KM,
                    "index": i,
                }
            )
    write_manifest(root, rows)
    return root


def test_neighbouring_tiles_share_a_block_and_a_gap_splits_them(tmp_path):
    # two towns of one event 3 tiles apart, and a town of another event far away
    tiles = town("storm", -85.6, 30.1, (3, 4), gap=3) + town("fire", -122.7, 38.4, (2, 2))
    manifest = read_manifest(write_towns(tmp_path, tiles))
    blocks = spatial_blocks(manifest, block_km=1.0)
    assert len(set(blocks.values())) == 3
    assert blocks["storm_0_0"] == blocks["storm_2_1"] != blocks["storm_0_5"] == blocks["storm_2_6"]
    assert blocks["fire_0_0"].startswith("fire:") and blocks["storm_0_0"].startswith("storm:")
    # a radius below the tile spacing leaves every tile alone
    assert len(set(spatial_blocks(manifest, block_km=0.3).values())) == len(tiles)


def test_no_fold_holds_a_neighbour_of_another_folds_tile(tmp_path):
    tiles = []
    for k in range(8):  # eight separate neighbourhoods of one event, each 2 x 3 tiles
        tiles += town("storm", -85.6 + k * 0.05, 30.1, (2, 3), name=str(k))
    manifest = read_manifest(write_towns(tmp_path, tiles))
    splits = assign_folds(manifest, folds=4, by="block", seed=3, block_km=1.0)
    centres = manifest.groupby("tile")[["lon", "lat"]].mean()
    fold_of = splits.groupby("tile")["fold"].first()
    xy = np.column_stack(
        [centres["lon"] * 111.32 * np.cos(np.radians(30.1)), centres["lat"] * 110.57]
    )
    d = np.hypot(*(xy[:, None, :] - xy[None, :, :]).transpose(2, 0, 1))
    near = d < 1.0
    folds = fold_of.loc[centres.index].to_numpy()
    assert np.all(folds[:, None] == folds[None, :], where=near)
    # the plain tile folds do put neighbours on both sides: the test can tell them apart
    by_tile = assign_folds(manifest, folds=4, by="tile", seed=3).groupby("tile")["fold"].first()
    tile_folds = by_tile.loc[centres.index].to_numpy()
    assert not np.all(tile_folds[:, None] == tile_folds[None, :], where=near)
    assert splits[GROUP_COLUMN].nunique() == 8 and splits["fold"].nunique() == 4


def test_block_splits_csv_keeps_its_blocks_in_the_inner_folds(tmp_path):
    tiles = []
    for k in range(10):
        tiles += town("storm", -85.6 + k * 0.05, 30.1, (2, 2), name=str(k))
    root = write_towns(tmp_path / "chips", tiles)
    make_splits(root, folds=5, by="block", seed=0, verbose=False)
    splits = load_splits(root)
    assert splits[GROUP_COLUMN].nunique() == 10
    inner = inner_folds(splits, read_manifest(root), test_fold=0, folds=2, seed=1)
    per_block = inner.groupby(GROUP_COLUMN)["fold"].nunique()
    assert (per_block == 1).all() and inner[GROUP_COLUMN].nunique() == 8


def test_too_few_blocks_and_bad_radius_are_refused(tmp_path):
    manifest = read_manifest(write_towns(tmp_path, town("storm", -85.6, 30.1, (3, 3))))
    with pytest.raises(SplitError, match="spatial blocks.*--block-km"):
        assign_folds(manifest, folds=2, by="block")
    with pytest.raises(SplitError, match="block-km must be positive"):
        spatial_blocks(manifest, block_km=0)


def test_tiles_without_coordinates_are_blocks_of_their_own(tmp_path):
    root = write_towns(tmp_path, town("storm", -85.6, 30.1, (1, 2)))
    manifest = read_manifest(root)
    manifest = pd.concat(
        [manifest, manifest.assign(tile="x_1", chip_id=lambda f: "x_1:" + f["uid"], lon="", lat="")]
    )
    blocks = spatial_blocks(manifest)
    assert blocks["x_1"] == "x_1:alone" and blocks["storm_0_0"] == blocks["storm_0_1"]
