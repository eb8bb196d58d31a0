"""Grades from class probabilities, weighing the cost of a false alarm (no torch).

By default a building gets its most probable grade. A responder for whom calling an intact
building damaged costs more than missing a damaged one sets a *false-alarm cost* ``c``: a damaged
grade is then given only where it is at least ``c`` times as probable as no-damage (the most
probable damaged grade, where several are), else no-damage. This is the grade of least expected
cost when a false alarm costs ``c`` and every other mistake costs 1: calling damage grade ``k``
costs ``c * p(no-damage) + (1 - p(no-damage) - p(k))`` in expectation and calling no-damage
``1 - p(no-damage)``. ``c = 1`` is the most probable grade; ``c < 1`` leans the other way (a
missed damaged building costs more). Probabilities stay as they are: only the grade moves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

#: The class a false alarm is called against.
NO_DAMAGE = "no-damage"


def check_cost(cost: float) -> float:
    """``cost`` as a float when it is a positive finite number.

    Raises:
        ValueError: otherwise, saying what it takes.
    """
    valid = isinstance(cost, (int, float)) and not isinstance(cost, bool)
    if not valid or not math.isfinite(cost) or cost <= 0:
        raise ValueError(
            f"the false-alarm cost must be a positive number (1: the most probable grade; 3: a "
            f"damaged grade only where at least 3 times as probable as no-damage), got {cost!r}"
        )
    return float(cost)


def grades(
    probabilities: ArrayLike, class_names: Sequence[str], false_alarm_cost: float = 1.0
) -> np.ndarray:
    """Class ids ``[N]`` of ``probabilities`` ``[N, K]`` under a false-alarm cost (module doc).

    Raises:
        ValueError: a cost that is not a positive number, or a cost other than 1 for a model
            without a ``no-damage`` class.
    """
    names = list(class_names)
    if NO_DAMAGE not in names:
        if check_cost(false_alarm_cost) != 1.0:
            raise ValueError(
                f"a false-alarm cost needs a {NO_DAMAGE!r} class; this model's classes are "
                f"{', '.join(names)}"
            )
        return grade_ids(probabilities, 0, 1.0)  # the most probable grade: no class is special
    return grade_ids(probabilities, names.index(NO_DAMAGE), false_alarm_cost)


def grade_ids(
    probabilities: ArrayLike, no_damage: int, false_alarm_cost: float = 1.0
) -> np.ndarray:
    """:func:`grades` with the no-damage class given by its index ``no_damage``."""
    p = np.asarray(probabilities, dtype=np.float64)
    cost = check_cost(false_alarm_cost)
    if cost == 1.0 or len(p) == 0:
        return p.argmax(axis=1) if p.ndim == 2 else np.zeros(0, dtype=np.int64)
    damaged = p.copy()
    damaged[:, no_damage] = -np.inf
    best = damaged.argmax(axis=1)
    rows = np.arange(len(p))
    return np.where(p[rows, best] > cost * p[:, no_damage], best, no_damage)


def rule_text(false_alarm_cost: float) -> str:
    """One line saying how grades were given."""
    cost = check_cost(false_alarm_cost)
    if cost == 1.0:
        return "the most probable grade"
    return f"a damaged grade only where at least {cost:g} times as probable as no-damage"


#: Metadata key of a model's own grade rule: ``{"false_alarm_cost", "rule"}``, the cost its
#: grades are given with when the analyst sets none (chosen with its recipe on inner folds).
GRADE_RULE_KEY = "grade_rule"


def grade_rule_block(false_alarm_cost: float) -> dict:
    """The ``grade_rule`` metadata of a model whose default false-alarm cost is this."""
    cost = check_cost(false_alarm_cost)
    return {"false_alarm_cost": cost, "rule": rule_text(cost)}


def read_default_cost(metadata, path) -> float:
    """The false-alarm cost a model grades with by default: its ``grade_rule`` metadata's, 1 (the
    most probable grade) when it has none.

    Raises:
        ValueError: a ``grade_rule`` without a positive finite ``false_alarm_cost``, naming
            ``path``.
    """
    block = metadata.get(GRADE_RULE_KEY)
    if block is None:
        return 1.0
    cost = block.get("false_alarm_cost") if isinstance(block, dict) else None
    try:
        return check_cost(cost)
    except ValueError:
        raise ValueError(
            f"{path}: metadata {GRADE_RULE_KEY} must hold a positive finite false_alarm_cost, "
            f"got {block!r}"
        ) from None


def resolve_cost(given: float | None, default: float) -> float:
    """The cost grades are given with: ``given`` (the analyst's), else the model's ``default``."""
    return check_cost(default if given is None else given)
