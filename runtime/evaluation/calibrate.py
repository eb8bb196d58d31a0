"""`local-damage calibrate`: fit a temperature to an ONNX model on labelled chips and store it.

The model is run through :class:`runtime.evaluation.scorers.OnnxScorer` (the ONNX Runtime predictor
that serving uses) on the labelled chips of a chip store, or of one fold of its splits; the
temperature ``T`` that minimises the negative log-likelihood of their labels
(:func:`runtime.calibration.fit_temperature`) is written into a copy of the model as the
``calibration`` metadata prop, with where it was fitted and the ECE / NLL / Brier score of those
chips before and after. The graph is not changed: the predictor applies ``T`` to the
probabilities. No torch is imported, so a scoring machine can calibrate.

``T`` must be fitted on chips the model did not train on (its validation fold): on training
chips a network is more confident and more often right than on new ones, so the fitted ``T``
comes out too small and the model stays over-confident.

The same command stores what the ``ood`` abstain flag needs (:mod:`runtime.flags`), as the ``ood``
metadata prop: the class prototypes (the normalised mean embedding of each class over the
labelled chips of the training folds, ``--prototype-folds``, by default every fold but the
calibration fold) and the threshold (the ``--ood-quantile`` quantile, 1% by default, of the
calibration fold's largest cosine similarity to a prototype), and the reference a whole scene's
familiarity is judged against (:mod:`runtime.familiarity`: the 0.1 quantile of the same scores).
``--no-ood`` leaves it out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime import flags
from runtime.calibration import (
    METADATA_KEY,
    RAW_METHOD,
    CalibrationError,
    calibration_block,
    fit_temperature,
)
from runtime.contract import save_onnx, set_metadata
from runtime.evaluation.chips import select_chips, store_folds, warn_spec_mismatch
from runtime.evaluation.scorers import OnnxScorer, Scored
from runtime.familiarity import SCENE_KEY, scene_reference
from runtime.flags import class_prototypes, ood_block, ood_scores, ood_threshold
from runtime.metrics import calibration_metrics
from runtime.predictor import Predictor, softmax

log = logging.getLogger(__name__)


def rounded_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {k: round(float(v), 6) for k, v in metrics.items()}


def fold_note(metadata: dict[str, Any], fold: int | None) -> str | None:
    """A warning when the chips may include the model's training chips, else None."""
    validation = metadata.get("validation_metrics")
    val_fold = validation.get("fold") if isinstance(validation, dict) else None
    if fold is not None and val_fold is not None and int(val_fold) == int(fold):
        return None
    where = f"fold {fold}" if fold is not None else "every labelled chip of the store"
    if val_fold is None:
        return (
            f"note: the model's metadata names no validation fold; if it was trained on {where}, "
            "the fitted temperature is too small (the model stays over-confident)"
        )
    return (
        f"note: the model was validated on fold {val_fold}, and {where} may hold its training "
        f"chips; fit on its validation fold (--fold {val_fold}) for an honest temperature"
    )


#: Default fraction of in-distribution calibration chips the ``ood`` threshold flags.
OOD_QUANTILE = 0.01


@dataclass(frozen=True)
class CalibrationOptions:
    """What `local-damage calibrate` fits, and on which chips of the store (the model, the chip
    store and the file written are :func:`calibrate_model`'s arguments).

    Attributes:
        fold: fit on the chips of this fold of ``chips/splits.csv`` (the calibration fold);
            None: every labelled chip.
        chip_ids: fit on these labelled chips instead of a fold (``fold`` must then be None);
            ``selection`` says what they are in the stored block.
        selection: a short description of ``chip_ids``.
        temperature: store the fitted temperature (False: keep the raw probabilities).
        ood: also store the ``ood`` block; False leaves a model's existing one as it is.
        prototype_folds: folds whose labelled chips give the ``ood`` class prototypes; None:
            every fold of splits.csv except ``fold`` (every labelled chip when ``fold`` is
            None).
        prototype_ids: the chips whose labels give the prototypes, instead of folds (e.g. a
            validation slice); ``prototype_folds`` must then be None.
        ood_quantile: fraction of the calibration chips the ``ood`` threshold flags.
        batch_size: chip pairs per ONNX Runtime call.
        progress: show a progress bar.
    """

    fold: int | None = None
    chip_ids: Sequence[str] | None = None
    selection: str = "given chips"
    temperature: bool = True
    ood: bool = True
    prototype_folds: list[int] | None = None
    prototype_ids: Sequence[str] | None = None
    ood_quantile: float = OOD_QUANTILE
    batch_size: int = 64
    progress: bool = False


def _prototype_chips(
    chips: Path, fold: int | None, prototype_folds: list[int] | None
) -> tuple[list[str], list[int] | None, str]:
    """``(chip ids, folds, description)`` of the chips prototypes come from (see :func:`fit_ood`)."""
    if prototype_folds is None and fold is not None:
        prototype_folds = [f for f in store_folds(chips) if f != fold]
    if prototype_folds is None:
        return select_chips(chips, None)[0], None, f"all labelled chips of {chips}"
    known = store_folds(chips)
    bad = [f for f in prototype_folds if f not in known]
    if bad or not prototype_folds:
        raise CalibrationError(
            f"{chips / 'splits.csv'}: prototype fold(s) {bad or prototype_folds} not usable; "
            f"the folds are {known}"
        )
    if fold is not None and fold in prototype_folds:
        raise CalibrationError(
            f"--prototype-folds {prototype_folds} include the calibration fold {fold}; the "
            "threshold must be chosen on chips the prototypes were not made from"
        )
    ids: list[str] = []
    for f in prototype_folds:
        ids += select_chips(chips, f)[0]
    return (
        ids,
        prototype_folds,
        f"folds {', '.join(map(str, prototype_folds))} of {chips / 'splits.csv'}",
    )


def fit_ood(
    scorer,
    chips: str | Path,
    threshold_scored: Scored,
    options: CalibrationOptions | None = None,
) -> dict[str, Any]:
    """Class prototypes and the ``ood`` threshold of a model (the ``ood`` metadata prop).

    Args:
        scorer: the model (:class:`runtime.evaluation.scorers.OnnxScorer`).
        chips: the chip store.
        threshold_scored: the model's outputs on the calibration chips (fold ``options.fold``);
            the threshold is the ``options.ood_quantile`` quantile of their largest cosine to a
            prototype.
        options: the calibration fold, where the prototypes come from (``prototype_folds`` or
            ``prototype_ids``), the quantile, batches and progress (default
            ``CalibrationOptions()``; the temperature and chip selection are not used here).

    Returns:
        The block of :func:`runtime.flags.ood_block`.

    Raises:
        CalibrationError: a prototype fold that is not in splits.csv, or that is the calibration
            fold; both prototype folds and prototype chips.
    """
    chips = Path(chips)
    options = options or CalibrationOptions()
    fold, prototype_folds, prototype_ids = (
        options.fold,
        options.prototype_folds,
        options.prototype_ids,
    )
    if prototype_ids is not None:
        if prototype_folds is not None:
            raise CalibrationError("give prototype folds or prototype chips, not both")
        ids, selection = list(prototype_ids), f"{len(prototype_ids)} given chips of {chips}"
    else:
        ids, prototype_folds, selection = _prototype_chips(chips, fold, prototype_folds)
    scored = scorer.score(
        chips, ids, views=1, batch_size=options.batch_size, progress=options.progress
    )
    names = list(scorer.class_names)
    protos, classes = class_prototypes(scored.z, scored.labels, len(names))
    scores = ood_scores(threshold_scored.z, protos)
    quantile = options.ood_quantile
    threshold = ood_threshold(scores, quantile)
    return ood_block(
        protos,
        threshold,
        [names[c] for c in classes],
        quantile,
        prototypes_from={
            "chips": str(chips),
            "folds": prototype_folds,
            "selection": selection,
            "n": {names[c]: int((scored.labels == c).sum()) for c in classes},
        },
        threshold_from={
            "chips": str(chips),
            "fold": fold,
            "n": len(scores),
            "flagged": round(float(np.mean(scores < threshold)), 6),
        },
        scene=scene_reference(scores),
    )


def _fold_chips(scorer: OnnxScorer, chips: Path, fold: int | None) -> tuple[list[str], str, int]:
    """``(chip ids, description, unlabelled left out)`` of the labelled chips of ``fold`` (every
    labelled chip when None), with a warning when the chips were cut with another spec than the
    model's or may include its training chips (:func:`fold_note`)."""
    chip_ids, description, unlabelled = select_chips(chips, fold)
    warn_spec_mismatch(scorer, chips)
    note = fold_note(scorer.predictor.metadata, fold)
    if note:
        log.warning(note)
    return chip_ids, description, unlabelled


def calibrate_model(
    model: str | Path,
    chips: str | Path,
    out: str | Path,
    options: CalibrationOptions | None = None,
) -> dict[str, Any]:
    """Fit a temperature to ``model`` on labelled chips and write the calibrated model to ``out``;
    also store the class prototypes and ``ood`` threshold (:func:`fit_ood`) unless
    ``options.ood`` is False. With ``options.temperature`` False the model keeps its raw
    probabilities: the block stores ``T = 1`` with ``method: raw``, the fitted temperature as
    ``fitted_temperature`` and what it would have done as ``after_if_fitted`` (e.g. when a
    temperature judged on out-of-fold predictions made some tiles worse: docs/experiments/cv.md).

    Args:
        model: an ONNX model written by ``local-damage export``.
        chips: a chip store cut with the model's chip spec.
        out: the ``.onnx`` file to write, under a temporary name first, then renamed (may be
            ``model`` itself, to calibrate in place).
        options: the chips fitted on (a fold or given chips), whether the temperature and the
            ``ood`` block are stored, where the prototypes come from, batches and progress
            (default ``CalibrationOptions()``: every labelled chip, both stored).

    Returns:
        ``{"calibration": block, "ood": block or None}``: the ``calibration`` block stored in
        the model (see :func:`runtime.calibration.calibration_block`): ``temperature``,
        ``fitted_on`` (chips, fold, selection, n), ``before`` and ``after`` (ECE, NLL, Brier
        score, accuracy on those chips), and the ``ood`` block (:func:`runtime.flags.ood_block`).

    Raises:
        EvaluationError: no model file, no manifest in ``chips``, ``fold`` given and no
            splits.csv or not one of its folds, or the selection holds no labelled chip
            (:mod:`runtime.evaluation.chips`).
        ModelError: the model is not a local-damage model.
        CalibrationError: ``out`` does not end in .onnx, a bad ood quantile or prototype
            selection, or no temperature fits.
    """
    import onnx

    model, chips, out = Path(model), Path(chips), Path(out)
    options = options or CalibrationOptions()
    fold = options.fold
    if out.suffix != ".onnx":
        raise CalibrationError(f"{out}: the model file name must end in .onnx")
    if not 0 < options.ood_quantile < 1:
        raise CalibrationError(f"the ood quantile must lie in (0, 1), got {options.ood_quantile}")
    if options.prototype_ids is not None and options.prototype_folds is not None:
        raise CalibrationError("give prototype folds or prototype chips, not both")
    scorer = OnnxScorer(model)
    if options.chip_ids is None:
        chip_ids, description, unlabelled = _fold_chips(scorer, chips, fold)
    elif fold is not None:
        raise CalibrationError("give a calibration fold or calibration chips, not both")
    else:  # chips the caller chose (e.g. a validation slice); it answers for them
        chip_ids, description, unlabelled = list(options.chip_ids), options.selection, 0
        warn_spec_mismatch(scorer, chips)
    scored = scorer.score(
        chips, chip_ids, views=1, batch_size=options.batch_size, progress=options.progress
    )
    try:
        fitted_t = fit_temperature(scored.logits, scored.labels)
    except ValueError as exc:
        raise type(exc)(f"{chips} ({description}): {exc}") from exc
    labels = scored.labels
    block = calibration_block(
        fitted_t,
        fitted_on={
            "chips": str(chips),
            "fold": fold,
            "selection": description,
            "n": len(labels),
            "unlabelled_left_out": unlabelled,
        },
        before=rounded_metrics(calibration_metrics(softmax(scored.logits), labels)),
        after=rounded_metrics(calibration_metrics(softmax(scored.logits / fitted_t), labels)),
        applied=options.temperature,
    )
    props: dict[str, Any] = {METADATA_KEY: block}
    ood_fit = None
    if options.ood:
        ood_fit = fit_ood(scorer, chips, scored, options)
        props[flags.METADATA_KEY] = ood_fit
    proto = onnx.load(str(model))
    set_metadata(proto, props)
    save_onnx(proto, out)
    written, expected = Predictor(out).temperature, block["temperature"]
    if written is None or abs(written - expected) > 1e-9 * expected:
        raise ValueError(f"{out}: the written model carries temperature {written}, not {expected}")
    return {"calibration": block, "ood": ood_fit}


def add_scene_reference(
    model: str | Path,
    chips: str | Path,
    out: str | Path,
    fold: int | None = None,
    batch_size: int = 64,
    progress: bool = False,
) -> dict[str, Any]:
    """Add the reference a scene's familiarity is judged against (:mod:`runtime.familiarity`)
    to a model's existing ``ood`` block and write it to ``out``; the prototypes, the threshold,
    the temperature and everything else stay as they are. The reference is taken from the
    familiarity of the labelled chips of ``fold`` (the model's calibration fold) to the stored
    prototypes.

    Returns:
        The model's new ``ood`` block.

    Raises:
        CalibrationError: ``out`` does not end in .onnx, or the model carries no ``ood`` block.
    """
    import onnx

    model, chips, out = Path(model), Path(chips), Path(out)
    if out.suffix != ".onnx":
        raise CalibrationError(f"{out}: the model file name must end in .onnx")
    scorer = OnnxScorer(model)
    check = flags.OodCheck.from_metadata(scorer.predictor.metadata)
    if check is None:
        raise CalibrationError(
            f"{model}: no ood prototypes to measure familiarity against; calibrate without "
            "--scene-only first"
        )
    chip_ids, description, _ = _fold_chips(scorer, chips, fold)
    scored = scorer.score(chips, chip_ids, views=1, batch_size=batch_size, progress=progress)
    familiarity = check.scores(scored.z)
    block = dict(check.block)
    block[SCENE_KEY] = {
        **scene_reference(familiarity),
        "fitted_on": {
            "chips": str(chips),
            "fold": fold,
            "selection": description,
            "n": len(familiarity),
        },
    }
    proto = onnx.load(str(model))
    set_metadata(proto, {flags.METADATA_KEY: block})
    save_onnx(proto, out)
    return block


def format_ood(block: dict[str, Any] | None) -> str:
    """The ``ood`` block in one line, for the terminal."""
    if not block:
        return "no ood prototypes stored (the model never flags ood)"
    src, thr = block["prototypes_from"], block["threshold_from"]
    n = ", ".join(f"{k} {v}" for k, v in src["n"].items())
    carried = thr.get("rank_from_folds")
    where = (
        f"{thr['n']} calibration chips (flags {thr['flagged']:.2%} of them)"
        if not carried
        else f"held-out chips in {len(carried['folds'])} fold models, carried over as the "
        f"{thr['flagged']:.4f} quantile of the model's {thr['n']} training chips"
    )
    return (
        f"ood: {len(block['prototypes'])} class prototypes from {src['selection']} ({n}); "
        f"threshold cos {block['threshold']:.4f} = the {block['quantile']:g} quantile of {where}"
        + (
            f"; a scene is unfamiliar below median familiarity {block['scene']['familiarity']:.4f}"
            f" (their {block['scene']['quantile']:g} quantile)"
            if isinstance(block.get("scene"), dict)
            else ""
        )
    )


def format_block(block: dict[str, Any]) -> str:
    """One line per fact of a calibration block, for the terminal."""
    fitted = block["fitted_on"]
    raw = block.get("method") == RAW_METHOD
    lines = [
        f"temperature T = {block.get('fitted_temperature', block['temperature']):.4f} fitted on "
        f"{fitted['n']} buildings ({fitted['selection']})"
        + ("; not applied: the model keeps its raw probabilities (T = 1)" if raw else "")
    ]
    before, after = block.get("before"), block.get("after_if_fitted" if raw else "after")
    if before and after:
        lines.append(
            ("if applied, on those chips: " if raw else "on those chips: ")
            + ", ".join(
                f"{name} {before[key]:.4f} -> {after[key]:.4f}"
                for key, name in (("ece", "ECE"), ("nll", "NLL"), ("brier", "Brier"))
            )
            + f" (accuracy {after['accuracy']:.4f}, unchanged)"
        )
    return "\n".join(lines)
