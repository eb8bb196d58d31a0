"""The machinery scene mode and xBD mode share: options, report, per-building scores and the
vector output.

- :class:`ScoreOptions`: how buildings are scored (batch size, block size, pixel limit,
  alignment, progress bars), one object for `score`, `score-batch`, xBD mode and the web app.
- :class:`ScoreReport`: what scoring one scene produced.
- :class:`Scores` holds the per-feature results (:mod:`app.scoring.grade` fills them).
- :func:`write_features`: the input features with their score columns, as GeoJSON or GeoPackage
  (:func:`app.scoring.outputs.write_vector`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from app.scoring.outputs import OutputError, vector_format, write_vector
from data_prep.grid import reproject_geometries
from data_prep.quality import BLANK
from data_prep.report import Skipped
from data_prep.timing import stage_table
from runtime.familiarity import scene_warning
from runtime.flags import BLANK as BLANK_FLAG
from runtime.grading import check_cost, resolve_cost, rule_text

if TYPE_CHECKING:
    from runtime.predictor import Predictor

#: ``status`` of a building that was graded.
SCORED = "scored"
#: ``status`` of a building not entirely inside valid pre and post imagery.
NOT_COVERED = "not_covered"
#: ``status`` prefix of a building left out, followed by the reason.
SKIPPED = "skipped"
#: GeoTIFF suffixes of input imagery and of the class raster output.
RASTER_SUFFIXES = (".tif", ".tiff")
#: Default side, in grid pixels, of the blocks whose buildings share one read.
BLOCK_SIZE = 1024
#: GDAL raster block cache while scoring, in MiB, unless GDAL_CACHEMAX is set in the environment.
#: GDAL's own default (5% of RAM) lets the cache of decoded blocks grow with the scene.
GDAL_CACHE_MB = 16
#: Output metadata key (GeoPackage layer metadata, GeoJSON collection member) of the alignment.
ALIGNMENT_KEY = "local_damage_alignment"
#: Output metadata key of the order check, written only when pre and post look exchanged.
ORDER_KEY = "local_damage_order"
#: Output metadata key of the grade rule, written only when grades are not the most probable ones.
GRADES_KEY = "local_damage_grades"
#: Output metadata key of the scene's familiarity (:mod:`runtime.familiarity`), written when the
#: model carries the reference.
FAMILIARITY_KEY = "local_damage_familiarity"
#: The stages of a scoring run, in the order they happen (:attr:`ScoreReport.stages`).
STAGES = ("open", "plan", "align", "read", "cut", "context", "infer", "flags", "order", "outputs")


#: ``source`` of a building whose footprint was supplied.
GIVEN = "given"
#: ``source`` of a building found by the localiser (:mod:`app.scoring.detect`).
DETECTED = "detected"


@dataclass(frozen=True)
class ScoreOptions:
    """How buildings are scored; the inputs and outputs are the scoring function's arguments.

    Attributes:
        batch_size: chips per inference batch.
        block_size: scene mode: side in grid pixels of the blocks whose buildings share one read
            (memory grows with its square, not with the scene); also the blocks the localiser
            reads when it finds the buildings.
        max_pixels: pixel limit per image, internal block and read window, checked before
            decoding (None: :func:`data_prep.quality.max_pixels`).
        align: ``auto`` (measure the post-to-pre shift, correct it when confident) or ``off``.
        progress: show progress bars.
        profile: keep the seconds of every stage in the report (:attr:`ScoreReport.stages`),
            which its summary and its dict then show.
        false_alarm_cost: a damaged grade only where at least this many times as probable as
            no-damage (:mod:`runtime.grading`; 1: the most probable grade); None: the model's
            own rule (its ``grade_rule`` metadata, :attr:`runtime.predictor.Predictor.false_alarm_cost`).
        largest_building_px: buildings the localiser found (``source`` ``detected``) whose
            footprint covers more pixels of the pre imagery than this are flagged ``oversized``:
            larger than any building the localiser learnt from (its metadata's
            ``largest_building_px``; None: no such flag). Given footprints are never flagged.
    """

    batch_size: int = 32
    block_size: int = BLOCK_SIZE
    max_pixels: int | None = None
    align: str = "auto"
    progress: bool = True
    profile: bool = False
    false_alarm_cost: float | None = None
    largest_building_px: int | None = None

    def __post_init__(self) -> None:
        if self.false_alarm_cost is not None:
            check_cost(self.false_alarm_cost)
        if self.largest_building_px is not None and not self.largest_building_px > 0:
            raise ValueError(
                f"largest_building_px must be positive, got {self.largest_building_px!r}"
            )


@contextmanager
def bounded_gdal_cache():
    """A rasterio environment whose GDAL block cache is :data:`GDAL_CACHE_MB` MiB (or, when
    the environment variable is set, ``GDAL_CACHEMAX``)."""
    import rasterio

    if os.environ.get("GDAL_CACHEMAX"):
        with rasterio.Env():
            yield
        return
    with rasterio.Env(GDAL_CACHEMAX=GDAL_CACHE_MB * 2**20):
        yield


@dataclass
class ScoreReport:
    """What scoring one scene produced.

    Attributes:
        scene: scene name.
        class_names: the model's classes.
        buildings: features in the input (one output feature each).
        per_class: scored buildings per predicted class name.
        not_covered: buildings not entirely inside valid pre and post imagery.
        skipped: buildings and tiles left out, with the reason.
        outputs: kind (``vector``, ``raster``, ``overlay``) -> path written.
        seconds: wall time of the whole scene (chips, inference and writing).
        alignment: the post-to-pre shift measured and whether it was corrected
            (:meth:`data_prep.alignment.SceneShift.to_dict`).
        detected: buildings found by the localiser when no footprints were given (None when
            footprints were given; :mod:`app.scoring.detect`).
        notes: lines the summary gives first (e.g. a label file without buildings).
        order: the check of whether pre and post look exchanged
            (:meth:`app.scoring.order.OrderCheck.to_dict`); ``order_warning`` its warning line,
            empty when the order looks right.
        stages: seconds per stage of the run (``open``, ``align``, ``plan``, ``read``, ``cut``,
            ``context``, ``infer``, ``flags``, ``order``, ``outputs``), only when asked for
            (:attr:`ScoreOptions.profile`); empty otherwise.
        grade_rule: ``{"false_alarm_cost", "rule", "set_by"}`` when grades were not the most
            probable ones (:func:`grade_rule`); None otherwise.
        familiarity: how familiar the scene's buildings are to the model
            (:func:`runtime.familiarity.judge_scene`); None when the model carries no reference.
    """

    scene: str
    class_names: tuple[str, ...]
    buildings: int = 0
    per_class: Counter = field(default_factory=Counter)
    not_covered: int = 0
    skipped: list[Skipped] = field(default_factory=list)
    outputs: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    alignment: dict | None = None
    alignment_text: str = ""
    detected: int | None = None
    notes: list[str] = field(default_factory=list)
    order: dict | None = None
    order_warning: str = ""
    stages: dict[str, float] = field(default_factory=dict)
    grade_rule: dict | None = None
    familiarity: dict | None = None

    @property
    def scored(self) -> int:
        return int(sum(self.per_class.values()))

    @property
    def familiarity_warning(self) -> str:
        """The warning of an unfamiliar scene (:func:`runtime.familiarity.scene_warning`)."""
        return scene_warning(self.familiarity)

    @property
    def buildings_per_second(self) -> float:
        return self.buildings / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        out = {
            "scene": self.scene,
            "buildings": self.buildings,
            "scored": self.scored,
            "per_class": {name: self.per_class.get(name, 0) for name in self.class_names},
            "not_covered": self.not_covered,
            "skipped": [{"item": s.item, "reason": s.reason} for s in self.skipped],
            "outputs": dict(self.outputs),
            "seconds": round(self.seconds, 3),
            "buildings_per_second": round(self.buildings_per_second, 2),
            "scored_per_second": round(self.scored / self.seconds if self.seconds > 0 else 0.0, 2),
            "alignment": self.alignment,
            "detected": self.detected,
            "order": self.order,
            "notes": list(self.notes),
        }
        if self.stages:
            out["stages"] = dict(self.stages)
        if self.grade_rule:
            out["grade_rule"] = dict(self.grade_rule)
        if self.familiarity is not None:
            out["familiarity"] = dict(self.familiarity)
        return out

    def summary(self) -> str:
        lines = [
            f"scene {self.scene}: {self.buildings} building(s), {self.scored} scored in "
            f"{self.seconds:.1f} s ({self.buildings_per_second:.1f} buildings/s, "
            f"{self.scored / self.seconds if self.seconds > 0 else 0.0:.1f} scored/s)",
            "per class: " + ", ".join(f"{n} {self.per_class.get(n, 0)}" for n in self.class_names),
        ]
        lines[1:1] = self.notes
        if self.grade_rule:
            own = self.grade_rule.get("set_by") == "model"
            lines.insert(
                1,
                f"grades: {self.grade_rule['rule']}"
                + (
                    " (the model's own rule; --false-alarm-cost 1: the most probable)"
                    if own
                    else ""
                ),
            )
        if self.detected is not None:
            lines.insert(0, f"no footprints given: {self.detected} building(s) detected")
        if self.order_warning:
            lines.append(self.order_warning)
        if self.familiarity_warning:
            lines.append(self.familiarity_warning)
        if self.alignment_text:
            lines.append(self.alignment_text)
        if self.not_covered:
            lines.append(f"not covered by both pre and post imagery: {self.not_covered}")
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} item(s):")
            lines.extend(f"  - {s}" for s in self.skipped)
        lines.extend(f"wrote {path}" for path in self.outputs.values())
        if self.stages:
            lines.append(f"stages of the {self.seconds:.2f} s:")
            lines.extend(stage_table(self.stages, self.seconds, self.buildings, order=STAGES))
        return "\n".join(lines)


def grade_rule(false_alarm_cost: float | None, model_cost: float = 1.0) -> dict | None:
    """What a report and the outputs record of the grade rule, given the analyst's cost (None:
    none set) and the model's own (:attr:`runtime.predictor.Predictor.false_alarm_cost`): None
    for the most probable grade, else ``{"false_alarm_cost", "rule", "set_by"}``, ``set_by``
    ``"model"`` (its own rule) or ``"analyst"``."""
    cost = resolve_cost(false_alarm_cost, model_cost)
    if cost == 1.0:
        return None
    set_by = "model" if false_alarm_cost is None else "analyst"
    return {"false_alarm_cost": cost, "rule": rule_text(cost), "set_by": set_by}


def probability_columns(class_names: Sequence[str]) -> list[str]:
    """Output column of each class probability: ``p_`` + the name with ``-`` as ``_``."""
    return ["p_" + name.replace("-", "_").replace(" ", "_") for name in class_names]


def check_outputs(
    out: str | os.PathLike,
    raster: str | os.PathLike | None = None,
    overlay: str | os.PathLike | None = None,
) -> str:
    """Validate output paths before any work; returns the vector format.

    Raises:
        OutputError: an unknown vector suffix, a raster that is not ``.tif``/``.tiff`` or an
            overlay that is not ``.png``.
    """
    fmt = vector_format(out)
    if raster is not None and Path(raster).suffix.lower() not in RASTER_SUFFIXES:
        raise OutputError(f"{raster}: the class raster is a GeoTIFF; give a .tif path")
    if overlay is not None and Path(overlay).suffix.lower() != ".png":
        raise OutputError(f"{overlay}: the overlay is written as PNG; give a .png path")
    return fmt


class Scores:
    """Per-feature results: status text, class id (-1 unscored), probabilities (NaN) and
    flags (``;``-joined, empty when none) of ``n`` features and ``k`` classes."""

    def __init__(self, n: int, k: int, source: str = "given"):
        self.status = np.full(n, NOT_COVERED, dtype=object)
        self.class_id = np.full(n, -1, dtype=np.int64)
        self.probs = np.full((n, k), np.nan, dtype=np.float64)
        self.flags = np.full(n, "", dtype=object)
        # largest cosine to a class prototype (runtime.familiarity), NaN unscored or no prototypes
        self.familiarity = np.full(n, np.nan, dtype=np.float64)
        # the model's reference the scene's familiarity is judged against (None: not judged)
        self.reference: dict | None = None
        # where the buildings came from: given or detected (app.scoring.detect)
        self.source = source

    def most_probable(self) -> np.ndarray:
        """The most probable class id of every scored feature (-1 unscored), whatever grade
        rule gave :attr:`class_id`: the order check compares like with like."""
        scored = self.class_id >= 0
        out = np.full(len(self.class_id), -1, dtype=np.int64)
        out[scored] = self.probs[scored].argmax(axis=1)
        return out

    def skip(self, row: int, reason: str) -> None:
        """Mark a building not scored for ``reason``; a blank chip is also flagged ``blank``."""
        self.status[row] = f"{SKIPPED}: {reason}"
        if reason.startswith(BLANK):
            self.flags[row] = BLANK_FLAG

    def columns(self, class_names: Sequence[str]) -> tuple[dict, dict]:
        """``(columns, masks)``: the output score columns and where each is null."""
        unscored = self.class_id < 0
        names = np.array(list(class_names), dtype=object)
        damage = np.where(unscored, None, names[np.clip(self.class_id, 0, len(names) - 1)])
        cols: dict[str, np.ndarray] = {
            "damage": damage.astype(object),
            "damage_id": np.where(unscored, 0, self.class_id).astype(np.int32),
        }
        masks: dict[str, np.ndarray] = {"damage": unscored, "damage_id": unscored}
        for j, col in enumerate(probability_columns(class_names)):
            cols[col] = np.where(unscored, 0.0, np.round(self.probs[:, j], 6))
            masks[col] = unscored
        cols["confidence"] = np.where(
            unscored, 0.0, np.round(np.nan_to_num(self.probs).max(axis=1), 6)
        )
        masks["confidence"] = unscored
        cols["flags"] = self.flags.astype(object)
        cols["status"] = self.status.astype(object)
        cols["source"] = np.full(len(self.status), self.source, dtype=object)
        return cols, masks


@contextmanager
def all_or_nothing(report: ScoreReport):
    """Remove the outputs already written for a scene when a later step fails."""
    try:
        yield
    except BaseException:
        for path in report.outputs.values():
            Path(path).unlink(missing_ok=True)
        report.outputs.clear()
        raise


def to_crs(geometries: np.ndarray, src, dst) -> np.ndarray:
    """Reproject geometries (None kept); those that cannot be transformed become None."""
    import shapely

    out = np.empty(len(geometries), dtype=object)
    present = np.array([g is not None for g in geometries], dtype=bool)
    if present.any():
        moved = reproject_geometries(geometries[present], src, dst)
        finite = np.isfinite(shapely.bounds(moved)).all(axis=1)
        out[np.flatnonzero(present)] = np.where(finite, moved, None)
    return out


def image_georef(path: str | os.PathLike):
    """(crs, transform) of a georeferenced image, (None, None) for a plain pixel image."""
    import warnings

    import rasterio
    from rasterio.errors import NotGeoreferencedWarning, RasterioError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGeoreferencedWarning)
            with rasterio.open(path) as ds:
                if ds.crs is not None and not ds.transform.is_identity:
                    return ds.crs, ds.transform
    except RasterioError:
        pass
    return None, None


def _merge_attributes(
    attributes: Mapping[str, np.ndarray], score_columns: Mapping[str, np.ndarray]
) -> tuple[dict, dict[str, str]]:
    """Input attributes first, renamed ``input_<name>`` where an output column takes the name."""
    taken = {c.lower() for c in score_columns}
    merged: dict[str, np.ndarray] = {}
    renamed: dict[str, str] = {}
    for name, values in attributes.items():
        new = name
        while new.lower() in taken or new.lower() in {m.lower() for m in merged}:
            new = f"input_{new}"
        if new != name:
            renamed[name] = new
        merged[new] = values
    return merged, renamed


def _model_metadata(predictor: Predictor, report: ScoreReport | None = None) -> dict[str, str]:
    try:
        card = predictor.card()
    except Exception:  # the card is informative only
        card = {}
    out = {"local_damage_model": json.dumps(card, default=str, sort_keys=True)}
    if report is not None and report.alignment is not None:
        out[ALIGNMENT_KEY] = json.dumps(report.alignment, sort_keys=True)
    if report is not None and report.order_warning:
        out[ORDER_KEY] = json.dumps(report.order, sort_keys=True)
    if report is not None and report.grade_rule:
        out[GRADES_KEY] = json.dumps(report.grade_rule, sort_keys=True)
    if report is not None and report.familiarity is not None:
        out[FAMILIARITY_KEY] = json.dumps(report.familiarity, sort_keys=True)
    return out


def _members(report: ScoreReport) -> dict | None:
    """GeoJSON collection members: the alignment, the order check when it warns, the grade rule
    and the scene's familiarity."""
    members = {}
    if report.alignment is not None:
        members[ALIGNMENT_KEY] = report.alignment
    if report.order_warning:
        members[ORDER_KEY] = report.order
    if report.grade_rule:
        members[GRADES_KEY] = report.grade_rule
    if report.familiarity is not None:
        members[FAMILIARITY_KEY] = report.familiarity
    return members or None


def write_features(
    out: str | os.PathLike,
    geometries: np.ndarray,
    crs,
    attributes: Mapping[str, np.ndarray],
    attr_masks: Mapping[str, np.ndarray],
    scores: Scores,
    report: ScoreReport,
    predictor: Predictor,
) -> None:
    """Write the vector output of a scored scene: input attributes, then the score columns.

    Args:
        out: ``.geojson`` or ``.gpkg`` path (the layer is named after ``report.scene``).
        geometries: [N] shapely geometries in ``crs`` (None where a feature has none).
        crs: their CRS (None: pixel coordinates, GeoPackage only).
        attributes, attr_masks: the input attributes and where each is null.
        scores: the per-feature results.
        report: the scene's report; its alignment (and its order check when pre and post look
            exchanged) goes into the file's metadata and the written path into its outputs.
        predictor: the model, whose card goes into the file's metadata.
    """
    score_cols, score_masks = scores.columns(report.class_names)
    attrs, renamed = _merge_attributes(attributes, score_cols)
    masks = {renamed.get(k, k): v for k, v in attr_masks.items()}
    masks.update(score_masks)
    write_vector(
        out,
        geometries,
        crs,
        {**attrs, **score_cols},
        masks,
        layer=report.scene,
        metadata=_model_metadata(predictor, report),
        collection_members=_members(report),
    )
    report.outputs["vector"] = str(out)
