"""The few-shot report's settings, its files, and the chips they deal out: the events of a store,
the base model's training and validation chips, and the size of an event's label pool.

Torch-free, so that the command line reads its defaults from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.adapt.fit import AdaptError, check_rule
from data_prep.errors import LocalDamageError
from data_prep.store import MANIFEST, read_manifest

FEWSHOT_JSON = "fewshot.json"
FEWSHOT_MD = "fewshot.md"
FEWSHOT_PNG = "fewshot.png"
#: Written in a base run folder: the chips it was trained and validated on.
BASE_SPLIT = "fewshot-split.json"
#: Written in an event's folder: its measurements and the settings they were made with.
EVENT_JSON = "measurements.json"
#: Changes whenever what the arms measure changes, so that older measurements are not reused.
MEASURE_VERSION = 9  # 2: suggested labels in rounds; 4: random first round, then mixed;
# 5: the never-worse choice of heads, fine-tuning as adapt --finetune, and the semi arm;
# 6: the rule also refuses a candidate whose accuracy or intact recall falls; 7: --draw;
# 8: intact buildings called damaged, and fine-tuning's seconds; 9: the heads judged against
# the recalibrated base model, labels of several tiles cross-validated by tile
DEFAULT_K = (0, 5, 10, 20, 50, 100)
#: How the held-out event's buildings are split into the labels' pool and the graded rest:
#: at random, or by area (whole spatial blocks of tiles: an analyst labels the first
#: neighbourhoods and the tool grades the others).
DRAWS = ("random", "area")
DEFAULT_CONFIG = "configs/default.yaml"


class FewShotError(LocalDamageError, ValueError):
    """Input the report cannot run on; the message names the file and the problem."""


@dataclass
class Settings:
    """What the measurements depend on besides the base model."""

    k: list[int]
    repeats: int = 5
    seed: int = 0
    finetune_epochs: int = 8
    tune_k: list[int] | None = None
    val_share: float = 0.1
    pool_share: float = 0.5
    min_eval: int = 20
    unlabelled: str = "discount"
    draw: str = "random"

    def check(self) -> None:
        if not self.k or any(k < 0 for k in self.k):
            raise FewShotError(f"--k must list numbers of labels >= 0, got {self.k}")
        if self.repeats < 1:
            raise FewShotError(f"--repeats must be at least 1, got {self.repeats}")
        if self.finetune_epochs < 0:
            raise FewShotError(f"--finetune-epochs must be >= 0, got {self.finetune_epochs}")
        if not 0 <= self.val_share < 1:
            raise FewShotError(f"--val-share must lie in [0, 1), got {self.val_share}")
        if not 0 < self.pool_share < 1:
            raise FewShotError(f"--pool-share must lie in (0, 1), got {self.pool_share}")
        if self.draw not in DRAWS:
            raise FewShotError(f"--draw must be one of {', '.join(DRAWS)}, got {self.draw!r}")
        if self.min_eval < 1:
            raise FewShotError(f"--min-eval must be at least 1, got {self.min_eval}")
        try:
            check_rule(self.unlabelled)
        except AdaptError as exc:
            raise FewShotError(f"--unlabelled: {exc}") from exc


def store_events(chips: str | Path):
    """The labelled rows of the store's manifest and its events, in order of name.

    Raises:
        FewShotError: no manifest, no event column, no labelled chip with an event name.
    """
    path = Path(chips) / MANIFEST
    try:
        frame = read_manifest(chips)
    except FileNotFoundError as exc:
        raise FewShotError(str(exc)) from exc
    if "event" not in frame.columns:
        raise FewShotError(f"{path}: no event column; the report holds out events")
    frame = frame[(frame["label"] >= 0) & (frame["event"].str.strip() != "")]
    events = sorted(set(frame["event"]))
    if not events:
        raise FewShotError(
            f"{path}: no labelled chip with an event name; the report holds out events of a "
            "labelled store (`local-damage prepare xbd` records them)"
        )
    return frame.reset_index(drop=True), events


def pool_size(n: int, settings: Settings) -> int | None:
    """How many of an event's ``n`` labelled buildings form the pool the labels come from, or
    None when the event is too small (fewer than max k + ``min_eval``)."""
    need = max(settings.k) + settings.min_eval
    if n < need:
        return None
    return int(min(max(max(settings.k), round(settings.pool_share * n)), n - settings.min_eval))


def base_split(frame, event: str, val_share: float, seed: int) -> tuple[list[str], list[str]]:
    """``(train_ids, val_ids)``: the labelled chips of every event but ``event``, whole tiles in
    a seeded random order moved to validation until ``val_share`` of the chips is reached (at
    least one tile stays in training)."""
    other = frame[frame["event"] != event]
    if val_share <= 0 or other.empty:
        return other["chip_id"].tolist(), []
    tiles = sorted(set(other["tile"])) if "tile" in other.columns else []
    rng = np.random.default_rng(seed)
    order = [tiles[i] for i in rng.permutation(len(tiles))]
    sizes = other.groupby("tile").size()
    val, taken = set(), 0
    for tile in order[:-1]:
        if taken >= val_share * len(other):
            break
        val.add(tile)
        taken += int(sizes[tile])
    is_val = other["tile"].isin(val)
    return other.loc[~is_val, "chip_id"].tolist(), other.loc[is_val, "chip_id"].tolist()
