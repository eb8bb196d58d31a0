"""`local-damage export`: a trained run to a self-describing ONNX model."""

from __future__ import annotations

import argparse
import json
import sys
import time

from local_damage.export.model import (
    DEFAULT_OPSET,
    INT8_METHODS,
    ExportError,
    export_run,
    export_weights,
    format_report,
)


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
        "--weights",
        metavar="NAME.safetensors",
        help="also write the run's weights as fp16 safetensors, small enough to ship next to the "
        "model, for fine-tuning with `local-damage train --init`",
    )
    p.add_argument("--json", action="store_true", help="print the parity report as JSON")
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    try:
        report = export_run(
            args.run,
            args.out,
            quantize=args.quantize,
            fp16=args.fp16,
            opset=args.opset,
            chips=args.chips,
            parity_limit=args.parity_chips,
            calibration_limit=args.calibration_chips,
            int8_method=args.int8_method,
            change_map=args.change_map,
            test_metrics=args.test_metrics,
            calibrate_fold=args.calibrate_fold,
        )
    except (ExportError, FileNotFoundError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report, args.out))
    if args.weights:
        print(f"wrote {export_weights(args.run, args.weights)} (fp16 weights for --init)")
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0
