"""Adapt a model's head to a new event from a few labelled buildings (no torch).

The network is not retrained: its embedding ``z`` and raw logits are computed once for the
labelled buildings, and a small head on top of them is fitted in well under a second. Several
heads are tried, each with the classes without a label kept and discounted, and the base model
is kept unless a candidate beats it clearly on the cross-validation of the given labels
(:func:`adapt_head`, :func:`choose`, :data:`SELECTION`; docs/adapt.md). The NLL to beat is the
base model's recalibrated on the other folds (:func:`choose`), and labels from several
tiles are cross-validated by tile (:data:`GROUP_MIN_TILES`): on a new event a head must know more
than a softer base model, about buildings of tiles it did not see.

- ``base``: the base model unchanged (the reference every other head must beat).
- ``prototype``: cosine similarity of ``z`` to per-class prototypes, each the normalised sum of
  the labelled embeddings of its class plus :data:`PROTOTYPE_PRIOR` times the base model's own
  prototype of that class (from its ``ood`` metadata, when it has one), times a fitted scale.
- ``logistic``: a multinomial logistic regression on ``z`` (scikit-learn).
- ``logistic+prior``: the same on ``z`` and the base model's log-probabilities, so the base
  model's judgement is a feature the regression can keep or overrule.

The logistic heads are candidates only from :data:`LOGISTIC_MIN_LABELS` labels.

Every head is linear in ``[z, log p_base(c | labelled classes)]`` and scores only the classes
that have labels (``L``). A class without a label keeps the base model's probability unless the
base model called labelled buildings that class (:data:`UNLABELLED_MIN_EVIDENCE`); then a
candidate discounts it (:data:`UNLABELLED_RULES`; ``discount`` by default):
``p(c) = rho_c * p_base(c)`` for ``c`` not in ``L``, with ``rho_c = A / (A + e_c)``, where
``e_c = sum_i p_base(c | x_i)`` is how many of the labelled buildings the base model expected in
class ``c`` (none was) and ``A`` = :data:`UNLABELLED_PSEUDO_COUNT` labels of prior weight. A class
the base model did not expect among the labelled buildings keeps its probability (``rho`` near
1); one it expected often (it called many of them ``c``, and the analyst said otherwise) is
scaled down, but never to zero. With ``keep``, ``rho_c = 1``: exactly the base probability. The
rest of the probability, ``1 - sum_{c not in L} rho_c * p_base(c)``, is shared among the
labelled classes by the head: ``p(c) = m_L * q(c)`` for ``c`` in ``L``, where
``p_base = softmax(raw_logits / T0)`` with the base model's temperature ``T0``.

Where it lives: the ``adaptation`` metadata prop of the model file (:mod:`app.adapt.model`),
read by :class:`runtime.predictor.Predictor`, which returns the head's scores as ``logits`` and their
softmax (divided by the ``calibration`` temperature: ``adapt`` recalibrates it on the labels,
:mod:`app.adapt.recalibrate`) as the
probabilities. The graph is the base model's, so its embedding, change map and the ``ood`` flag
are unchanged, and adapting an adapted model refits the head from the graph's raw output (it
replaces the head, it does not stack a second one).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.adapt.recalibrate import MIN_LABELS, Recalibration, recalibrate, softened_losses
from data_prep.errors import LocalDamageError
from runtime.grading import grade_ids
from runtime.head import Head, log_softmax, unit
from runtime.selection import INTACT, RULE, OutOfFold, clearly_better

#: The heads tried, simplest first (ties go to the earlier one).
METHODS = ("base", "prototype", "logistic", "logistic+prior")
#: What happens to a class without a label (module docstring): ``discount`` its base probability
#: by the evidence of the labels, or ``keep`` it exactly.
UNLABELLED_RULES = ("discount", "keep")
#: ``A`` of the ``discount`` rule: prior weight, in labels, of the base model's view of a class.
UNLABELLED_PSEUDO_COUNT = 1.0
#: Weight, in labelled buildings, of the base model's prototype of a class in the ``prototype`` head.
PROTOTYPE_PRIOR = 5.0
#: Inverse regularisation strength of the logistic heads (features are standardised).
LOGISTIC_C = 1.0
#: The logistic heads (a weight per embedding dimension and class) are candidates only from this
#: many labels. With fewer, a few labels of one grade let them call every building that grade,
#: and leave-one-out over so few labels cannot tell (docs/experiments/fewshot.md).
LOGISTIC_MIN_LABELS = 10
#: Up to this many labels, cross-validation is leave-one-out; above, stratified k-fold.
LEAVE_ONE_OUT_MAX = 40
#: Folds of the stratified k-fold cross-validation.
CV_FOLDS = 5
#: Labels from at least this many tiles are cross-validated by tile: a tile's labels are never
#: on both sides of a fold, because the head will grade buildings of other tiles and damage is
#: clustered in space (on Hurricane Michael, 100 draws of 20-500 random labels: heads kept that
#: graded the other buildings worse fell from 7 to 2; docs/experiments/fewshot.md).
GROUP_MIN_TILES = 3
#: A class without a label is a candidate for the discount only when the base model called
#: (argmax) at least this many of the labelled buildings that class, each of them wrongly (none
#: has it): a class the base model never called on the labels keeps its probability, whatever
#: the base model expected of it, because the labels say nothing against its calls.
UNLABELLED_MIN_EVIDENCE = 1
#: The selection criterion recorded in the metadata.
SELECTION = (
    f"{RULE}; the base model's NLL is taken recalibrated (a softening temperature fitted on "
    f"the other folds' labels, from {MIN_LABELS} labels), as adapt recalibrates whatever it "
    f"keeps; labels from {GROUP_MIN_TILES} tiles or more are cross-validated by tile (a tile's "
    "labels never on both sides of a fold)"
)
#: For studies only (docs/experiments/generalisation/heads_spread.py): hold the heads to the
#: spread of their macro-F1 gain as fine-tuning is, ``"fitted"`` every head but the base model
#: with its discount, ``"all"`` that one too; ``""`` (what ``adapt`` does): none.
HEADS_SPREAD = ""
#: Suffix of a candidate whose classes without a label are discounted.
DISCOUNTED = "+discount"


class AdaptError(LocalDamageError, ValueError):
    """Labels a head cannot be adapted to; the message says why and what to do."""


@dataclass(frozen=True)
class BaseModel:
    """The base model a head is fitted on top of (:func:`app.adapt.model.base_of` and
    :func:`app.adapt.model.base_prototypes` read it from a model's metadata).

    Attributes:
        k: the number of classes ``K``.
        temperature: the base model's ``T0``.
        prototypes: class id -> ``[D]`` base prototype (the model's ``ood`` block), for the
            ``prototype`` head; None: none.
        false_alarm_cost: the model's own grade rule (:mod:`runtime.grading`): the candidates'
            accuracy, macro-F1 and intact recall are those of the grades the analyst will see.
    """

    k: int
    temperature: float = 1.0
    prototypes: Mapping[int, np.ndarray] | None = None
    false_alarm_cost: float = 1.0


# --------------------------------------------------------------------------------------------
# fitting


def _standardise(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mu = x.mean(axis=0)
    sd = x.std(axis=0)
    return mu, np.where(sd > 1e-6, sd, 1.0)


def _fit_logistic(
    x: np.ndarray,
    y: np.ndarray,
    classes: list[int],
    c: float,
    start: tuple[np.ndarray, np.ndarray] | None = None,
):
    """``(W, b)`` over ``classes`` of a multinomial logistic regression on raw features.

    ``start``: ``(W, b)`` over the same ``classes`` (raw features) the solver starts from, e.g.
    the fit on every label for a cross-validation fold that leaves out a few of them. The
    problem is convex with one minimum, so the start changes only how fast the solver gets
    there (and where, within its tolerance).
    """
    from sklearn.linear_model import LogisticRegression

    mu, sd = _standardise(x)
    model = LogisticRegression(C=c, max_iter=500, warm_start=start is not None)
    if start is not None:  # raw features -> standardised: W x + b = (W sd) (x - mu) / sd + W mu + b
        w0, b0 = start
        coef, icpt = w0 * sd, b0 + w0 @ mu
        if len(classes) == 2:  # binary: one row, the second class's logit against the first
            coef, icpt = coef[1:] - coef[:1], icpt[1:] - icpt[:1]
        model.coef_, model.intercept_ = coef, icpt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit((x - mu) / sd, y)
    coef, icpt = model.coef_, model.intercept_
    if coef.shape[0] == 1:  # binary: sklearn gives the second class's logit against the first
        coef = np.vstack([np.zeros_like(coef), coef])
        icpt = np.array([0.0, icpt[0]])
    w = np.zeros((len(classes), x.shape[1]))
    b = np.full(len(classes), -30.0)  # a class of L absent from these labels: never chosen
    for row, cls in enumerate(model.classes_):
        j = classes.index(int(cls))
        w[j] = coef[row] / sd
        b[j] = icpt[row] - float(coef[row] @ (mu / sd))
    return w, b


def _fit_scale(cos: np.ndarray, y_pos: np.ndarray) -> float:
    """The scale ``s`` minimising the NLL of ``softmax(s * cos)`` (bounded search over log s)."""
    from scipy.optimize import minimize_scalar

    def nll(u: float) -> float:
        lp = log_softmax(math.exp(u) * cos)
        return float(-lp[np.arange(len(y_pos)), y_pos].mean())

    return math.exp(float(minimize_scalar(nll, bounds=(0.0, math.log(200.0)), method="bounded").x))


def check_rule(unlabelled: str) -> None:
    """Raise :class:`AdaptError` unless ``unlabelled`` is one of :data:`UNLABELLED_RULES`."""
    if unlabelled not in UNLABELLED_RULES:
        raise AdaptError(
            f"unknown rule {unlabelled!r} for unlabelled classes; the rules are "
            f"{', '.join(UNLABELLED_RULES)}"
        )


def unlabelled_discount(
    raw_logits: np.ndarray,
    classes: Sequence[int],
    k: int,
    base_temperature: float = 1.0,
    pseudo_count: float | None = None,
) -> np.ndarray:
    """``rho`` ``[K]`` of the ``discount`` rule for the labelled buildings' raw logits: for a class
    without a label that the base model called (argmax) on at least
    :data:`UNLABELLED_MIN_EVIDENCE` of them, ``A / (A + e_c)`` with ``e_c`` the base model's
    expected count of that class among them; 1 for the labelled ``classes`` and for a class the
    labels give no evidence against. ``pseudo_count``: ``A`` (None:
    :data:`UNLABELLED_PSEUDO_COUNT`, read when called, so a study can set it)."""
    if pseudo_count is None:
        pseudo_count = UNLABELLED_PSEUDO_COUNT
    p = np.exp(log_softmax(np.asarray(raw_logits, np.float64) / base_temperature))
    rho = pseudo_count / (pseudo_count + p.sum(axis=0))
    called = np.bincount(p.argmax(axis=1), minlength=k) if len(p) else np.zeros(k, int)
    rho[called < UNLABELLED_MIN_EVIDENCE] = 1.0
    rho[list(classes)] = 1.0
    return rho


def fit_head(
    method: str,
    raw_logits: np.ndarray,
    embedding: np.ndarray,
    labels: np.ndarray,
    base: BaseModel,
    c: float = LOGISTIC_C,
    unlabelled: str = "discount",
    start: Head | None = None,
) -> Head:
    """Fit one head to labelled buildings.

    Args:
        method: one of :data:`METHODS`.
        raw_logits: ``[N, K]`` raw logits of the base graph.
        embedding: ``[N, D]`` embeddings.
        labels: ``[N]`` class ids in ``[0, K)``.
        base: the base model's classes, temperature and prototypes.
        c: inverse regularisation strength of the logistic heads.
        unlabelled: one of :data:`UNLABELLED_RULES`.
        start: a head of the same method fitted on nearly the same labels (a cross-validation
            fold starts from the fit on all of them): the logistic heads' solver starts there
            when it scores the same classes. The fitted head does not depend on it beyond the
            solver's tolerance.
    """
    k, base_temperature, base_prototypes = base.k, base.temperature, base.prototypes
    check_rule(unlabelled)
    if method not in METHODS:
        raise AdaptError(f"unknown head {method!r}; the heads are {', '.join(METHODS)}")
    y = np.asarray(labels, dtype=np.int64)
    classes = sorted({int(v) for v in y})
    d = np.asarray(embedding).shape[1]
    nl = len(classes)
    head = Head(method, classes, np.zeros((nl, d + nl)), np.zeros(nl), base_temperature, k)
    if unlabelled == "discount":
        head.discount = unlabelled_discount(raw_logits, classes, k, base_temperature)
    x = head.features(raw_logits, embedding)
    if method == "base" or nl == 1:
        head.weights[:, d:] = np.eye(nl)
        return head
    if method == "prototype":
        z = x[:, :d]
        protos = []
        for cls in classes:
            total = z[y == cls].sum(axis=0)
            prior = (base_prototypes or {}).get(cls)
            if prior is not None and len(prior) == d:
                total = total + PROTOTYPE_PRIOR * unit(np.asarray(prior)[None])[0]
            protos.append(total)
        p = unit(np.stack(protos))
        pos = np.array([classes.index(int(v)) for v in y])
        scale = _fit_scale(z @ p.T, pos)
        head.weights[:, :d] = scale * p
        return head
    cols = slice(0, d) if method == "logistic" else slice(0, d + nl)
    begin = None
    if start is not None and start.method == method and list(start.classes) == classes:
        begin = (start.weights[:, cols], start.bias)
    w, b = _fit_logistic(x[:, cols], y, classes, c, begin)
    head.weights[:, cols] = w
    head.bias[:] = b
    return head


def _splits(labels: np.ndarray, seed: int, tiles: Sequence[str] | None = None):
    """``(scheme, folds)``: by tile (:data:`GROUP_MIN_TILES`), else leave-one-out up to
    :data:`LEAVE_ONE_OUT_MAX` labels, else stratified k-fold."""
    from sklearn.model_selection import GroupKFold, LeaveOneGroupOut, LeaveOneOut, StratifiedKFold

    n = len(labels)
    groups = np.asarray(tiles) if tiles is not None else None
    n_tiles = len(set(groups.tolist())) if groups is not None else 0
    if groups is not None and len(groups) != n:
        raise AdaptError(f"{len(groups)} tiles for {n} labels")
    if n_tiles >= GROUP_MIN_TILES:
        if n_tiles <= CV_FOLDS:
            return "leave-one-tile-out", list(LeaveOneGroupOut().split(labels, labels, groups))
        folds = GroupKFold(CV_FOLDS)
        return f"{CV_FOLDS}-fold by tile", list(folds.split(labels, labels, groups))
    if n <= LEAVE_ONE_OUT_MAX:
        return "leave-one-out", list(LeaveOneOut().split(labels))
    with warnings.catch_warnings():  # a class rarer than the folds: some folds lack it
        warnings.simplefilter("ignore")
        folds = StratifiedKFold(CV_FOLDS, shuffle=True, random_state=seed)
        return f"stratified {CV_FOLDS}-fold (seed {seed})", list(folds.split(labels, labels))


def _metrics(log_p: np.ndarray, y: np.ndarray, cost: float = 1.0) -> dict[str, float]:
    from sklearn.metrics import f1_score

    pred = grade_ids(np.exp(log_p), INTACT, cost)
    nll = float(-np.clip(log_p[np.arange(len(y)), y], -50.0, 0.0).mean())
    present = sorted({int(v) for v in y})
    intact = y == INTACT
    return {
        "nll": round(nll, 6),
        "accuracy": round(float(np.mean(pred == y)), 6),
        "macro_f1": round(float(f1_score(y, pred, labels=present, average="macro")), 6),
        "intact_recall": round(float(np.mean(pred[intact] == INTACT)), 6) if intact.any() else None,
    }


@dataclass
class Adaptation:
    """The outcome of :func:`adapt_head`.

    Attributes:
        head: the chosen head, fitted on every label.
        cv: ``{"scheme", "candidates": {method: {"nll", "accuracy", "macro_f1"}}}`` out-of-fold
            figures of every head tried, and ``not_tried`` (head -> why) when a head asked for
            was left out for too few labels.
        train: the chosen head's figures on the labels it was fitted on, and the base model's.
        seconds: wall time of cross-validation and the final fit.
        recalibration: the temperature fitted on the chosen head's out-of-fold probabilities
            (:mod:`app.adapt.recalibrate`); None: not fitted.
    """

    head: Head
    cv: dict[str, Any]
    train: dict[str, Any]
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)
    recalibration: Recalibration | None = None


def adapt_head(
    raw_logits: np.ndarray,
    embedding: np.ndarray,
    labels: np.ndarray,
    base: BaseModel,
    methods: Sequence[str] = METHODS,
    seed: int = 0,
    unlabelled: str = "discount",
    tiles: Sequence[str] | None = None,
) -> Adaptation:
    """Cross-validate every head of ``methods`` on the labels, keep the best, fit it on all.

    Args:
        raw_logits: ``[N, K]`` raw logits of the labelled buildings.
        embedding: ``[N, D]`` their embeddings.
        labels: ``[N]`` their class ids.
        base: the base model's classes ``K``, temperature ``T0`` and prototypes (for the
            ``prototype`` head).
        methods: the heads to try (:data:`METHODS`).
        seed: seed of the k-fold split.
        unlabelled: what happens to classes without a label (:data:`UNLABELLED_RULES`).
        tiles: ``[N]`` the tile (or scene) of each label; from :data:`GROUP_MIN_TILES` tiles
            the cross-validation keeps each tile's labels together (None: no tiles known).

    Raises:
        AdaptError: fewer than two labels, labels of a single class, bad shapes, or an unknown
            head or rule.
    """
    import scipy.optimize  # noqa: F401  (imports are not fitting time)
    import sklearn.linear_model  # noqa: F401
    import sklearn.model_selection  # noqa: F401
    from threadpoolctl import threadpool_limits

    start = time.perf_counter()
    k, base_temperature = base.k, base.temperature
    lo = np.asarray(raw_logits, dtype=np.float64)
    z = np.asarray(embedding, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    if (
        lo.ndim != 2
        or lo.shape[1] != k
        or z.ndim != 2
        or y.shape != (len(lo),)
        or len(z) != len(lo)
    ):
        raise AdaptError(
            f"need [N, {k}] logits, [N, D] embeddings and [N] labels, got {lo.shape}, {z.shape}, "
            f"{y.shape}"
        )
    if len(y) and (y.min() < 0 or y.max() >= k):
        raise AdaptError(
            f"labels must be class ids in [0, {k}), got {int(y.min())}..{int(y.max())}"
        )
    present = sorted({int(v) for v in y})
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise AdaptError(f"unknown head(s) {unknown}; the heads are {', '.join(METHODS)}")
    check_rule(unlabelled)
    if len(y) < 2 or (len(present) < 2 and unlabelled == "keep"):
        raise AdaptError(
            f"{len(y)} label(s) of {len(present)} class(es): the head needs at least two labels, "
            "and with --unlabelled keep labelled buildings of at least two classes, to learn "
            "anything the base model does not already say"
        )
    # The candidates: every head of ``methods`` with classes without a label kept exactly, and,
    # under ``discount``, the same heads with them discounted where the labels give evidence.
    # Each is judged by the same cross-validation; the base model unchanged is the reference.
    rules = ["keep"]
    if (
        unlabelled == "discount"
        and (unlabelled_discount(lo, present, k, base_temperature) < 1.0).any()
    ):
        rules.append("discount")
    not_tried: dict[str, str] = {}
    if len(present) == 1:  # one class: nothing for a head to learn, only the discount to judge
        methods = ("base",)
    elif len(y) < LOGISTIC_MIN_LABELS:
        few = f"{len(y)} labels, fewer than the {LOGISTIC_MIN_LABELS} a logistic head needs"
        not_tried = {m: few for m in methods if m.startswith("logistic")}
        methods = tuple(m for m in methods if m not in not_tried) or ("base",)
    names = [m + ("" if r == "keep" else DISCOUNTED) for r in rules for m in methods]
    names = sorted(dict.fromkeys(["base", *names]), key=lambda n: _order(n, methods))
    scheme, folds = _splits(y, seed, tiles)
    candidates: dict[str, dict[str, float]] = {}
    losses: dict[str, np.ndarray] = {}
    oofs: dict[str, np.ndarray] = {}
    fitted: dict[str, Head] = {}
    # Hundreds of tiny fits: BLAS threads cost far more than they give on them (on 2 busy cores,
    # 40 labels took 10-30 times as long with them), so the fits run on one thread.
    with threadpool_limits(limits=1):
        for name in names:
            method, rule = _parse(name)
            # on every label: the head kept if this candidate wins, and where each fold starts
            fitted[name] = fit_head(method, lo, z, y, base, unlabelled=rule)
            fitted[name].method = name
            oof = np.zeros((len(y), k))
            for train, test in folds:
                head = fit_head(
                    method, lo[train], z[train], y[train], base, unlabelled=rule, start=fitted[name]
                )
                oof[test] = head.log_probabilities(lo[test], z[test])
            candidates[name] = _metrics(oof, y, base.false_alarm_cost)
            oofs[name] = oof
            losses[name] = -np.clip(oof[np.arange(len(y)), y], -50.0, 0.0)
    preds = None
    if HEADS_SPREAD:
        preds = {n: grade_ids(np.exp(o), INTACT, base.false_alarm_cost) for n, o in oofs.items()}
    # the NLL to beat: the base model recalibrated on the other folds (on Hurricane Michael the
    # raw base model's NLL on the labels was 2-4 nats, and heads won by being less sure of
    # themselves; docs/experiments/fewshot.md)
    reference = softened_losses(oofs["base"], y, folds)
    best = choose(candidates, losses, names, preds, y, reference)
    head = fitted[best]
    recalibration = recalibrate(oofs[best], y, seed)
    seconds = time.perf_counter() - start
    train = {
        "chosen": _metrics(head.log_probabilities(lo, z), y, base.false_alarm_cost),
        "base": _metrics(log_softmax(lo / base_temperature), y, base.false_alarm_cost),
    }
    cv: dict[str, Any] = {"scheme": scheme, "candidates": candidates}
    if not_tried:
        cv["not_tried"] = not_tried
    return Adaptation(head, cv, train, seconds, {"fitted": fitted}, recalibration)


def _parse(name: str) -> tuple[str, str]:
    """``(head method, unlabelled rule)`` of a candidate name such as ``logistic+discount``."""
    if name.endswith(DISCOUNTED):
        return name[: -len(DISCOUNTED)], "discount"
    return name, "keep"


def _order(name: str, methods: Sequence[str]) -> tuple[int, int]:
    """Simplest first: the base model, then each head kept before discounted, in METHODS order."""
    method, rule = _parse(name)
    return (METHODS.index(method), rule == "discount")


def choose(
    candidates: Mapping[str, Mapping[str, float]],
    losses: Mapping[str, np.ndarray],
    names: Sequence[str],
    preds: Mapping[str, np.ndarray] | None = None,
    labels: np.ndarray | None = None,
    reference: np.ndarray | None = None,
) -> str:
    """The candidate kept: ``base`` unless another beats it clearly on the cross-validation
    (:data:`runtime.selection.RULE`); each candidate's figures get ``gain`` (nats per label over the base
    model), ``gain_se`` and ``clear`` (whether it beat the base model clearly).

    The heads are not held to the spread of their macro-F1 gain, as fine-tuning is
    (:data:`runtime.selection.FINETUNE_RULE`): on the bundled model's new tiles of known events
    it halved what 20 labels gain (docs/experiments/adapt-record.md). A study can hold them to
    it (:data:`HEADS_SPREAD`), which needs ``preds`` and ``labels``.

    Args:
        candidates: name -> out-of-fold ``nll``, ``accuracy``, ``macro_f1`` (updated in place).
        losses: name -> ``[N]`` out-of-fold NLL of each label.
        names: the candidates, simplest first (ties go to the earlier one).
        preds: name -> ``[N]`` out-of-fold class ids, for :data:`HEADS_SPREAD`.
        labels: ``[N]`` the labels, for :data:`HEADS_SPREAD`.
        reference: ``[N]`` out-of-fold NLL of the base model recalibrated on the other folds
            (:func:`app.adapt.recalibrate.softened_losses`): the NLL a candidate must beat, with
            the base model's grades (None: the base model's own ``losses``). Recorded as the base
            model's ``nll_recalibrated``.
    """

    def out_of_fold(name: str, spread: bool, nll: np.ndarray | None = None) -> OutOfFold:
        c = candidates[name]
        pred = preds[name] if spread and preds is not None else None
        nll = losses[name] if nll is None else nll
        return OutOfFold(nll, c["macro_f1"], c["accuracy"], c.get("intact_recall"), pred)

    if reference is not None:
        candidates["base"]["nll_recalibrated"] = round(float(np.mean(reference)), 6)  # type: ignore[index]
    clear = []
    for name in names:
        spread = HEADS_SPREAD == "all" or (HEADS_SPREAD == "fitted" and _parse(name)[0] != "base")
        base = out_of_fold("base", spread, reference)
        verdict = clearly_better(base, out_of_fold(name, spread), labels)
        ok = verdict.clear and name != "base"
        candidates[name].update({**verdict.figures(), "clear": ok})  # type: ignore[union-attr]
        if ok:
            clear.append(name)
    if not clear:
        return "base"
    return min(clear, key=lambda n: (candidates[n]["nll"], names.index(n)))
