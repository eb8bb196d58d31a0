"""Which tiles a model was trained on, so that figures computed on them are marked as in-sample
and kept out of comparisons with published figures (no torch).

A model exported by this version lists its training tiles in its metadata
(``training_data.train_tiles``, as the building localiser always has), and a model adapted by
``local-damage adapt`` adds the tiles of its labels (``adaptation.labels.tiles``). For an older
model that
lists only its chip store and validation fold, the tiles are read from that store's
``splits.csv`` when it is at hand: every tile outside the validation fold (and outside the
run's held-out fold, when the run folder says which) counts as trained on, which can only mark
too many. Otherwise they are unknown, and every report that shows figures says so.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_prep.split import SPLITS, load_splits
from data_prep.store import StoreError

#: How a figure computed on a model's training tiles is marked, everywhere.
IN_TRAINING = "in the model's training data"
#: Why such a figure says nothing next to a published one.
NOT_COMPARABLE = (
    "figures on tiles a model trained on are in-sample: they do not measure it on new imagery, "
    "and published test-set figures cannot be compared with them"
)


@dataclass(frozen=True)
class TrainingTiles:
    """The tiles a model was trained on (tile names, ``<event>_<id>`` for xBD).

    Attributes:
        tiles: the tile names; None when they are unknown.
        source: where they come from, or why they are unknown, in words.
    """

    tiles: frozenset[str] | None
    source: str

    @property
    def known(self) -> bool:
        return self.tiles is not None

    def among(self, tiles: Iterable[str]) -> list[str] | None:
        """Those of ``tiles`` the model trained on, sorted; None when that is unknown."""
        if self.tiles is None:
            return None
        return sorted({str(t) for t in tiles} & self.tiles)

    def union(self, other: TrainingTiles) -> TrainingTiles:
        """The tiles either model trained on (a damage model and its localiser); unknown when
        either is."""
        if self.tiles is None:
            return self
        if other.tiles is None:
            return other
        return TrainingTiles(self.tiles | other.tiles, f"{self.source}; {other.source}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "known": self.known,
            "tiles": None if self.tiles is None else len(self.tiles),
            "source": self.source,
        }


def training_tiles(metadata: Mapping[str, Any], what: str = "model") -> TrainingTiles:
    """The training tiles of a model from its parsed metadata props.

    ``training_data.train_tiles`` when listed; else derived from the chip store's splits named
    in ``training_data.chips`` with the fold of ``validation_metrics`` (see the module
    docstring); else unknown. An adapted model adds the tiles of its head's labels (unknown when
    its ``adaptation`` block does not list them). ``what`` names the model in the description.
    """
    base = _network_tiles(metadata, what)
    adaptation = metadata.get("adaptation")
    if not isinstance(adaptation, Mapping):
        return base
    labels = adaptation.get("labels") if isinstance(adaptation.get("labels"), Mapping) else {}
    listed = labels.get("tiles")
    if not isinstance(listed, list):
        return TrainingTiles(
            None, f"the {what}'s adapted head does not record the tiles of its labels"
        )
    head = TrainingTiles(
        frozenset(map(str, listed)), f"its adapted head's labels lie on {len(listed)} tiles"
    )
    return base.union(head)


def _network_tiles(metadata: Mapping[str, Any], what: str) -> TrainingTiles:
    """The tiles the network (not an adapted head) was trained on (:func:`training_tiles`)."""
    info = metadata.get("training_data")
    info = info if isinstance(info, Mapping) else {}
    listed = info.get("train_tiles")
    if isinstance(listed, list):
        return TrainingTiles(
            frozenset(map(str, listed)), f"the {what}'s metadata lists {len(listed)} tiles"
        )
    chips = info.get("chips")
    validation = metadata.get("validation_metrics")
    fold = validation.get("fold") if isinstance(validation, Mapping) else None
    if chips and Path(str(chips), SPLITS).is_file():
        try:
            splits = load_splits(chips)
        except (StoreError, ValueError, OSError):
            splits = None
        if splits is not None:
            holdout = _run_holdout(metadata.get("run"))
            left_out = {f for f in (fold, holdout) if f is not None}
            tiles = frozenset(splits.loc[~splits["fold"].isin(left_out), "tile"].astype(str))
            outside = " and ".join(f"fold {f}" for f in sorted(left_out)) or "no fold"
            return TrainingTiles(
                tiles,
                f"the {what}'s metadata lists no tiles; every tile of {Path(str(chips), SPLITS)} "
                f"outside {outside} ({len(tiles)} tiles) is taken as trained on",
            )
    return TrainingTiles(
        None,
        f"the {what}'s metadata does not list its training tiles"
        + (f", and {Path(str(chips), SPLITS)} is not here to tell them" if chips else ""),
    )


def run_training_tiles(summary: Mapping[str, Any], run: str | Path) -> TrainingTiles:
    """The training tiles of a run folder from its ``summary.json``: ``train_tiles`` when
    listed (runs of this version), else from its chip store's splits and folds."""
    listed = summary.get("train_tiles")
    if isinstance(listed, list):
        return TrainingTiles(
            frozenset(map(str, listed)), f"{Path(run) / 'summary.json'} lists {len(listed)} tiles"
        )
    metadata = {
        "training_data": {"chips": summary.get("chips")},
        "validation_metrics": {"fold": summary.get("fold")},
        "run": str(run),
    }
    return training_tiles(metadata, what="run")


def _run_holdout(run: Any) -> int | None:
    """The held-out fold recorded in a run folder's summary.json, when it can be read."""
    if not run:
        return None
    try:
        summary = json.loads((Path(str(run)) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    holdout = summary.get("holdout") if isinstance(summary, dict) else None
    return holdout if isinstance(holdout, int) else None
