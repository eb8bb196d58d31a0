"""The one grade step of every scoring source: buildings and their chips in, scores out.

A source (:func:`app.scoring.xbd.score_xbd`: an xBD tile and its label polygons;
:func:`app.scoring.scene.score_scene`: a georeferenced scene and its footprints; through them
the buildings the localiser found, :mod:`app.scoring.detect`) yields one :class:`Building` per
feature, cut or with the reason it was not; :class:`Grading` grades the cut ones a batch at a
time, flags them (:mod:`runtime.flags`), flags oversized detected buildings, counts the grades,
judges the scene's familiarity (:mod:`runtime.familiarity`) and checks the order of pre and post
(:mod:`app.scoring.order`). :func:`app.scoring.writer.write_outputs` then writes every output.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from app.scoring.common import (
    DETECTED,
    GIVEN,
    NOT_COVERED,
    SCORED,
    SKIPPED,
    ScoreOptions,
    ScoreReport,
    Scores,
    grade_rule,
)
from app.scoring.order import OrderCheck, OrderSample, check_order
from data_prep.report import Skipped
from data_prep.timing import StageTimes
from runtime.familiarity import judge_scene, reference_of
from runtime.flags import OVERSIZED as OVERSIZED_FLAG
from runtime.flags import Flagger, flags_text, parse_flags
from runtime.grading import check_cost, grades, resolve_cost

if TYPE_CHECKING:
    from runtime.predictor import Predictor


@dataclass(frozen=True)
class Origin:
    """Where a scene's buildings came from, as its outputs and report name them.

    Attributes:
        source: the output ``source`` of every building: ``given`` footprints, or ``detected``
            by the localiser (:mod:`app.scoring.detect`).
        item: how the report names a building before its uid (None: the input file's default,
            e.g. ``<labels> building``); detection names the imagery, not its temporary file.
    """

    source: str = GIVEN
    item: str | None = None

    def __post_init__(self) -> None:
        if self.source not in (GIVEN, DETECTED):
            raise ValueError(f"source must be {GIVEN!r} or {DETECTED!r}, got {self.source!r}")


@dataclass(frozen=True)
class Building:
    """One feature of a source, as the grade step takes it.

    Attributes:
        row: the feature's row in the source (and the outputs).
        item: how the report names it (``<file> feature <uid>``).
        status: ``scored`` (its chips are cut: grade it), ``not_covered`` or ``skipped``.
        reason: why it was skipped (``status`` ``skipped``).
        pre, post: its chips, uint8 [S, S, 3] (``status`` ``scored``).
        context_px: the residual shift measured on the imagery around it
            (:func:`data_prep.residual.context_residual`; None: the chips alone are measured).
    """

    row: int
    item: str
    status: str = SCORED
    reason: str = ""
    pre: np.ndarray | None = None
    post: np.ndarray | None = None
    context_px: float | None = None


def new_report(name: str, predictor: Predictor, options: ScoreOptions) -> ScoreReport:
    """The empty report of a scene about to be graded with ``options``."""
    return ScoreReport(
        scene=name,
        class_names=tuple(predictor.class_names),
        grade_rule=grade_rule(options.false_alarm_cost, predictor.false_alarm_cost),
    )


class Grading:
    """Grades a scene's buildings into :attr:`scores` and fills its report.

    Args:
        predictor: the loaded model.
        report: the scene's report (:func:`new_report`).
        n: the scene's features (rows of the outputs).
        options: batch size, grade rule and oversized limit (:class:`ScoreOptions`).
        source: the output ``source`` of every building.
        timer: the stage times of the scene (``infer``, ``flags``, ``order``).
    """

    def __init__(
        self,
        predictor: Predictor,
        report: ScoreReport,
        n: int,
        options: ScoreOptions,
        source: str = GIVEN,
        timer: StageTimes | None = None,
    ):
        self.predictor, self.report, self.options = predictor, report, options
        report.buildings = n
        self.scores = Scores(n, len(report.class_names), source)
        self.batcher = Batcher(
            predictor,
            self.scores,
            options.batch_size,
            timer,
            resolve_cost(options.false_alarm_cost, predictor.false_alarm_cost),
        )

    def run(self, buildings: Iterable[Building]) -> Scores:
        """Grade every cut building (a batch at a time) and record why the others were not."""
        scores, report = self.scores, self.report
        for b in buildings:
            if b.status == SCORED:
                self.batcher.add(b.row, b.pre, b.post, b.context_px)
            elif b.status == SKIPPED:
                scores.skip(b.row, b.reason)
                report.skipped.append(Skipped(b.item, b.reason))
            else:
                scores.status[b.row] = NOT_COVERED
        self.batcher.flush()
        return scores

    def finish(
        self,
        areas_px: Callable[[], np.ndarray],
        pre: Sequence[str | os.PathLike],
        post: Sequence[str | os.PathLike],
        opened: dict | None = None,
    ) -> Scores:
        """After :meth:`run`: flag oversized detected buildings (``areas_px()``: every
        feature's pixels, see :func:`flag_oversized`), count the grades, judge the scene's
        familiarity and check the order of the ``pre`` and ``post`` files (``opened``: their
        open datasets, as :func:`app.scoring.order.check_order` takes them)."""
        scores, report = self.scores, self.report
        flag_oversized(report, scores, areas_px, self.options.largest_building_px)
        report_counts(report, scores)
        with self.batcher.timer.stage("order"):
            order = check_order(
                pre,
                post,
                self.predictor,
                self.batcher.sample,
                scores.most_probable(),
                self.options.batch_size,
                opened,
            )
        record_order(report, order)
        return scores


class Batcher:
    """Collects chip pairs, grades them ``batch_size`` at a time and flags them; keeps a sample
    of them for the order check (:class:`app.scoring.order.OrderSample`)."""

    def __init__(
        self,
        predictor: Predictor,
        scores: Scores,
        batch_size: int,
        timer: StageTimes | None = None,
        false_alarm_cost: float = 1.0,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.predictor, self.scores, self.batch_size = predictor, scores, batch_size
        self.false_alarm_cost = check_cost(false_alarm_cost)
        self.timer = timer if timer is not None else StageTimes()
        self.flagger = Flagger(predictor.metadata)
        if self.flagger.ood is not None:
            scores.reference = reference_of(self.flagger.ood.block)
        self.rows: list[int] = []
        self.pre: list[np.ndarray] = []
        self.post: list[np.ndarray] = []
        self.context: list[float | None] = []
        self.sample = OrderSample()

    def add(
        self, row: int, pre: np.ndarray, post: np.ndarray, context_px: float | None = None
    ) -> None:
        """Queue a chip pair; ``context_px`` is its residual shift measured on the imagery
        around the building (:func:`data_prep.residual.context_residual`), None when there is
        none (the chips alone are measured)."""
        self.rows.append(row)
        self.pre.append(pre)
        self.post.append(post)
        self.context.append(context_px)
        self.sample.offer(row, pre, post)
        if len(self.rows) >= self.batch_size:
            self.flush()

    def flush(self) -> None:
        """Grade and flag the queued chip pairs."""
        if not self.rows:
            return
        with self.timer.stage("infer"):
            pre, post = np.stack(self.pre), np.stack(self.post)
            sampled = self.sample.wanted(self.rows)
            pred = self.predictor.predict(
                pre, post, batch_size=self.batch_size, sides=bool(sampled)
            )
            if pred.sides is not None:  # the order check grades these exchanged from them
                self.sample.keep_sides(
                    [self.rows[i] for i in sampled], pred.sides[np.asarray(sampled)]
                )
            probs = np.asarray(pred.probabilities, dtype=np.float64)
            rows = np.asarray(self.rows)
            self.scores.probs[rows] = probs
            self.scores.class_id[rows] = grades(
                probs, self.predictor.class_names, self.false_alarm_cost
            )
            self.scores.status[rows] = SCORED
        with self.timer.stage("flags"):
            familiar = None  # each pair's ood score, which is also its familiarity
            if self.flagger.ood is not None and pred.embedding is not None:
                familiar = self.flagger.ood.scores(pred.embedding)
                self.scores.familiarity[rows] = familiar
            flags = self.flagger.batch(
                pre, post, pred.embedding, context_px=self.context, ood_scores=familiar
            )
            self.scores.flags[rows] = [flags_text(names) for names in flags]
        self.rows, self.pre, self.post, self.context = [], [], [], []


def record_order(report: ScoreReport, check: OrderCheck) -> None:
    """Put the order check into the report (its dict, and its warning when it looks reversed)."""
    report.order, report.order_warning = check.to_dict(), check.warning()


def flag_oversized(
    report: ScoreReport, scores: Scores, areas_px: Callable[[], np.ndarray], largest_px: int | None
) -> int:
    """Flag ``oversized`` the scored detected buildings whose footprint covers more than
    ``largest_px`` pixels of the pre imagery, and say so in the report's notes. Given footprints
    and ``largest_px`` None flag nothing. ``areas_px()`` gives every footprint's pixels (float
    [n], NaN where unknown); it is called only when there is something to flag.
    Returns how many were flagged."""
    if largest_px is None or scores.source != DETECTED:
        return 0
    areas = np.nan_to_num(np.asarray(areas_px(), dtype=np.float64), nan=0.0)
    rows = np.flatnonzero((scores.class_id >= 0) & (areas > largest_px))
    for row in rows:
        scores.flags[row] = flags_text(parse_flags(scores.flags[row]) + [OVERSIZED_FLAG])
    if len(rows):
        report.notes.append(
            f"{len(rows)} detected building(s) cover more than {largest_px:,} px, more than any "
            "building the localiser learnt from: flagged oversized (cloud, bare ground or "
            "merged roofs are likelier than one building; check them)"
        )
    return len(rows)


def report_counts(report: ScoreReport, scores: Scores) -> None:
    """Fill the report's per-class and not-covered counts from the scores, and judge the
    scene's familiarity when the model carries the reference (:mod:`runtime.familiarity`)."""
    for cid in scores.class_id[scores.class_id >= 0]:
        report.per_class[report.class_names[int(cid)]] += 1
    report.not_covered = int(np.sum(scores.status == NOT_COVERED))
    if scores.reference is not None:
        report.familiarity = judge_scene(scores.familiarity[scores.class_id >= 0], scores.reference)
