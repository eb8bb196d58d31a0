"""Stage times of a run: how long each stage of scoring or chip cutting took, in seconds.

A :class:`StageTimes` is handed down to the code that does the work (reading, cutting,
measuring, grading); each stage adds its wall time under its name, so a profile of a whole run
costs two clock reads per stage and building. Library code fills it; the command layer prints it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from contextlib import contextmanager


class StageTimes:
    """Seconds per stage name, in the order the stages were first seen."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, stage: str, seconds: float) -> None:
        """Add ``seconds`` to ``stage``."""
        self.seconds[stage] = self.seconds.get(stage, 0.0) + float(seconds)

    @contextmanager
    def stage(self, name: str):
        """Time the body of a ``with`` block as stage ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def merge(self, other: Mapping[str, float]) -> None:
        """Add another run's ``{stage: seconds}``."""
        for name, seconds in other.items():
            self.add(name, seconds)

    def as_dict(self, digits: int = 4) -> dict[str, float]:
        """``{stage: seconds}``, rounded."""
        return {name: round(s, digits) for name, s in self.seconds.items()}

    def __bool__(self) -> bool:
        return bool(self.seconds)


def stage_table(
    seconds: Mapping[str, float],
    total: float,
    per: int = 0,
    unit: str = "building",
    order: Iterable[str] = (),
) -> list[str]:
    """Lines of a stage table: seconds, share of ``total`` and, when ``per`` > 0, milliseconds
    per ``unit``; stages in ``order`` first, then the rest, then what no stage accounts for."""
    names = [n for n in order if n in seconds] + [n for n in seconds if n not in set(order)]
    width = max([len(n) for n in names] + [len("other"), len("stage")])
    head = f"  {'stage':<{width}}  {'seconds':>8}  {'share':>6}"
    lines = [head + (f"  {'ms/' + unit:>12}" if per > 0 else "")]
    rows = [(n, float(seconds[n])) for n in names]
    rest = total - sum(s for _, s in rows)
    if total > 0 and rest > 0.0005:
        rows.append(("other", rest))
    for name, s in rows:
        share = s / total if total > 0 else 0.0
        line = f"  {name:<{width}}  {s:>8.3f}  {share:>6.1%}"
        if per > 0:
            line += f"  {1000 * s / per:>12.3f}"
        lines.append(line)
    line = f"  {'total':<{width}}  {total:>8.3f}  {1:>6.1%}"
    if per > 0:
        line += f"  {1000 * total / per:>12.3f}"
    lines.append(line)
    return lines
