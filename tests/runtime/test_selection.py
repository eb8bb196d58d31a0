"""The never-worse rule (runtime.selection): a candidate replaces the base model only when the
labels show it better beyond what their number leaves to chance, macro-F1 included."""

from __future__ import annotations

import numpy as np
from sklearn.metrics import f1_score

from runtime.selection import OutOfFold, clearly_better, macro_f1_gain


def _predictions(n: int, right: float, seed: int, y: np.ndarray | None = None):
    rng = np.random.default_rng(seed)
    if y is None:
        y = rng.choice(4, n, p=[0.6, 0.25, 0.1, 0.05])
    wrong = (y + rng.integers(1, 4, n)) % 4
    return y, np.where(rng.random(n) < right, y, wrong)


def test_the_macro_f1_gain_is_scikit_learns_and_its_spread_shrinks_with_the_labels():
    spreads = {}
    for n in (100, 1600):
        y, base = _predictions(n, 0.6, 1)
        _, cand = _predictions(n, 0.7, 2, y)
        g, se = macro_f1_gain(y, base, cand)
        present = sorted(set(y.tolist()))
        want = f1_score(y, cand, labels=present, average="macro") - f1_score(
            y, base, labels=present, average="macro"
        )
        assert abs(g - want) < 1e-9
        spreads[n] = se
        # the same labels and predictions give the same verdict every time
        assert macro_f1_gain(y, base, cand) == (g, se)
    # sixteen times the labels: about a quarter of the spread
    assert 2.5 < spreads[100] / spreads[1600] < 6.0
    y, base = _predictions(200, 0.6, 3)
    assert macro_f1_gain(y, base, base) == (0.0, 0.0)


def _case(n: int, flips: int, seed: int = 0):
    """``n`` labels, the base model right on 60% of them; the candidate is the base model with
    ``flips`` of its wrong grades of damaged buildings put right and half as many intact buildings
    it graded right called minor damage: a gain the labels cannot tell from chance when
    ``flips`` is small."""
    y, base = _predictions(n, 0.6, seed)
    cand = base.copy()
    rng = np.random.default_rng(seed + 1)
    fix = rng.permutation(np.flatnonzero((base != y) & (y > 0)))[:flips]
    cand[fix] = y[fix]
    spoil = rng.permutation(np.flatnonzero((base == y) & (y == 0)))[: flips // 2]
    cand[spoil] = 1
    return y, base, cand


def _verdict(y, base, cand, with_predictions=True):
    losses = np.full(len(y), 1.0)
    acc = lambda p: float(np.mean(p == y))  # noqa: E731
    present = sorted(set(y.tolist()))
    f1 = lambda p: float(f1_score(y, p, labels=present, average="macro"))  # noqa: E731
    b = OutOfFold(losses, f1(base), acc(base), None, base if with_predictions else None)
    c = OutOfFold(losses - 0.1, f1(cand), acc(cand), None, cand if with_predictions else None)
    return clearly_better(b, c, y)


def test_a_macro_f1_gain_within_its_spread_is_refused_and_a_clear_one_kept():
    # 100 labels, 4 middle-grade labels put right: NLL clearly lower, macro-F1 and accuracy up,
    # but a gain a different draw of 100 labels would not repeat
    y, base, cand = _case(100, 4)
    v = _verdict(y, base, cand)
    assert 0 < v.f1_gain < 2 * v.f1_gain_se and not v.clear
    # without the predictions, the rule of NLL, macro-F1 and accuracy alone would keep it
    assert _verdict(y, base, cand, with_predictions=False).clear
    # the same kind of trade over many labels: a gain well beyond its spread is kept
    y, base, cand = _case(1000, 200)
    v = _verdict(y, base, cand)
    assert v.f1_gain > 2 * v.f1_gain_se and v.clear


def test_the_heads_are_held_to_the_spread_only_in_a_study(monkeypatch):
    """`adapt` keeps a head whose macro-F1 gain is within its spread (the heads' rule); the
    study switch `HEADS_SPREAD` holds the fitted heads to it, and `base+discount` only under
    "all"."""
    import app.adapt.fit as fit

    y, base, cand = _case(100, 4)
    present = sorted(set(y.tolist()))

    def kept(name: str) -> str:
        def figures(p):
            acc = float(np.mean(p == y))
            f1 = float(f1_score(y, p, labels=present, average="macro"))
            return {"nll": 1.0, "accuracy": acc, "macro_f1": f1}

        cands = {"base": figures(base), name: figures(cand)}
        losses = {"base": np.full(len(y), 1.0), name: np.full(len(y), 0.9)}
        return fit.choose(cands, losses, ["base", name], {"base": base, name: cand}, y)

    assert kept("logistic") == "logistic" and kept("base+discount") == "base+discount"
    monkeypatch.setattr(fit, "HEADS_SPREAD", "fitted")
    assert kept("logistic") == "base" and kept("base+discount") == "base+discount"
    monkeypatch.setattr(fit, "HEADS_SPREAD", "all")
    assert kept("base+discount") == "base"
