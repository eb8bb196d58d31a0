"""Whether the pre and post imagery look exchanged: a check run with every scoring, no torch.

Given pre and post the wrong way round, the model still grades every building, and most of
them come out no-damage: nothing in the grades says the inputs were swapped. Two checks, the
first that can decide wins:

- **Acquisition dates** (:func:`date_order`): when both pre and post files carry the date they
  were taken in their metadata (GDAL's ``IMAGERY`` domain ``ACQUISITIONDATETIME``, tags such as
  ``ACQUISITION_DATE`` or ``DATE_ACQUIRED``, EXIF ``DateTimeOriginal``: :data:`DATE_KEYS`, read
  in every metadata namespace of every file), post taken before pre is known to be reversed, and
  pre before post known to be right. ``TIFFTAG_DATETIME`` records when a file was written (often
  its processing date), not when the image was taken, so it never decides; it is reported.
- **Both ways** (:func:`grade_order`): otherwise, a sample of at most :data:`SAMPLE_SIZE` graded
  buildings (:class:`OrderSample`, a seeded reservoir over the buildings as they are graded) is
  graded again with the same chips exchanged (post as pre, pre as post) by the same model.
  Damage is not undone in days, so the right order finds damage at least as often as the
  exchanged one; the order looks reversed when the exchanged grading finds most of the sample
  damaged (at least :data:`EXCHANGED_DAMAGED`) and clearly more of it than the given one (by at
  least :data:`MARGIN`), on at least :data:`MIN_SAMPLE` buildings. docs/scoring.md gives the
  figures these thresholds were chosen on. The sample is graded exchanged :data:`STEP`
  buildings at a time, and no further once the rest could not change the verdict.

The result is a warning, never a change: the grades stay those of the order given.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

#: Buildings graded a second time, exchanged (the check's extra inference, at most).
SAMPLE_SIZE = 64
#: Fewer graded buildings than this: no verdict from the grades.
MIN_SAMPLE = 10
#: Share of the sample the exchanged order must grade damaged to call the order reversed.
EXCHANGED_DAMAGED = 0.5
#: How much larger that share must be than the given order's.
MARGIN = 0.3
#: Seed of the sample.
SEED = 0
#: Sampled buildings graded exchanged between two looks at whether the rest could still matter.
STEP = 8
#: Metadata keys holding the date an image was taken, upper case without ``_``/``-``/spaces.
DATE_KEYS = (
    "ACQUISITIONDATETIME",
    "ACQUISITIONDATE",
    "ACQUISITIONSTARTTIME",
    "ACQUISITIONTIME",
    "DATEACQUIRED",
    "CAPTUREDATE",
    "CAPTUREDATETIME",
    "IMAGINGDATE",
    "FIRSTLINETIME",
    "SENSINGTIME",
    "EXIFDATETIMEORIGINAL",
    "EXIFDATETIMEDIGITIZED",
)
#: The file-writing time: reported, never decisive.
FILE_DATE_KEY = "TIFFTAG_DATETIME"

_DATE = re.compile(
    r"^\s*(\d{4})[-:/]?(\d{2})[-:/]?(\d{2})(?:[T _]?(\d{2}):?(\d{2})(?::?(\d{2}))?)?"
)


def parse_date(text: str) -> datetime | None:
    """A date from metadata text (``2011-05-23T17:01:02Z``, ``2011:05:23 17:01:02``,
    ``20110523``, ...; the time of day when given), None when it is not one."""
    m = _DATE.match(str(text))
    if not m:
        return None
    parts = [int(g) if g else 0 for g in m.groups()]
    try:
        return datetime(*parts)
    except ValueError:
        return None


def _norm(key: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", str(key).upper())


@dataclass(frozen=True)
class FileDate:
    """The date an image file says it was taken: the file, the metadata key, the date."""

    path: str
    key: str
    date: datetime

    def to_dict(self) -> dict:
        return {"file": self.path, "key": self.key, "date": self.date.isoformat()}


def file_dates(path: str | os.PathLike, dataset=None) -> tuple[FileDate | None, FileDate | None]:
    """``(acquired, written)``: the earliest acquisition date in any metadata namespace of a
    raster (:data:`DATE_KEYS`), and its ``TIFFTAG_DATETIME``; None where there is none or the
    file cannot be read. ``dataset``: the file already open in rasterio (it stays open)."""
    import rasterio
    from rasterio.errors import NotGeoreferencedWarning, RasterioError

    try:
        if dataset is not None:
            return _dates(str(path), dataset)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotGeoreferencedWarning)
            with rasterio.open(path) as ds:
                return _dates(str(path), ds)
    except (RasterioError, OSError):
        return None, None


def _dates(path: str, ds) -> tuple[FileDate | None, FileDate | None]:
    found: list[FileDate] = []
    written = None
    namespaces = [None, *(ds.tag_namespaces() or [])]
    for ns in namespaces:
        if ns is not None and ns.startswith(("DERIVED_SUBDATASETS", "xml:")):
            continue
        for key, value in (ds.tags(ns=ns) if ns else ds.tags()).items():
            date = parse_date(value)
            if date is None:
                continue
            name = f"{ns}:{key}" if ns else key
            if _norm(key) in DATE_KEYS:
                found.append(FileDate(path, name, date))
            elif key.upper() == FILE_DATE_KEY and written is None:
                written = FileDate(path, name, date)
    return (min(found, key=lambda d: d.date) if found else None), written


@dataclass
class DateOrder:
    """What the files' metadata say of the order.

    Attributes:
        pre, post: the acquisition date of each file that has one.
        written_pre, written_post: each file's ``TIFFTAG_DATETIME`` (never decisive).
        verdict: ``right`` (every pre taken before every post), ``reversed`` (every post before
            every pre), ``mixed`` (dates on both sides that overlap) or ``unknown`` (a side has
            no acquisition date).
    """

    pre: list[FileDate] = field(default_factory=list)
    post: list[FileDate] = field(default_factory=list)
    written_pre: list[FileDate] = field(default_factory=list)
    written_post: list[FileDate] = field(default_factory=list)
    verdict: str = "unknown"

    def to_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "pre": [d.to_dict() for d in self.pre],
            "post": [d.to_dict() for d in self.post],
            "written_pre": [d.to_dict() for d in self.written_pre],
            "written_post": [d.to_dict() for d in self.written_post],
        }


def date_order(
    pre: Sequence[str | os.PathLike],
    post: Sequence[str | os.PathLike],
    opened: Mapping[str, object] | None = None,
) -> DateOrder:
    """The order the acquisition dates in the pre and post files' metadata say; ``opened``
    maps a path (as text) to its file already open in rasterio, read instead of opening it
    again."""
    opened = opened or {}
    out = DateOrder()
    for paths, dated, written in (
        (pre, out.pre, out.written_pre),
        (post, out.post, out.written_post),
    ):
        for p in paths:
            acquired, made = file_dates(p, opened.get(str(p)))
            if acquired is not None:
                dated.append(acquired)
            if made is not None:
                written.append(made)
    if out.pre and out.post:
        first_pre, last_pre = min(d.date for d in out.pre), max(d.date for d in out.pre)
        first_post, last_post = min(d.date for d in out.post), max(d.date for d in out.post)
        if last_pre < first_post:
            out.verdict = "right"
        elif last_post < first_pre:
            out.verdict = "reversed"
        else:
            out.verdict = "mixed"
    return out


class OrderSample:
    """A seeded reservoir of at most ``size`` graded chip pairs, offered one at a time in the
    order the buildings are graded (every building equally likely to be kept).

    Besides its chips, a kept pair may be given its encoder output once graded
    (:meth:`keep_sides`); when every kept pair has it, the check grades them exchanged from it
    (:meth:`runtime.predictor.Predictor.exchanged`) instead of running the whole network again.
    """

    def __init__(self, size: int = SAMPLE_SIZE, seed: int = SEED):
        self.size = int(size)
        self.rng = np.random.default_rng(seed)
        self.seen = 0
        self.rows: list[int] = []
        self.pre: list[np.ndarray] = []
        self.post: list[np.ndarray] = []
        self.sides: list[np.ndarray | None] = []

    def offer(self, row: int, pre: np.ndarray, post: np.ndarray) -> None:
        """Consider one graded building (its row in the scores and its chips; a kept chip is
        copied, so a view never holds the image it was cut from)."""
        self.seen += 1
        if len(self.rows) < self.size:
            self.rows.append(int(row))
            self.pre.append(np.array(pre))
            self.post.append(np.array(post))
            self.sides.append(None)
            return
        j = int(self.rng.integers(0, self.seen))
        if j < self.size:
            self.rows[j], self.pre[j], self.post[j] = int(row), np.array(pre), np.array(post)
            self.sides[j] = None

    def wanted(self, rows: Sequence[int]) -> list[int]:
        """The positions in ``rows`` of the buildings the sample holds."""
        kept = set(self.rows)
        return [i for i, row in enumerate(rows) if int(row) in kept]

    def keep_sides(self, rows: Sequence[int], sides: np.ndarray) -> None:
        """Keep the encoder output (:attr:`runtime.predictor.Prediction.sides`) of the sampled
        buildings among ``rows`` (``sides[i]`` is that of ``rows[i]``; copied)."""
        where = {row: j for j, row in enumerate(self.rows)}
        for i, row in enumerate(rows):
            j = where.get(int(row))
            if j is not None:
                self.sides[j] = np.array(sides[i])

    @property
    def has_sides(self) -> bool:
        """Whether every kept pair has its encoder output."""
        return bool(self.sides) and all(s is not None for s in self.sides)

    def __len__(self) -> int:
        return len(self.rows)


@dataclass
class GradeOrder:
    """The sample graded both ways: how many buildings, and the share graded damaged (any class
    but the first, no-damage) as given and exchanged.

    ``exchanged`` is how many of the sample were graded exchanged: all of them where the order
    may be reversed, fewer where the rest could no longer make it so whatever their grades
    (:func:`grade_order`); ``damaged_exchanged`` is then the share of those graded (None when
    none was: a sample graded damaged as given by more than ``1 - MARGIN`` cannot look
    reversed)."""

    sample: int
    damaged_given: float
    damaged_exchanged: float | None
    exchanged: int

    @property
    def reversed(self) -> bool:
        """The rule on the whole sample (a sample graded only in part cannot look reversed)."""
        return self.exchanged == self.sample and looks_reversed(
            self.sample, self.damaged_given, self.damaged_exchanged or 0.0
        )

    def to_dict(self) -> dict:
        return {
            "sample": self.sample,
            "damaged_given": round(self.damaged_given, 4),
            "damaged_exchanged": (
                None if self.damaged_exchanged is None else round(self.damaged_exchanged, 4)
            ),
            "exchanged": self.exchanged,
        }


def looks_reversed(sample: int, damaged_given: float, damaged_exchanged: float) -> bool:
    """The rule on a sample graded both ways (module docstring)."""
    return (
        sample >= MIN_SAMPLE
        and damaged_exchanged >= EXCHANGED_DAMAGED
        and damaged_exchanged - damaged_given >= MARGIN
    )


def grade_order(
    predictor, sample: OrderSample, class_id: np.ndarray, batch_size: int = 32, step: int = STEP
) -> GradeOrder | None:
    """Grade the sample again with pre and post exchanged; None when it is smaller than
    :data:`MIN_SAMPLE` (no verdict, and no extra inference).

    Where the sample kept every pair's encoder output and the model allows it, the pairs are
    graded exchanged from that (:meth:`runtime.predictor.Predictor.exchanged`, the same grades
    at the cost of the network's head), else through the whole network.

    The sample is graded ``step`` buildings at a time and the grading stops as soon as the order
    could no longer look reversed even if every building left were graded damaged: the verdict
    is the one of the whole sample, at a fraction of its inference where the order is right
    (:func:`looks_reversed` grows with the exchanged share, so the share of those graded is
    below the bound too). A sample that may be reversed is graded in full.

    Args:
        predictor: the model that graded the buildings (:class:`runtime.predictor.Predictor`).
        sample: the chip pairs kept while grading.
        class_id: ``[N]`` the grades as given, indexed by the sample's rows.
        batch_size: chips per inference batch.
        step: buildings graded between two looks at the bound.
    """
    n = len(sample)
    if n < MIN_SAMPLE:
        return None
    given = float(np.mean(np.asarray(class_id)[np.asarray(sample.rows)] > 0))
    step = max(int(step), 1)
    damaged = graded = 0
    from_sides = sample.has_sides and getattr(predictor, "can_exchange", False)
    while graded < n and looks_reversed(n, given, (damaged + n - graded) / n):
        end = min(graded + step, n)
        if from_sides:  # the same grades as the chips exchanged, without the encoder
            pred = predictor.exchanged(np.stack(sample.sides[graded:end]))
        else:
            pred = predictor.predict(
                np.stack(sample.post[graded:end]), np.stack(sample.pre[graded:end]), batch_size
            )
        damaged += int(np.count_nonzero(np.asarray(pred.probabilities).argmax(axis=1) > 0))
        graded = end
    return GradeOrder(n, given, damaged / graded if graded else None, graded)


@dataclass
class OrderCheck:
    """The order check of one scene: how it was decided and whether it looks reversed.

    Attributes:
        method: ``dates`` (the files' acquisition dates decided), ``grades`` (the sample graded
            both ways decided) or ``none`` (too few graded buildings and no dates).
        reversed: whether pre and post look exchanged.
        dates: what the metadata say (:class:`DateOrder`).
        grades: the sample graded both ways (None when the dates decided or too few buildings).
    """

    method: str
    reversed: bool
    dates: DateOrder
    grades: GradeOrder | None = None

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "reversed": self.reversed,
            "warning": self.warning().removeprefix("warning: "),
            "dates": self.dates.to_dict(),
            "grades": None if self.grades is None else self.grades.to_dict(),
        }

    def warning(self) -> str:
        """One line for the report (empty when the order looks right)."""
        if not self.reversed:
            return ""
        if self.method == "dates":
            pre = max(self.dates.pre, key=lambda d: d.date)
            post = min(self.dates.post, key=lambda d: d.date)
            why = (
                f"the post imagery was taken before the pre imagery ({Path(post.path).name} "
                f"{post.key} {post.date:%Y-%m-%d %H:%M}, {Path(pre.path).name} {pre.key} "
                f"{pre.date:%Y-%m-%d %H:%M})"
            )
        else:
            g = self.grades
            why = (
                f"graded with pre and post exchanged, {round(g.damaged_exchanged * g.sample)} of "
                f"{g.sample} sampled buildings look damaged, against "
                f"{round(g.damaged_given * g.sample)} in the order given"
            )
        return (
            f"warning: pre and post look exchanged: {why}; check that the pre imagery is from "
            "before the disaster and the post imagery from after (the grades are those of the "
            "order given)"
        )


def check_order(
    pre: Sequence[str | os.PathLike],
    post: Sequence[str | os.PathLike],
    predictor,
    sample: OrderSample,
    class_id: np.ndarray,
    batch_size: int = 32,
    opened: Mapping[str, object] | None = None,
) -> OrderCheck:
    """Check the order of a graded scene: the files' dates when they decide, else the sample
    graded both ways (module docstring); ``opened`` as in :func:`date_order`."""
    dates = date_order(pre, post, opened)
    if dates.verdict in ("right", "reversed"):
        return OrderCheck("dates", dates.verdict == "reversed", dates)
    grades = grade_order(predictor, sample, class_id, batch_size)
    if grades is None:
        return OrderCheck("none", False, dates)
    return OrderCheck("grades", grades.reversed, dates, grades)
