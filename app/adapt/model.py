"""The adapted model file: the ``adaptation`` metadata block, writing it, and
:func:`adapt_model`, which goes from a model and labelled buildings to an adapted model (no torch).

The head itself, how it is fitted and chosen: :mod:`app.adapt.fit`.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.adapt.fit import (
    GROUP_MIN_TILES,
    METHODS,
    SELECTION,
    UNLABELLED_PSEUDO_COUNT,
    Adaptation,
    AdaptError,
    BaseModel,
    adapt_head,
)
from app.adapt.recalibrate import Recalibration, recalibration_text
from data_prep.store import atomic_path
from runtime.contract import set_metadata
from runtime.head import METADATA_KEY, Head
from runtime.selection import FINETUNE_RULE

# --------------------------------------------------------------------------------------------
# the model file


def sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def base_of(metadata: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(T0, calibration block)`` of the model a head is fitted on top of: the model's own
    temperature, or for an adapted model, that of its base (its head is refitted, not stacked)."""
    block = metadata.get(METADATA_KEY)
    if isinstance(block, Mapping) and isinstance(block.get("base_model"), Mapping):
        base = block["base_model"]
        return float(block["head"]["base_temperature"]), base.get("calibration")
    cal = metadata.get("calibration")
    t = cal.get("temperature") if isinstance(cal, Mapping) else None
    return (float(t) if t else 1.0), (dict(cal) if isinstance(cal, Mapping) else None)


def base_prototypes(metadata: Mapping[str, Any], class_names: Sequence[str]) -> dict[int, Any]:
    """Class id -> prototype of the model's ``ood`` block (empty when it has none)."""
    block = metadata.get("ood")
    if not isinstance(block, Mapping):
        return {}
    names = list(block.get("class_names") or [])
    protos = block.get("prototypes") or []
    return {
        list(class_names).index(n): np.asarray(p, dtype=np.float64)
        for n, p in zip(names, protos, strict=False)
        if n in class_names
    }


def base_model(predictor) -> BaseModel:
    """The :class:`~app.adapt.fit.BaseModel` a head is fitted on top of, read from a
    :class:`runtime.predictor.Predictor`: its classes, temperature, prototypes and own grade
    rule (what ``adapt`` fits on; the studies that replay ``adapt`` call it too)."""
    names = list(predictor.class_names)
    t0, _ = base_of(predictor.metadata)
    return BaseModel(
        len(names),
        t0,
        base_prototypes(predictor.metadata, names),
        predictor.false_alarm_cost,
    )


def adaptation_block(
    adaptation: Adaptation,
    class_names: Sequence[str],
    base_path: str | os.PathLike,
    base_metadata: Mapping[str, Any],
    labels: Mapping[str, Any],
) -> dict[str, Any]:
    """The ``adaptation`` metadata prop of an adapted model.

    Args:
        adaptation: the fitted head and its cross-validation.
        class_names: the model's classes.
        base_path: the model file the head was fitted on.
        base_metadata: its parsed metadata.
        labels: what was labelled: ``n``, ``per_class``, ``events`` (counts) and ``sources``.
    """
    previous = base_metadata.get(METADATA_KEY)
    if isinstance(previous, Mapping) and isinstance(previous.get("base_model"), Mapping):
        base_model = dict(previous["base_model"])  # an adapted model: keep the original base
        base_model["adapted_from"] = {"file": Path(base_path).name, "sha256": sha256(base_path)}
    else:
        base_model = {
            "file": Path(base_path).name,
            "sha256": sha256(base_path),
            "calibration": base_of(base_metadata)[1],
        }
    head = adaptation.head
    return {
        "method": head.method,
        "selection": SELECTION,
        "labelled_classes": [class_names[c] for c in head.classes],
        "unlabelled_classes": [class_names[c] for c in head.unlabelled],
        "unlabelled_rule": unlabelled_rule(head),
        "unlabelled_discount": {
            class_names[c]: round(float(head.discount[c]), 6) for c in head.unlabelled
        },
        "head": head.to_dict(),
        "cv": adaptation.cv,
        "fit": adaptation.train,
        "fit_seconds": round(adaptation.seconds, 4),
        **_recalibration_member(adaptation.recalibration),
        "labels": dict(labels),
        "base_model": base_model,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def unlabelled_rule(head) -> str:
    """How the adapted model treats the classes without a label, in words."""
    if not head.unlabelled:
        return "every class has labels"
    if all(float(head.discount[c]) == 1.0 for c in head.unlabelled):
        return "classes without a label keep the base model's probabilities"
    return (
        "classes without a label keep the base model's probabilities times A / (A + e), e the "
        f"base model's expected count of the class among the labelled buildings, A = "
        f"{UNLABELLED_PSEUDO_COUNT:g} (unlabelled_discount in the head)"
    )


def _recalibration_member(recalibration: Recalibration | None) -> dict[str, Any]:
    """``{"recalibration": ...}`` of an ``adaptation`` block (empty when none was fitted)."""
    return {} if recalibration is None else {"recalibration": recalibration.to_dict()}


def calibration_after_adapt(block: Mapping[str, Any]) -> dict[str, Any]:
    """The ``calibration`` prop of an adapted model: the temperature ``adapt`` fitted on the
    labels (:mod:`app.adapt.recalibrate`), on the kept model's output, or ``T = 1`` when it
    kept the probabilities as they were (the base model's temperature is applied inside the
    head, to the base probabilities it reads)."""
    r = block.get("recalibration") or {}
    t = float(r.get("temperature", 1.0))  # 1 unless the recalibration was kept
    base = (
        f"the base model's T = {block['head']['base_temperature']:.4g} is applied inside the head"
    )
    selection = (
        f"fitted on the out-of-fold probabilities of the {r.get('n')} labels (adapt's "
        f"recalibration); {base}"
        if r.get("kept")
        else f"the adapted model's probabilities are used as fitted; {base}"
    )
    ece = r.get("ece") if r.get("kept") else None
    return {
        "method": "temperature scaling",
        "temperature": t,
        "fitted_on": {"selection": selection, "n": block["labels"].get("n")},
        "before": {"ece_cross_fitted": ece[0]} if ece else None,
        "after": {"ece_cross_fitted": ece[1]} if ece else None,
        "adapted": True,
    }


def write_adapted(
    base: str | os.PathLike, out: str | os.PathLike, block: Mapping[str, Any]
) -> Path:
    """Write a copy of ``base`` carrying ``block`` (and its ``calibration`` prop,
    :func:`calibration_after_adapt`), atomically; the graph is unchanged. Returns ``out``.

    Raises:
        AdaptError: ``out`` does not end in .onnx.
    """

    import onnx

    out = Path(out)
    if out.suffix != ".onnx":
        raise AdaptError(f"{out}: the model file name must end in .onnx")
    proto = onnx.load(str(base))
    props = {METADATA_KEY: dict(block), "calibration": calibration_after_adapt(block)}
    set_metadata(proto, props)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out, suffix=".onnx") as tmp:
        onnx.save(proto, str(tmp))
    return out


def unlabelled_text(block: Mapping[str, Any], what: str = "label") -> str | None:
    """What became of the classes without a label, in a few words (None: every class has
    labels), e.g. ``no label, base probability discounted: minor-damage x0.091``."""
    kept = block.get("unlabelled_classes") or []
    if not kept:
        return None
    rho = block.get("unlabelled_discount") or {}
    if any(float(rho.get(n, 1.0)) < 1.0 for n in kept):
        parts = ", ".join(f"{n} x{float(rho.get(n, 1.0)):.3g}" for n in kept)
        return f"no {what}, base probability discounted: {parts}"
    return f"unchanged (no {what}): {', '.join(kept)}"


def few_tiles_text(block: Mapping[str, Any]) -> str | None:
    """A caution when a head was kept on labels of fewer than
    :data:`app.adapt.fit.GROUP_MIN_TILES` tiles (None: the base model kept, or labels of more
    tiles): its cross-validation could not hold a tile out, and on Hurricane Michael labels of
    one area misled heads that graded the other areas worse (docs/experiments/fewshot.md)."""
    labels = block.get("labels") or {}
    n = labels.get("groups") or len(labels.get("tiles") or [])
    if block.get("method") in (None, "base") or n >= GROUP_MIN_TILES:
        return None
    return (
        f"labels of {n} tile{'s' if n != 1 else ''} or scene{'s' if n != 1 else ''} only: the "
        "cross-validation could not check the head on a tile it did not see; labels of one area "
        "do not always carry to the next, so check it on another tile before grading a wider "
        "area, or label a few buildings there"
    )


def format_adaptation(block: Mapping[str, Any]) -> str:
    """The ``adaptation`` block in a few lines, for the terminal and the model card."""
    labels = block.get("labels") or {}
    per_class = ", ".join(f"{k} {v}" for k, v in (labels.get("per_class") or {}).items())
    events = ", ".join(f"{k} {v}" for k, v in (labels.get("events") or {}).items())
    base = block.get("base_model") or {}
    cv = block.get("cv") or {}
    lines = [
        f"head {block.get('method')} on {labels.get('n', '?')} labels ({per_class}; events: "
        f"{events or '?'}), base model {base.get('file')} (sha256 {str(base.get('sha256'))[:12]})",
        f"cross-validation ({cv.get('scheme', '?')}), NLL / accuracy / macro-F1:",
    ]
    for method, m in (cv.get("candidates") or {}).items():
        mark = " <- chosen" if method == block.get("method") else ""
        if m.get("nll_recalibrated") is not None:  # the base model: what the others must beat
            mark += f" (recalibrated NLL {m['nll_recalibrated']:.4f}, the NLL to beat)"
        lines.append(
            f"  {method:<15} {m['nll']:.4f} / {m['accuracy']:.4f} / {m['macro_f1']:.4f}{mark}"
        )
    for method, why in (cv.get("not_tried") or {}).items():
        lines.append(f"  {method:<15} not tried: {why}")
    for text in (unlabelled_text(block), recalibration_text(block), few_tiles_text(block)):
        if text:
            lines.append(text)
    return "\n".join(lines)


def format_finetune(block: Mapping[str, Any]) -> str:
    """The cross-validated curve of ``adapt --finetune/--semi`` and why the network was kept or
    not, a few lines for the terminal and the app."""
    details, cv = block.get("finetune") or {}, block.get("cv") or {}
    choice = details.get("choice") or {}
    lines = [
        "held-out curve over epochs (0 = the base network), NLL / accuracy / macro-F1 / intact recall:"
    ]
    for row in cv.get("curve") or []:
        intact = row.get("intact_recall")
        lines.append(
            f"  epoch {row['epoch']:>2}  {row['nll']:.4f} / {row['accuracy']:.4f} / "
            f"{row['macro_f1']:.4f} / {'n/a' if intact is None else f'{intact:.4f}'}"
        )
    best = choice.get("best_epoch")
    figures = f"{choice.get('gain', 0):.4f} nats per label (se {choice.get('gain_se', 0):.4f})"
    if choice.get("f1_gain") is not None:
        figures += (
            f", out-of-fold macro-F1 {choice['f1_gain']:+.4f} "
            f"(bootstrap se {choice.get('f1_gain_se', 0):.4f})"
        )
    if details.get("epochs"):
        lines.append(
            f"kept: {details['epochs']} epoch(s), the lowest held-out NLL, better than the base "
            f"network by {figures}"
        )
    elif best:
        lines.append(
            f"kept: the base network; epoch {best} had the lowest held-out NLL ({figures} against "
            f"the base network) but did not beat it clearly; the rule: {FINETUNE_RULE}"
        )
    else:
        lines.append("kept: the base network; no epoch lowered the held-out NLL")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# end to end


@dataclass
class AdaptResult:
    """What :func:`adapt_model` wrote: the model file, its ``adaptation`` block, and the seconds
    of the embedding pass and of the fit (cross-validation and final head)."""

    out: Path
    block: dict[str, Any]
    embed_seconds: float
    fit_seconds: float


def adapt_model(
    predictor,
    buildings,
    out: str | os.PathLike,
    methods: Sequence[str] = METHODS,
    batch_size: int = 32,
    seed: int = 0,
    unlabelled: str = "discount",
) -> AdaptResult:
    """Adapt the head of ``predictor``'s model to the labelled buildings and write ``out``.

    Args:
        predictor: the base :class:`runtime.predictor.Predictor` (an adapted model is refitted
            from its graph, not stacked).
        buildings: :class:`app.adapt.labelled.Buildings`; only the labelled ones are used.
        out: the ``.onnx`` file to write (atomically; may be the base model itself).
        methods: the heads to try.
        batch_size: chips per inference batch.
        seed: seed of the cross-validation split.
        unlabelled: what happens to classes without a label (``app.adapt.fit.UNLABELLED_RULES``).

    Raises:
        AdaptError: no labelled building, fewer than two classes, ``out`` not ``.onnx``.
    """
    if Path(out).suffix != ".onnx":
        raise AdaptError(f"{out}: the model file name must end in .onnx")
    labelled = buildings.subset(buildings.labelled)
    sources = "; ".join(buildings.sources) or "the given buildings"
    if len(labelled) == 0:
        raise AdaptError(f"{sources}: no labelled building to adapt to")
    start = time.perf_counter()
    pred = predictor.predict(labelled.pre, labelled.post, batch_size=batch_size)
    raw = pred.raw_logits if pred.raw_logits is not None else pred.logits
    embed_seconds = time.perf_counter() - start
    try:
        adaptation = adapt_head(
            raw,
            pred.embedding,
            labelled.labels,
            base_model(predictor),
            methods,
            seed,
            unlabelled,
            labelled.groups(),
        )
    except AdaptError as exc:
        raise AdaptError(f"{sources}: {exc}") from exc
    names = list(predictor.class_names)
    block = adaptation_block(
        adaptation, names, predictor.path, predictor.metadata, labelled.counts(names)
    )
    write_adapted(predictor.path, out, block)
    return AdaptResult(Path(out), block, embed_seconds, adaptation.seconds)


# --------------------------------------------------------------------------------------------
# a fine-tuned network (``adapt --finetune`` / ``--semi``; the training is local_damage's)


def identity_head(method: str, k: int, d: int, base_temperature: float = 1.0) -> Head:
    """A head that returns the graph's own probabilities at temperature ``base_temperature``:
    what a fine-tuned model carries (``T = 1``; a base model kept, its own ``T0``), so that every
    reader of the ``adaptation`` block finds one."""
    weights = np.zeros((k, d + k))
    weights[:, d:] = np.eye(k)
    return Head(method, list(range(k)), weights, np.zeros(k), float(base_temperature), k)


@dataclass(frozen=True)
class NetworkFit:
    """What fine-tuning the network gave, as the ``adaptation`` block of
    :func:`network_block` records it (the training itself is ``local_damage``'s).

    Attributes:
        method: ``finetune`` or ``semi``; ``base`` when the base network was kept.
        embed_dim: the network's embedding size ``D`` (the identity head's width).
        cv: the cross-validated curve over epochs (``scheme``, ``candidates``, ``curve``).
        seconds: wall time of the fine-tuning.
        details: the ``finetune`` block: epochs, options, the choice.
        base_temperature: ``T0`` of the identity head (1 for a fine-tuned network; the base
            model's own when the base network was kept).
        recalibration: the temperature fitted on the kept network's out-of-fold probabilities
            (:mod:`app.adapt.recalibrate`); None: not fitted.
    """

    method: str
    embed_dim: int
    cv: Mapping[str, Any]
    seconds: float
    details: Mapping[str, Any]
    base_temperature: float = 1.0
    recalibration: Recalibration | None = None


def network_block(
    fit: NetworkFit,
    class_names: Sequence[str],
    base_path: str | os.PathLike,
    base_metadata: Mapping[str, Any],
    labels: Mapping[str, Any],
) -> dict[str, Any]:
    """The ``adaptation`` metadata prop of a fine-tuned model (``fit.method`` ``finetune`` or
    ``semi``): the same block as an adapted head's, with an identity head (the network itself
    was changed), ``cv`` the cross-validated curve over epochs and ``finetune`` the details.

    Args:
        fit: what the fine-tuning gave (:class:`NetworkFit`).
        class_names: the model's classes.
        base_path: the base model file.
        base_metadata: its metadata.
        labels: the labels' counts per class (:meth:`app.adapt.labelled.Buildings.counts`).
    """
    head = identity_head(fit.method, len(class_names), fit.embed_dim, fit.base_temperature)
    previous = base_metadata.get(METADATA_KEY)
    if isinstance(previous, Mapping) and isinstance(previous.get("base_model"), Mapping):
        base_model = dict(previous["base_model"])
        base_model["adapted_from"] = {"file": Path(base_path).name, "sha256": sha256(base_path)}
    else:
        base_model = {
            "file": Path(base_path).name,
            "sha256": sha256(base_path),
            "calibration": base_of(base_metadata)[1],
        }
    return {
        "method": fit.method,
        "selection": (
            "epochs of fine-tuning with the lowest cross-validated NLL of the given labels, kept "
            f"only if they beat the base network clearly: {FINETUNE_RULE}"
        ),
        "labelled_classes": list(class_names),
        "unlabelled_classes": [],
        "unlabelled_rule": "the network was fine-tuned; every class is scored by it",
        "unlabelled_discount": {},
        "head": head.to_dict(),
        "cv": dict(fit.cv),
        "finetune": dict(fit.details),
        "fit_seconds": round(float(fit.seconds), 3),
        **_recalibration_member(fit.recalibration),
        "labels": dict(labels),
        "base_model": base_model,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
