"""`local-damage train`: parser and command (heavy imports happen only when it runs)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model on a chip store",
        description="Train a LOCAL (or SCL / L-SCL / CE baseline) model on a chip store and write a run folder: config.yaml, best.safetensors, checkpoints/last/, metrics.csv, curves.png, summary.json.",
    )
    p.add_argument(
        "--config", metavar="YAML", help="training config (see configs/); defaults when omitted"
    )
    p.add_argument("--chips", required=True, metavar="CHIPS", help="chip store folder")
    p.add_argument("--out", required=True, metavar="RUN", help="run folder to write")
    p.add_argument(
        "--fold",
        type=int,
        metavar="K",
        help="hold out fold K of CHIPS/splits.csv for validation (see `local-damage split`); without it every labelled chip is used for training",
    )
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
    p.add_argument("--quiet", action="store_true", help="no progress bar or per-epoch lines")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from local_damage.config import ConfigError, load_yaml
    from local_damage.train.config import Config

    config_path = args.config
    if args.resume:
        saved = Path(args.out) / "config.yaml"
        if not saved.is_file():
            print(
                f"error: {saved}: no saved config; cannot resume a run that never started",
                file=sys.stderr,
            )
            return 2
        config_path = saved
    try:
        cfg = load_yaml(Config, config_path, args.set)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from local_damage.train.loop import train

    try:
        summary = train(
            cfg,
            args.chips,
            args.out,
            fold=args.fold,
            holdout=args.holdout,
            init=args.init,
            resume=args.resume,
            progress=not args.quiet,
        )
    except (FileNotFoundError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    best = summary.get("best_val_macro_f1")
    shown = (
        f"best validation macro-F1 {best:.4f} at epoch {summary['best_epoch'] + 1}"
        if best is not None
        else f"trained {summary['best_epoch'] + 1} epoch(s) without validation"
    )
    print(f"{args.out}: {shown}", file=sys.stderr)
    return 0
