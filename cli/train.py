"""`local-damage train`: parser and command (torch is imported only when it runs)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cli.options import add_chips_args, add_output_args, add_report_args
from data_prep.errors import UsageError
from local_damage.config import load_yaml


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model on a chip store",
        description="Train a LOCAL (or SCL / L-SCL / CE baseline) model on a chip store and write a run folder: config.yaml, best.safetensors, checkpoints/last/, metrics.csv, curves.png, summary.json.",
    )
    p.add_argument(
        "--config", metavar="YAML", help="training config (see configs/); defaults when omitted"
    )
    add_chips_args(
        p,
        fold_help="hold out fold K of CHIPS/splits.csv for validation (see `local-damage split`); without it every labelled chip is used for training",
    )
    add_output_args(p, metavar="RUN", help="run folder to write")
    p.add_argument(
        "--holdout",
        type=int,
        metavar="K",
        help="never use fold K of CHIPS/splits.csv (neither training nor validation): test tiles for `local-damage evaluate --fold K`",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set train.batch_size=16 --set model.encoder=resnet18 (repeatable)",
    )
    p.add_argument(
        "--init",
        metavar="RUN|CHECKPOINT",
        help="start from trained weights: a run folder or a .safetensors file (fine-tuning on a new disaster)",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue RUN from its last checkpoint exactly"
    )
    add_report_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from local_damage.train.config import Config
    from local_damage.train.loaders import ChipSplit
    from local_damage.train.loop import train

    config_path = args.config
    if args.resume:
        saved = Path(args.out) / "config.yaml"
        if not saved.is_file():
            raise UsageError(f"{saved}: no saved config; cannot resume a run that never started")
        config_path = saved
    cfg = load_yaml(Config, config_path, args.set)
    summary = train(
        cfg,
        args.chips,
        args.out,
        ChipSplit(fold=args.fold, holdout=args.holdout),
        init=args.init,
        resume=args.resume,
        progress=not args.quiet,
    )
    best = summary.get("best_val_macro_f1")
    shown = (
        f"best validation macro-F1 {best:.4f} at epoch {summary['best_epoch'] + 1}"
        if best is not None
        else f"trained {summary['best_epoch'] + 1} epoch(s) without validation"
    )
    print(f"{args.out}: {shown}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True, default=str))
    return 0
