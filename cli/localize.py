"""`local-damage localize train|export|evaluate`: the building localiser's commands.

A command group of its own rather than a ``train --task`` flag: the localiser learns from xBD
tiles and label polygons (``--xbd``, alias ``--root``), not from a chip store (``--chips``), and
its export and evaluation options differ from the damage model's.
"""

from __future__ import annotations

import argparse
import json
import sys

from cli.options import (
    LOCALIZER_CHOICE,
    add_model_args,
    add_output_args,
    add_report_args,
    add_xbd_args,
)
from local_damage.config import load_yaml
from runtime.contract import ModelError
from runtime.evaluation.localizer import evaluate_model, format_scores
from runtime.registry import default_localizer


def _split_args(p: argparse.ArgumentParser) -> None:
    """``--xbd`` and the tile folds (``--folds``, ``--split-seed``, ``--splits``)."""
    add_xbd_args(p, repeatable=True, help="xBD root: images/ and labels/ (or split folders)")
    p.add_argument(
        "--folds",
        type=int,
        default=5,
        metavar="K",
        help="tile folds, as `split --folds` (default 5)",
    )
    p.add_argument(
        "--split-seed",
        type=int,
        default=14,
        metavar="SEED",
        help="seed of the tile folds, as `split --seed` (default 14: the default model's)",
    )
    p.add_argument(
        "--splits",
        metavar="CSV",
        help="take the tile folds from a chip store's splits.csv instead of computing them",
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "localize",
        help="train, export and evaluate the building localiser (U-Net on the pre image)",
        description="The building localiser: a U-Net on the pre-disaster image trained on building masks rasterised from xBD label polygons, exported as a self-describing ONNX model (uint8 image in, building probability out).",
    )
    lsub = p.add_subparsers(dest="localize", metavar="WHAT", required=True)

    t = lsub.add_parser(
        "train",
        help="train a localiser on xBD tiles",
        description="Train a localiser and write a run folder: config.yaml, best.safetensors, last.safetensors, metrics.csv, summary.json (with the threshold and smallest blob chosen on the validation fold).",
    )
    t.add_argument(
        "--config", metavar="YAML", help="config (configs/localize.yaml); defaults when omitted"
    )
    _split_args(t)
    add_output_args(t, metavar="RUN", help="run folder to write")
    t.add_argument(
        "--fold",
        type=int,
        metavar="K",
        help="validation fold: the best epoch, threshold and smallest blob are chosen on its tiles",
    )
    t.add_argument("--holdout", type=int, metavar="K", help="test fold, never read in training")
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set train.epochs=4 --set data.scale=1.0 (repeatable)",
    )
    add_report_args(t)
    t.set_defaults(func=run_train)

    e = lsub.add_parser(
        "export",
        help="a trained localiser run to ONNX",
        description="Export a localiser run to ONNX (input `image` uint8 [N,H,W,3], output `building` float32 [N,H,W]) with its metadata, checked against PyTorch on a real tile.",
    )
    e.add_argument("--run", required=True, metavar="RUN", help="run folder of `localize train`")
    add_output_args(e, metavar="ONNX", help="model file to write")
    add_xbd_args(
        e, required=False, repeatable=True, help="xBD root for the parity tile (default: the run's)"
    )
    e.add_argument(
        "--quantize",
        choices=["int8"],
        help="int8 weights and activations (static QDQ, ranges from training tiles)",
    )
    e.add_argument(
        "--test-metrics",
        metavar="JSON",
        help="held-out figures from `localize evaluate --out` to store in the model",
    )
    e.add_argument("--opset", type=int, default=17, help="ONNX opset (default 17)")
    add_report_args(e, json=False)
    e.set_defaults(func=run_export)

    v = lsub.add_parser(
        "evaluate",
        help="pixel precision / recall / F1 of an exported localiser on the tiles of a fold",
        description="Score an exported localiser on the tiles of one fold: building pixels predicted vs building pixels of the label polygons (xView2 localisation F1), counts pooled over the tiles.",
    )
    add_model_args(
        v, help=f"exported localiser: {LOCALIZER_CHOICE} (default: the bundled localizer)"
    )
    _split_args(v)
    v.add_argument("--fold", type=int, required=True, metavar="K", help="fold to score")
    v.add_argument("--threads", type=int, metavar="N", help="ONNX Runtime intra-op threads")
    add_output_args(v, required=False, metavar="JSON", help="write the figures here")
    add_report_args(v)
    v.set_defaults(func=run_evaluate)


def run_train(args: argparse.Namespace) -> int:
    from local_damage.localize.config import LocalizeConfig
    from local_damage.localize.train import TileSplit, train_localizer

    cfg = load_yaml(LocalizeConfig, args.config, args.set)
    summary = train_localizer(
        cfg,
        args.xbd,
        args.out,
        TileSplit(
            fold=args.fold,
            holdout=args.holdout,
            folds=args.folds,
            split_seed=args.split_seed,
            splits=args.splits,
        ),
        progress=not args.quiet,
    )
    op = summary["operating_point"]
    shown = (
        f"validation pixel F1 {op['f1']:.4f} at threshold {op['threshold']}, "
        f"smallest blob {op['min_area_px']} px"
        if op.get("chosen_on")
        else "no validation fold: threshold 0.5"
    )
    print(f"{args.out}: {shown}; {summary['seconds_per_epoch']:.1f} s/epoch", file=sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


def run_export(args: argparse.Namespace) -> int:
    from local_damage.localize.export import export_localizer

    report = export_localizer(
        args.run,
        args.out,
        root=args.xbd,
        quantize=args.quantize,
        test_metrics=args.test_metrics,
        opset=args.opset,
    )
    print(json.dumps(report, indent=2))
    return 0


def run_evaluate(args: argparse.Namespace) -> int:
    model = args.model if args.model is not None else default_localizer()
    if model is None:
        raise ModelError("no --model given and no bundled localiser (models/localizer.onnx)")
    result = evaluate_model(
        model,
        args.xbd,
        args.fold,
        folds=args.folds,
        split_seed=args.split_seed,
        splits=args.splits,
        threads=args.threads,
        out=args.out,
    )
    if not args.quiet:
        for row in result["per_tile"]:
            print(f"{row['tile']:<32} F1 {row['f1']:.4f}  {row['seconds']:.2f}s", file=sys.stderr)
    print(
        f"fold {args.fold}: {format_scores(result)}; {result['seconds_per_tile']:.2f} s/tile",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps(result, indent=2))
    return 0
