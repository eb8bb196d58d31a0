"""Grades under a false-alarm cost (runtime.grading): the grade of least expected cost."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.grading import check_cost, grades, rule_text

NAMES = ["no-damage", "minor-damage", "major-damage", "destroyed"]


def _expected_cost_grades(p: np.ndarray, cost: float) -> np.ndarray:
    """Brute force: the grade of least expected cost, a false alarm (true no-damage graded
    damaged) costing ``cost`` and every other mistake 1."""
    k = p.shape[1]
    c = 1.0 - np.eye(k)
    c[0, 1:] = cost
    return (p @ c).argmin(axis=1)


def test_cost_one_is_the_most_probable_grade():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(4), 500)
    assert (grades(p, NAMES) == p.argmax(axis=1)).all()
    assert (grades(p, NAMES, 1) == p.argmax(axis=1)).all()


@pytest.mark.parametrize("cost", [0.5, 2.0, 3.0, 10.0])
def test_grades_are_those_of_least_expected_cost(cost):
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.full(4, 0.7), 2000)
    got = grades(p, NAMES, cost)
    assert (got == _expected_cost_grades(p, cost)).all()
    moved = got != p.argmax(axis=1)
    assert moved.any()  # the rule does something at this cost
    if cost > 1:  # a higher cost only ever moves damaged grades to no-damage
        assert (got[moved] == 0).all()
    else:
        assert (p.argmax(axis=1)[moved] == 0).all()


def test_no_damage_found_by_name_and_bad_costs_refused():
    p = np.array([[0.1, 0.35, 0.55], [0.5, 0.3, 0.2]])
    names = ["destroyed", "no-damage", "minor-damage"]
    assert list(grades(p, names, 2.0)) == [1, 1]  # 0.55 < 2 x 0.35: no-damage
    assert list(grades(p, names, 1.5)) == [2, 0]  # 0.55 > 0.525, 0.5 > 0.45
    for bad in (0, -1, float("nan"), float("inf"), True, "3"):
        with pytest.raises(ValueError, match="false-alarm cost must be a positive number"):
            check_cost(bad)
    with pytest.raises(ValueError, match="needs a 'no-damage' class"):
        grades(p, ["a", "b", "c"], 2.0)
    assert rule_text(1) == "the most probable grade"
    assert rule_text(3) == "a damaged grade only where at least 3 times as probable as no-damage"


def test_cost_curve_on_out_of_fold_predictions():
    """The cross-validation's table of false-alarm costs: at cost 1 the argmax grades; a higher
    cost never calls more intact buildings damaged."""
    import pandas as pd

    from local_damage.experiments.cost_rule import cost_curve, cost_table

    rng = np.random.default_rng(2)
    n = 900
    p = rng.dirichlet(np.full(4, 0.8), n)
    intact = np.arange(n) % 3 == 0
    p[intact] = rng.dirichlet([8, 1, 1, 1], intact.sum())
    y = np.where(intact, 0, [rng.choice(4, p=q) for q in p])
    frame = pd.DataFrame(p, columns=[f"p_{c}" for c in NAMES])
    frame["label"], frame["fold"], frame["intact_tile"] = y, np.arange(n) % 5, intact
    rows = cost_curve(frame, NAMES, costs=(1, 2, 5))
    assert rows[0]["intact_damaged"] == int((p[intact].argmax(axis=1) > 0).sum()) > 0
    assert rows[0]["accuracy"] == pytest.approx(float((p.argmax(axis=1) == y).mean()))
    damaged = [r["intact_damaged"] for r in rows]
    assert damaged == sorted(damaged, reverse=True) and damaged[-1] < damaged[0]
    assert set(rows[0]["fold_macro_f1"]) == {0, 1, 2, 3, 4}
    text = "\n".join(cost_table("m", rows))
    assert f"({damaged[0]} of {intact.sum()};" in text
    assert cost_curve(frame.assign(intact_tile=False), NAMES) is None
