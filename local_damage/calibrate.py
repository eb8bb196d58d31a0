"""`local-damage calibrate`: fit a temperature to an ONNX model on labelled chips and store it.

The model is run through :class:`local_damage.evaluate.OnnxScorer` (the ONNX Runtime predictor
that serving uses) on the labelled chips of a chip store, or of one fold of its splits; the
temperature ``T`` that minimises the negative log-likelihood of their labels
(:func:`app.calibration.fit_temperature`) is written into a copy of the model as the
``calibration`` metadata prop, with where it was fitted and the ECE / NLL / Brier score of those
chips before and after. The graph is not changed: the predictor applies ``T`` to the
probabilities. No torch is imported, so a scoring machine can calibrate.

``T`` must be fitted on chips the model did not train on (its validation fold): on training
chips a network is more confident and more often right than on new ones, so the fitted ``T``
comes out too small and the model stays over-confident.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from local_damage.evaluate import Scored


def _rounded(metrics: dict[str, float]) -> dict[str, float]:
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


def calibrate_model(
    model: str | Path,
    chips: str | Path,
    out: str | Path,
    fold: int | None = None,
    batch_size: int = 64,
    progress: bool = False,
) -> dict[str, Any]:
    """Fit a temperature to ``model`` on labelled chips and write the calibrated model to ``out``.

    Args:
        model: an ONNX model written by ``local-damage export``.
        chips: a chip store cut with the model's chip spec.
        out: the ``.onnx`` file to write, under a temporary name first, then renamed (may be
            ``model`` itself, to calibrate in place).
        fold: fit on the chips of this fold of ``chips/splits.csv``; None: every labelled chip.
        batch_size: chip pairs per ONNX Runtime call.
        progress: show a progress bar.

    Returns:
        The ``calibration`` block stored in the model (see
        :func:`app.calibration.calibration_block`): ``temperature``, ``fitted_on`` (chips, fold,
        selection, n), ``before`` and ``after`` (ECE, NLL, Brier score, accuracy on those chips).

    Raises:
        FileNotFoundError: no model file, no manifest in ``chips``, or ``fold`` given and no
            splits.csv.
        ValueError: ``out`` does not end in .onnx, ``fold`` is not a fold of splits.csv, the
            selection holds no labelled chip, the model is not a local-damage model, or no
            temperature fits (:class:`app.calibration.CalibrationError`).
    """
    import onnx

    from app.calibration import METADATA_KEY, calibration_block, fit_temperature
    from app.predictor import Predictor, softmax
    from local_damage.evaluate import OnnxScorer, select_chips, warn_spec_mismatch
    from local_damage.export import save_onnx, set_metadata
    from local_damage.metrics import calibration_metrics

    model, chips, out = Path(model), Path(chips), Path(out)
    if out.suffix != ".onnx":
        raise ValueError(f"{out}: the model file name must end in .onnx")
    scorer = OnnxScorer(model)
    chip_ids, description, unlabelled = select_chips(chips, fold)
    warn_spec_mismatch(scorer, chips)
    note = fold_note(scorer.predictor.metadata, fold)
    if note:
        print(note, file=sys.stderr)
    scored = scorer.score(chips, chip_ids, views=1, batch_size=batch_size, progress=progress)
    try:
        temperature = fit_temperature(scored.logits, scored.labels)
    except ValueError as exc:
        raise type(exc)(f"{chips} ({description}): {exc}") from exc
    labels = scored.labels
    block = calibration_block(
        temperature,
        fitted_on={
            "chips": str(chips),
            "fold": fold,
            "selection": description,
            "n": len(labels),
            "unlabelled_left_out": unlabelled,
        },
        before=_rounded(calibration_metrics(softmax(scored.logits), labels)),
        after=_rounded(calibration_metrics(softmax(scored.logits / temperature), labels)),
    )
    proto = onnx.load(str(model))
    set_metadata(proto, {METADATA_KEY: block})
    save_onnx(proto, out)
    written = Predictor(out).temperature
    if written is None or abs(written - temperature) > 1e-9 * temperature:
        raise ValueError(
            f"{out}: the written model carries temperature {written}, not {temperature}"
        )
    return block


def calibration_report(
    scored: Scored, temperature: float | None
) -> tuple[dict[str, Any], dict[str, dict]]:
    """Calibration figures of scored chips, and the reliability tables to plot.

    Returns:
        ``(block, curves)``: ``block`` is ``{"temperature", "bins", "before", "after"}`` with
        ``before`` the :func:`~local_damage.metrics.calibration_metrics` (ECE, NLL, Brier,
        accuracy) of the softmax of the raw logits and ``after`` those of the calibrated
        probabilities (None without a temperature); ``curves`` maps a legend label with the ECE
        to the :func:`~local_damage.metrics.reliability_bins` of each.
    """
    from app.predictor import softmax
    from local_damage.metrics import ECE_BINS, calibration_metrics, reliability_bins

    raw = softmax(scored.logits)
    before = calibration_metrics(raw, scored.labels)
    after = calibration_metrics(scored.probabilities, scored.labels) if temperature else None
    curves = {
        f"{'before calibration' if temperature else 'uncalibrated'} (ECE {before['ece']:.3f})": (
            reliability_bins(raw, scored.labels)
        )
    }
    if after is not None:
        label = f"after, T = {temperature:.3f} (ECE {after['ece']:.3f})"
        curves[label] = reliability_bins(scored.probabilities, scored.labels)
    block = {"temperature": temperature, "bins": ECE_BINS, "before": before, "after": after}
    return block, curves


def format_block(block: dict[str, Any]) -> str:
    """One line per fact of a calibration block, for the terminal."""
    fitted = block["fitted_on"]
    lines = [
        f"temperature T = {block['temperature']:.4f} fitted on {fitted['n']} buildings "
        f"({fitted['selection']})"
    ]
    before, after = block.get("before"), block.get("after")
    if before and after:
        lines.append(
            "on those chips: "
            + ", ".join(
                f"{name} {before[key]:.4f} -> {after[key]:.4f}"
                for key, name in (("ece", "ECE"), ("nll", "NLL"), ("brier", "Brier"))
            )
            + f" (accuracy {after['accuracy']:.4f}, unchanged)"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# command line


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``local-damage calibrate``."""
    p = sub.add_parser(
        "calibrate",
        help="fit a temperature to an ONNX model on validation chips (calibrated probabilities)",
        description=(
            "Temperature scaling: fit the temperature T that minimises the negative "
            "log-likelihood of labelled chips the model did not train on, and write a copy of the "
            "model with T in its `calibration` metadata. Scoring, the app and evaluate then give "
            "softmax(logits / T) as the probabilities; grades do not change. Runs without torch."
        ),
    )
    p.add_argument("--model", required=True, metavar="MODEL.onnx", help="model to calibrate")
    p.add_argument("--chips", required=True, metavar="CHIPS", help="labelled chip store")
    p.add_argument(
        "--fold",
        type=int,
        metavar="K",
        help="fit on fold K of CHIPS/splits.csv (the model's validation fold); default: every "
        "labelled chip of CHIPS",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="NAME.onnx",
        help="calibrated model to write (may be MODEL itself; written atomically)",
    )
    p.add_argument(
        "--batch-size", type=int, default=64, metavar="N", help="pairs per batch (default 64)"
    )
    p.add_argument("--json", action="store_true", help="print the calibration block as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        print(f"error: --batch-size must be at least 1, got {args.batch_size}", file=sys.stderr)
        return 2
    try:
        block = calibrate_model(
            args.model,
            args.chips,
            args.out,
            fold=args.fold,
            batch_size=args.batch_size,
            progress=not args.quiet,
        )
    except (FileNotFoundError, ValueError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: {message}", file=sys.stderr)
        return 2
    print(json.dumps(block, indent=2) if args.json else format_block(block))
    print(f"wrote {args.out}")
    return 0
