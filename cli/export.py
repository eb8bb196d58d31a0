"""`local-damage export`: a trained run to a self-describing ONNX model."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cli.options import add_json_switch, add_report_args, cost_type
from data_prep.errors import UsageError
from data_prep.store import write_json
from local_damage.export.options import DEFAULT_OPSET, ExportOptions, check_out
from local_damage.export.quantize import INT8_METHODS
from runtime.evaluation.calibrate import (
    CalibrationOptions,
    calibrate_model,
    format_block,
    format_ood,
)
from runtime.evaluation.chips import select_chips, store_folds
from runtime.evaluation.out_of_fold import calibrate_from_folds, check_inputs

if TYPE_CHECKING:
    from local_damage.export.model import RunExport


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``local-damage export``."""
    p = sub.add_parser(
        "export",
        help="export a trained run to a self-describing ONNX model",
        description=(
            "Export a run's best weights to ONNX: uint8 [N,H,W,3] inputs `pre` and `post`, "
            "normalisation inside the graph, outputs `logits` and `embedding`; classes, chip "
            "spec, config, validation metrics and training-data licence in the metadata. "
            "Checked against PyTorch on the run's validation chips; the report is printed, "
            "stored in the model and written to NAME.parity.json."
        ),
    )
    p.add_argument("--run", required=True, metavar="RUN", help="run folder of `local-damage train`")
    p.add_argument("--out", required=True, metavar="NAME.onnx", help="model file to write")
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--quantize",
        choices=["int8"],
        help="write an int8 model (static QDQ quantization calibrated on training chips)",
    )
    group.add_argument("--fp16", action="store_true", help="write an fp16 model (for GPU serving)")
    p.add_argument(
        "--int8-method",
        choices=INT8_METHODS,
        default="static",
        help="int8 quantization: static (calibrated, default) or dynamic",
    )
    p.add_argument(
        "--opset", type=int, default=DEFAULT_OPSET, metavar="N", help="ONNX opset (default 17)"
    )
    p.add_argument(
        "--chips",
        metavar="CHIPS",
        help="chip store for the parity check and calibration (default: the run's own)",
    )
    p.add_argument(
        "--parity-chips",
        type=int,
        default=512,
        metavar="N",
        help="at most N chips for the parity check (default 512)",
    )
    p.add_argument(
        "--calibration-chips",
        type=int,
        default=128,
        metavar="N",
        help="at most N training chips to calibrate int8 ranges (default 128)",
    )
    p.add_argument(
        "--change-map",
        action="store_true",
        help="also output `change_map`, the latent correlation map the web app shows as a "
        "heatmap (models with a latent module)",
    )
    p.add_argument(
        "--test-metrics",
        metavar="METRICS.json",
        help="held-out figures from `local-damage evaluate` to store in the model's metadata "
        "(shown by the web app's model card)",
    )
    p.add_argument(
        "--calibrate-fold",
        type=int,
        metavar="K",
        help="fit a temperature on fold K of the chip store (the run's validation fold) and store "
        "it in the model, so its probabilities are calibrated (see `local-damage calibrate`)",
    )
    p.add_argument(
        "--oof-predictions",
        metavar="CSV",
        help="for a run trained on every labelled chip: fit the temperature on the out-of-fold "
        "predictions of its recipe's cross-validation (`cv`'s oof_predictions.csv); goes with "
        "--oof-folds",
    )
    p.add_argument(
        "--oof-folds",
        nargs="+",
        metavar="FOLD_RUN",
        help="with --oof-predictions: fold runs of that cross-validation with embeddings.npz "
        "(`python -m local_damage.experiments.fold_extras`); the ood threshold and scene "
        "reference take the rank among training chips that held-out chips' quantiles had in "
        "those folds' models. The prototypes come from every labelled chip of the run's store",
    )
    p.add_argument(
        "--no-temperature",
        action="store_true",
        help="with --calibrate-fold or --oof-predictions: keep the raw probabilities (T = 1); "
        "the fitted temperature is recorded in the model, not applied. The ood prototypes and "
        "threshold are stored as usual",
    )
    p.add_argument(
        "--false-alarm-cost",
        type=cost_type,
        metavar="C",
        help="the model's own grade rule, which `score` and the app use when the analyst sets no "
        "cost: a damaged grade only where at least C times as probable as no-damage (default: "
        "the run config's grade.false_alarm_cost, 1 unless set: the most probable grade)",
    )
    p.add_argument(
        "--weights",
        metavar="NAME.safetensors",
        help="also write the run's weights as fp16 safetensors, small enough to ship next to the "
        "model, for fine-tuning with `local-damage train --init`",
    )
    add_json_switch(p, help="print the parity report as JSON")
    add_report_args(p, json=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # torch-bearing: imported here so that `local-damage --help` needs no torch
    from local_damage.export.model import RunExport
    from local_damage.export.parity import format_report
    from local_damage.export.weights import export_weights

    start = time.perf_counter()
    oof = args.oof_predictions is not None
    if oof != (args.oof_folds is not None):
        raise UsageError("--oof-predictions and --oof-folds go together")
    if oof and args.calibrate_fold is not None:
        raise UsageError("calibrate on a fold (--calibrate-fold) or out of fold, not both")
    if args.no_temperature and args.calibrate_fold is None and not oof:
        raise UsageError("--no-temperature goes with --calibrate-fold K or --oof-predictions")
    out = check_out(args.out)
    export = RunExport(
        args.run,
        ExportOptions(
            quantize=args.quantize,
            fp16=args.fp16,
            opset=args.opset,
            chips=args.chips,
            parity_limit=args.parity_chips,
            calibration_limit=args.calibration_chips,
            int8_method=args.int8_method,
            change_map=args.change_map,
            test_metrics=args.test_metrics,
            false_alarm_cost=args.false_alarm_cost,
        ),
    )
    if oof:
        report = export_out_of_fold(
            export, out, args.oof_predictions, args.oof_folds, temperature=not args.no_temperature
        )
    elif args.calibrate_fold is None:
        report = export.write(out)
    else:
        report = export_calibrated(
            export, out, args.calibrate_fold, temperature=not args.no_temperature
        )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        text = format_report(report, args.out)
        if report.get("calibration"):
            text += "\n" + format_block(report["calibration"]) + "\n" + format_ood(report["ood"])
        print(text)
    if args.weights:
        print(f"wrote {export_weights(args.run, args.weights)} (fp16 weights for --init)")
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def _export_then_calibrate(export: RunExport, out: Path, calibrate) -> dict[str, Any]:
    """Export to a staged file, then ``calibrate(staged)`` it into ``out`` (so a failed fit
    leaves nothing at ``out``); write the parity report to ``NAME.parity.json``.

    Returns:
        The parity report with the ``calibration`` and ``ood`` blocks stored in the model.
    """
    with tempfile.TemporaryDirectory(prefix="export-") as tmp:
        staged = Path(tmp) / "staged.onnx"
        report = export.write(staged)
        calibrated = calibrate(staged)
    write_json(out.with_suffix(".parity.json"), report)
    return {**report, "calibration": calibrated["calibration"], "ood": calibrated["ood"]}


def export_out_of_fold(
    export: RunExport,
    out: Path,
    oof_predictions: str,
    fold_runs: list[str],
    temperature: bool = True,
) -> dict[str, Any]:
    """Export, then calibrate from the recipe's cross-validation into ``out``
    (:func:`runtime.evaluation.out_of_fold.calibrate_from_folds`); missing inputs fail before
    any work (:func:`runtime.evaluation.out_of_fold.check_inputs`)."""
    check_inputs(oof_predictions, fold_runs)
    return _export_then_calibrate(
        export,
        out,
        lambda staged: calibrate_from_folds(
            staged, export.store, out, oof_predictions, fold_runs, temperature=temperature
        ),
    )


def export_calibrated(
    export: RunExport, out: Path, fold: int, temperature: bool = True
) -> dict[str, Any]:
    """Export, then calibrate on ``fold`` of the export's chip store into ``out``; the class
    prototypes of the ``ood`` flag come from the other folds except the run's held-out one.
    ``temperature=False`` keeps the raw probabilities
    (:func:`runtime.evaluation.calibrate.calibrate_model`)."""
    select_chips(export.store, fold)  # a missing fold fails here, before any work
    holdout = export.info.summary.get("holdout")
    folds = [f for f in store_folds(export.store) if f not in (fold, holdout)]
    options = CalibrationOptions(fold=fold, prototype_folds=folds, temperature=temperature)
    return _export_then_calibrate(
        export, out, lambda staged: calibrate_model(staged, export.store, out, options)
    )
