"""`local-damage split`: folds of whole tiles, stratified by class, or leave one event out."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from data_prep.spec import CLASS_NAMES
from data_prep.split import (
    SPLITS,
    SplitError,
    assign_folds,
    fold_indices,
    inner_folds,
    load_splits,
    make_splits,
)
from data_prep.store import read_manifest, write_manifest

EVENTS = ("flood-a", "quake-b", "storm-c")


def write_store(root: Path, n_tiles: int = 24, events=EVENTS, seed: int = 0) -> Path:
    """A manifest of ``n_tiles`` tiles of 5-60 chips over ``events`` with mixed class balance."""
    rng = np.random.default_rng(seed)
    rows = []
    for t in range(n_tiles):
        event = events[t % len(events)]
        tile = f"{event}_{t:04d}"
        # each tile leans towards one class, as real tiles do
        weights = np.full(len(CLASS_NAMES), 1.0)
        weights[rng.integers(len(CLASS_NAMES))] += 3.0
        for i in range(int(rng.integers(5, 60))):
            label = int(rng.choice(len(CLASS_NAMES), p=weights / weights.sum()))
            rows.append(
                {
                    "chip_id": f"{tile}:{i}",
                    "event": event,
                    "tile": tile,
                    "uid": str(i),
                    "label": label,
                    "label_name": CLASS_NAMES[label],
                    "index": i,
                }
            )
    write_manifest(root, rows)
    return root


@pytest.fixture()
def store(tmp_path) -> Path:
    return write_store(tmp_path / "chips")


def test_no_tile_in_two_folds_and_every_chip_once(store):
    path = make_splits(store, folds=5, by="tile", seed=0, verbose=False)
    assert path == store / SPLITS
    splits = load_splits(store)
    manifest = read_manifest(store)
    assert list(splits.columns) == ["chip_id", "tile", "event", "fold", "group"]
    assert list(splits["chip_id"]) == list(manifest["chip_id"])
    assert splits["chip_id"].is_unique
    assert (splits.groupby("tile")["fold"].nunique() == 1).all()
    assert sorted(splits["fold"].unique()) == [0, 1, 2, 3, 4]
    assert not list(store.glob(f".{SPLITS}*"))  # no temporary file left


def test_same_seed_same_folds_other_seed_other_folds(store, tmp_path):
    make_splits(store, folds=4, seed=3, verbose=False)
    first = (store / SPLITS).read_bytes()
    make_splits(store, folds=4, seed=3, verbose=False)
    assert (store / SPLITS).read_bytes() == first
    make_splits(store, folds=4, seed=4, verbose=False)
    assert (store / SPLITS).read_bytes() != first


def test_stratification_beats_dealing_tiles_at_random(store):
    manifest = read_manifest(store)
    overall = np.bincount(manifest["label"], minlength=4) / len(manifest)

    def spread(fold: np.ndarray) -> float:
        """Largest deviation of a fold's class shares from the overall shares."""
        worst = 0.0
        for k in np.unique(fold):
            labels = manifest["label"].to_numpy()[fold == k]
            worst = max(
                worst, np.abs(np.bincount(labels, minlength=4) / len(labels) - overall).max()
            )
        return worst

    stratified = [
        spread(assign_folds(manifest, folds=4, seed=s)["fold"].to_numpy()) for s in range(5)
    ]
    tiles = manifest["tile"].unique()
    rng = np.random.default_rng(0)
    random = []
    for _ in range(20):
        dealt = dict(zip(rng.permutation(tiles), np.arange(len(tiles)) % 4, strict=True))
        random.append(spread(manifest["tile"].map(dealt).to_numpy()))
    assert np.mean(stratified) < 0.1
    assert np.mean(stratified) < 0.75 * np.mean(random)
    # about as even as scikit-learn's StratifiedGroupKFold (whose folds ignore the seed here)
    import warnings

    from sklearn.model_selection import StratifiedGroupKFold

    reference = np.empty(len(manifest), dtype=int)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        cv = StratifiedGroupKFold(4, shuffle=True, random_state=0)
        for k, (_, val) in enumerate(cv.split(manifest, manifest["label"], manifest["tile"])):
            reference[val] = k
    assert np.mean(stratified) < 1.5 * spread(reference) + 0.01


def test_seeds_give_different_partitions_not_just_other_numbers(store):
    manifest = read_manifest(store)

    def partition(seed):
        folds = assign_folds(manifest, folds=4, seed=seed)
        return frozenset(frozenset(part["tile"]) for _, part in folds.groupby("fold"))

    assert len({partition(s) for s in range(6)}) >= 4


def test_leave_one_event_out(store):
    make_splits(store, by="event", verbose=False)
    splits = load_splits(store)
    assert sorted(splits["fold"].unique()) == [0, 1, 2]
    for fold, event in enumerate(sorted(EVENTS)):
        assert set(splits.loc[splits["fold"] == fold, "event"]) == {event}
    assert (splits.groupby("tile")["fold"].nunique() == 1).all()


def test_fold_indices(store):
    make_splits(store, folds=3, seed=1, verbose=False)
    splits = load_splits(store)
    for fold in range(3):
        train, val = fold_indices(store, fold)
        assert set(val) == set(splits.loc[splits["fold"] == fold, "chip_id"])
        assert not set(train) & set(val)
        assert sorted(train + val) == sorted(splits["chip_id"])
        assert not set(splits.set_index("chip_id").loc[train, "tile"]) & set(
            splits.set_index("chip_id").loc[val, "tile"]
        )
    with pytest.raises(ValueError, match="no fold 7; the folds are 0, 1, 2"):
        fold_indices(store, 7)


def test_holdout_fold_is_never_seen(store):
    make_splits(store, folds=3, seed=1, verbose=False)
    splits = load_splits(store)
    fold_of = splits.set_index("chip_id")["fold"]
    held = set(splits.loc[splits["fold"] == 2, "chip_id"])
    train, val = fold_indices(store, 0, holdout=2)
    assert set(val) == set(splits.loc[splits["fold"] == 0, "chip_id"])
    assert set(fold_of[train]) == {1}
    assert not (set(train) | set(val)) & held
    train, val = fold_indices(store, None, holdout=2)
    assert val == [] and set(fold_of[train]) == {0, 1}
    assert sorted(train + list(held)) == sorted(splits["chip_id"])
    with pytest.raises(ValueError, match="both the validation and the held-out"):
        fold_indices(store, 2, holdout=2)
    with pytest.raises(ValueError, match="no holdout fold 5"):
        fold_indices(store, 0, holdout=5)


def test_summary_on_stderr(store, capsys):
    from cli.main import main

    main(["split", str(store), "--folds", "3", "--seed", "0"])
    err = capsys.readouterr().err
    splits = load_splits(store)
    manifest = read_manifest(store)
    assert f"{len(manifest)} chips in 3 folds by tile" in err
    merged = splits.merge(manifest[["chip_id", "label"]], on="chip_id")
    for fold, part in merged.groupby("fold"):
        counts = Counter(part["label"])
        line = next(li for li in err.splitlines() if li.split()[:1] == [str(fold)])
        values = [int(v) for v in line.split()[1:7]]
        assert values == [part["tile"].nunique(), len(part), *(counts.get(c, 0) for c in range(4))]


def test_cli_split(store, capsys):
    from cli.main import main

    assert main(["split", str(store), "--folds", "3", "--seed", "2"]) == 0
    assert (store / SPLITS).is_file()
    assert "wrote" in capsys.readouterr().err
    assert sorted(load_splits(store)["fold"].unique()) == [0, 1, 2]


def test_errors(tmp_path):
    few = write_store(tmp_path / "few", n_tiles=3)
    with pytest.raises(ValueError, match=r"few: 5 folds need at least 5 tiles, the store has 3"):
        make_splits(few, folds=5, verbose=False)
    one_event = write_store(tmp_path / "one", n_tiles=6, events=("only-event",))
    with pytest.raises(ValueError, match="at least 2 events, the store has 1"):
        make_splits(one_event, by="event", verbose=False)
    with pytest.raises(FileNotFoundError, match="missing.*manifest"):
        make_splits(tmp_path / "missing", verbose=False)
    with pytest.raises(ValueError, match="at least 2"):
        make_splits(few, folds=1, verbose=False)
    with pytest.raises(ValueError, match="unknown split --by 'building'"):
        make_splits(few, by="building", verbose=False)
    with pytest.raises(FileNotFoundError, match=f"{SPLITS}: no splits; run `local-damage split"):
        load_splits(few)
    assert not (few / SPLITS).exists()


def test_tile_under_two_events_is_refused(tmp_path):
    root = write_store(tmp_path / "mixed", n_tiles=6)
    frame = read_manifest(root)
    frame.loc[frame.index[0], "event"] = "other-event"
    write_manifest(root, frame.to_dict("records"))
    with pytest.raises(ValueError, match="appears under more than one event"):
        make_splits(root, folds=2, verbose=False)


def test_stale_splits_are_detected(tmp_path):
    root = write_store(tmp_path / "stale", n_tiles=6)
    make_splits(root, folds=2, verbose=False)
    write_store(root, n_tiles=6, seed=1, events=("new-event", "other-event"))
    with pytest.raises(ValueError, match="prepared again after splitting"):
        load_splits(root)


def test_assign_folds_keeps_manifest_order(store):
    manifest = read_manifest(store).sample(frac=1.0, random_state=0)
    folds = assign_folds(manifest, folds=3, seed=0)
    assert list(folds["chip_id"]) == list(manifest["chip_id"])
    assert isinstance(folds, pd.DataFrame)


def test_split_json_counts_what_splits_csv_holds(store, capsys):
    import json

    from cli.main import main

    assert main(["split", str(store), "--folds", "3", "--seed", "1", "--json", "--quiet"]) == 0
    out, err = capsys.readouterr()
    got = {f["fold"]: f for f in json.loads(out)}
    merged = load_splits(store).merge(read_manifest(store)[["chip_id", "label"]], on="chip_id")
    assert sorted(got) == sorted(merged["fold"].unique())
    for fold, part in merged.groupby("fold"):
        assert got[fold]["chips"] == len(part) and got[fold]["tiles"] == part["tile"].nunique()
        assert sum(got[fold]["per_class"].values()) == len(part)
    assert err == ""  # --quiet: no summary, no "wrote"


def uneven_store(root: Path) -> Path:
    """Tiles of four events: 18 of one, 6, 3 and 2 of the others (as the real xBD tiles go)."""
    write_store(root, n_tiles=18, events=("wildfire-a",), seed=3)
    big = read_manifest(root).to_dict("records")
    rows = list(big)
    for event, n in (("flood-b", 6), ("volcano-c", 3), ("tornado-d", 2)):
        write_store(root, n_tiles=n, events=(event,), seed=n)
        rows += read_manifest(root).to_dict("records")
    write_manifest(root, rows)
    return root


@pytest.mark.parametrize("seed", [0, 1, 14])
def test_stratify_event_deals_every_event_round_the_folds(tmp_path, seed):
    store = uneven_store(tmp_path / "chips")
    manifest = read_manifest(store)
    splits = assign_folds(manifest, folds=5, by="tile", seed=seed, stratify="event")
    per = splits.groupby(["event", "fold"])["tile"].nunique().unstack(fill_value=0)
    for event, row in per.iterrows():
        n_tiles = manifest.loc[manifest["event"] == event, "tile"].nunique()
        if n_tiles >= 5:  # every fold holds tiles of it, as evenly as whole tiles allow
            assert (row > 0).all() and row.max() - row.min() <= 1, (event, row.tolist())
        else:  # each tile in a fold of its own
            assert int((row > 0).sum()) == n_tiles, (event, row.tolist())
    # the two small events take different folds: 2 + 3 tiles cover all 5 folds
    small = per.loc[["volcano-c", "tornado-d"]]
    assert ((small > 0).sum(axis=0) == 1).all(), small
    # by class alone the same tiles do not deal every event round the folds
    by_class = assign_folds(manifest, folds=5, by="tile", seed=seed)
    counts = by_class.groupby(["event", "fold"])["tile"].nunique().unstack(fill_value=0)
    assert counts.loc["flood-b"].max() - counts.loc["flood-b"].min() > 1 or (
        counts.loc[["volcano-c", "tornado-d"]].gt(0).sum(axis=0).max() > 1
    )


def test_stratify_class_is_the_default_and_unknown_is_refused(store):
    manifest = read_manifest(store)
    default = assign_folds(manifest, folds=5, by="tile", seed=2)
    explicit = assign_folds(manifest, folds=5, by="tile", seed=2, stratify="class")
    assert default.equals(explicit)
    with pytest.raises(SplitError, match="unknown split --stratify 'tiles'"):
        assign_folds(manifest, folds=5, by="tile", seed=2, stratify="tiles")


def test_inner_folds_never_hold_the_outer_test_fold(store):
    make_splits(store, folds=5, by="tile", seed=0, stratify="event", verbose=False)
    splits, manifest = load_splits(store), read_manifest(store)
    for outer in range(5):
        inner = inner_folds(splits, manifest, outer, folds=3, seed=1)
        test_ids = set(splits.loc[splits["fold"] == outer, "chip_id"])
        assert set(inner["chip_id"]) == set(manifest["chip_id"]) - test_ids
        assert sorted(inner["fold"].unique()) == [0, 1, 2]
        assert (inner.groupby("tile")["fold"].nunique() == 1).all()
    with pytest.raises(SplitError, match="no outer fold 7"):
        inner_folds(splits, manifest, 7, folds=3)
    with pytest.raises(SplitError, match="inner folds of outer fold 0"):
        inner_folds(splits, manifest, 0, folds=500)


def test_inner_folds_by_event_hold_out_the_largest_events_in_turn(store):
    from data_prep.split import inner_event_folds

    make_splits(store, folds=5, by="tile", seed=0, stratify="event", verbose=False)
    splits, manifest = load_splits(store), read_manifest(store)
    inner = inner_event_folds(splits, manifest, 0, folds=2)
    test_ids = set(splits.loc[splits["fold"] == 0, "chip_id"])
    assert set(inner["chip_id"]) == set(manifest["chip_id"]) - test_ids
    assert sorted(inner["fold"].unique()) == [-1, 0, 1]  # three events: the smallest never out
    training = manifest[~manifest["chip_id"].isin(test_ids) & (manifest["label"] >= 0)]
    counts = training.groupby("event").size()
    ranked = sorted(counts.index, key=lambda e: (-counts[e], e))
    for j in (0, 1):
        assert set(inner.loc[inner["fold"] == j, "event"]) == {ranked[j]}
    assert set(inner.loc[inner["fold"] == -1, "event"]) == {ranked[2]}
    assert (inner["group"] == inner["event"]).all()
    with pytest.raises(SplitError, match="4 events to hold out in turn.*labelled buildings of 3"):
        inner_event_folds(splits, manifest, 0, folds=4)
    with pytest.raises(SplitError, match="no outer fold 9"):
        inner_event_folds(splits, manifest, 9, folds=2)
