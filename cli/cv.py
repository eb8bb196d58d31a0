"""`local-damage cv`: k-fold cross-validation of training configs, as the paper's tables."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from cli.options import add_report_args, comma_list, cost_type

#: The cross-validation's logger: its fold lines show even with --quiet (which silences the
#: training progress bars and epoch lines).
CV_LOGGER = "local_damage.experiments.cv"
#: The inner folds' logger (`--inner`): which recipe each test fold chose, shown the same way.
INNER_LOGGER = "local_damage.experiments.nested"


def _parse_folds(text: str) -> list[int]:
    try:
        folds = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected fold numbers such as 0,1,2, got {text!r}"
        ) from None
    if not folds:
        raise argparse.ArgumentTypeError("expected at least one fold number")
    return folds


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cv",
        help="cross-validate training configs and write the paper's tables",
        description=(
            "For each config and each fold of CHIPS/splits.csv: train with the fold held out "
            "(OUT/<method>/fold<K>), evaluate on it, and write OUT/table2.md (accuracy mean "
            "(min-max) per config), OUT/table3.md (per-class F1 with prevalence, per method), "
            "their CSV versions, OUT/cv_results.json, and OUT/cv_table.md (accuracy, macro-F1, "
            "per-class F1, share of buildings on intact tiles graded damaged and ECE: mean "
            "(min-max) over folds, pooled, per fold and per event) with each method's pooled "
            "out-of-fold predictions in OUT/<method>/oof_predictions.csv. With --inner K the "
            "configs are candidate recipes: for each test fold one is chosen on K inner folds of "
            "the training tiles and reported as the method 'selected'. Finished folds are reused."
        ),
    )
    p.add_argument(
        "--config",
        required=True,
        nargs="+",
        metavar="YAML",
        help="training config(s), one method each",
    )
    p.add_argument(
        "--chips", required=True, metavar="CHIPS", help="chip store folder with splits.csv"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument(
        "--folds",
        type=_parse_folds,
        metavar="K,K,...",
        help="folds to run (default: all in splits.csv)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of every config, e.g. --set train.epochs=5 (repeatable)",
    )
    p.add_argument(
        "--name",
        nargs="+",
        metavar="NAME",
        help="method names, one per config (default: file stems)",
    )
    p.add_argument(
        "--views",
        type=int,
        choices=(1, 2),
        default=2,
        help="2 (default): second augmented view for SAA/SAD in each fold's metrics; 1: skip it",
    )
    p.add_argument(
        "--holdout",
        type=int,
        metavar="K",
        help="a fold never trained on nor evaluated (test tiles kept for the final figures)",
    )
    p.add_argument(
        "--inner",
        type=int,
        default=0,
        metavar="K",
        help="choose one config per test fold on K inner folds of its training tiles (nested "
        "cross-validation; OUT/inner/outer<F>/selection.json); 0 (default): every config is a method",
    )
    p.add_argument(
        "--inner-seed", type=int, default=0, metavar="S", help="seed of the inner folds (default 0)"
    )
    p.add_argument(
        "--max-false-alarm",
        type=float,
        metavar="F",
        help="with --inner: only recipes whose inner folds call at most this share of intact "
        "buildings damaged compete on macro-F1 (none: the one calling the fewest), e.g. 0.10",
    )
    p.add_argument(
        "--inner-by",
        choices=("area", "event"),
        default="area",
        help="with --inner K: how the inner folds are made; area (default): the outer split's "
        "tiles or spatial blocks dealt into K folds; event: the K training events with the most "
        "labelled buildings held out in turn (the other events always trained on), so a recipe "
        "is chosen on disasters its inner models never saw",
    )
    p.add_argument(
        "--costs",
        type=comma_list(cost_type, "false-alarm costs", "1,2,3"),
        metavar="C,C,...",
        help="with --inner: try every config under each false-alarm cost (`score "
        "--false-alarm-cost`; each inner model is trained once and graded again); the chosen "
        "cost becomes the outer run's grade.false_alarm_cost, which `export` writes as the "
        "model's own rule (default: each config's own grade.false_alarm_cost)",
    )
    p.add_argument("--quiet", action="store_true", help="no training progress bars or epoch lines")
    add_report_args(p, quiet=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # torch-bearing: imported here so that `local-damage --help` needs no torch
    from local_damage.experiments.cv import CVOptions, cross_validate
    from local_damage.experiments.cv_tables import CV_RESULTS, table2, table3

    loggers = [logging.getLogger(name) for name in (CV_LOGGER, INNER_LOGGER)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
    options = CVOptions(
        folds=args.folds,
        holdout=args.holdout,
        views=args.views,
        inner=args.inner,
        inner_seed=args.inner_seed,
        max_false_alarm=args.max_false_alarm,
        costs=args.costs,
        inner_by=args.inner_by,
        progress=not args.quiet,
    )
    try:
        results = cross_validate(
            args.config, args.chips, args.out, options, overrides=args.set, names=args.name
        )
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    else:
        print(table2(results)[0])
        print(table3(results)[0])
        print((Path(args.out) / "cv_table.md").read_text())
    print(f"wrote {Path(args.out) / CV_RESULTS}, table2.md/.csv, table3.md/.csv, cv_table.md")
    if results["failed"]:
        print(f"{len(results['failed'])} fold(s) failed:", file=sys.stderr)
        for item in results["failed"]:
            print(f"  {item['method']} fold {item['fold']}: {item['error']}", file=sys.stderr)
        return 1
    return 0
