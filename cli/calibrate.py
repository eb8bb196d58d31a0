"""`local-damage calibrate`: fit a temperature and the ood threshold to an ONNX model."""

from __future__ import annotations

import argparse
import json

from cli.options import (
    MODEL_CHOICE,
    add_batch_size_arg,
    add_json_switch,
    add_model_args,
    comma_list,
)
from data_prep.errors import UsageError
from runtime.evaluation.calibrate import (
    OOD_QUANTILE,
    CalibrationOptions,
    add_scene_reference,
    calibrate_model,
    format_block,
    format_ood,
)
from runtime.familiarity import SCENE_KEY
from runtime.registry import default_model


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``local-damage calibrate``."""
    p = sub.add_parser(
        "calibrate",
        help="fit a temperature to an ONNX model on validation chips (calibrated probabilities)",
        description=(
            "Temperature scaling: fit the temperature T that minimises the negative "
            "log-likelihood of labelled chips the model did not train on, and write a copy of the "
            "model with T in its `calibration` metadata. Scoring, the app and evaluate then give "
            "softmax(logits / T) as the probabilities; grades do not change. Also stores the "
            "class prototypes of the training folds' embeddings and the threshold of the `ood` "
            "abstain flag chosen on the same chips (`ood` metadata; docs/flags.md). Runs "
            "without torch."
        ),
    )
    add_model_args(p, help=f"model to calibrate: {MODEL_CHOICE} (default: the bundled default)")
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
    add_batch_size_arg(p, 64, "pairs per batch")
    p.add_argument(
        "--prototype-folds",
        type=comma_list(int, "fold numbers", "0,2,4", empty=()),
        metavar="LIST",
        help="comma-separated folds whose labelled chips give the class prototypes of the ood "
        "flag (the model's training folds); default: every fold but --fold",
    )
    p.add_argument(
        "--ood-quantile",
        type=float,
        default=OOD_QUANTILE,
        metavar="Q",
        help=f"fraction of the --fold chips the ood threshold flags (default {OOD_QUANTILE:g})",
    )
    p.add_argument(
        "--no-temperature",
        action="store_true",
        help="keep the raw probabilities (T = 1): the temperature fitted on the chips is recorded "
        "in the model, not applied (e.g. when out-of-fold predictions showed it makes some tiles "
        "worse; docs/experiments/cv.md)",
    )
    p.add_argument(
        "--no-ood",
        action="store_true",
        help="store no class prototypes (an existing ood block is kept as it is)",
    )
    p.add_argument(
        "--scene-only",
        action="store_true",
        help="only add to the model's existing ood block the reference a whole scene's "
        "familiarity is judged against (the 0.1 quantile of the --fold chips' largest cosine "
        "to its stored prototypes; scenes below it are reported as unlike the training data); "
        "the temperature, prototypes and threshold stay as they are",
    )
    add_json_switch(p, help="print the calibration and ood blocks as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {args.batch_size}")
    model = args.model if args.model is not None else default_model()
    if args.scene_only:
        ignored = [
            flag
            for flag, given in (
                ("--no-ood", args.no_ood),
                ("--no-temperature", args.no_temperature),
                ("--prototype-folds", args.prototype_folds),
                ("--ood-quantile", args.ood_quantile != OOD_QUANTILE),
            )
            if given
        ]
        if ignored:
            raise UsageError(
                f"--scene-only changes only the scene reference and keeps the model's temperature "
                f"and ood block as they are; leave out {', '.join(ignored)}"
            )
        block = add_scene_reference(
            model,
            args.chips,
            args.out,
            fold=args.fold,
            batch_size=args.batch_size,
            progress=not args.quiet,
        )
        print(json.dumps(block[SCENE_KEY], indent=2) if args.json else format_ood(block))
        print(f"wrote {args.out}")
        return 0
    folds = args.prototype_folds or None  # none given (or an empty list): every fold but --fold
    options = CalibrationOptions(
        fold=args.fold,
        batch_size=args.batch_size,
        progress=not args.quiet,
        ood=not args.no_ood,
        prototype_folds=folds,
        ood_quantile=args.ood_quantile,
        temperature=not args.no_temperature,
    )
    result = calibrate_model(model, args.chips, args.out, options)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_block(result["calibration"]))
        if not args.no_ood:
            print(format_ood(result["ood"]))
    print(f"wrote {args.out}")
    return 0
