"""The `local-damage` console script: one entry point, one subcommand per job.

Parsers are cheap to build; each subcommand imports its torch-bearing library only when it runs,
so `local-damage --help` is instant and serving commands never load torch.

What the user sees is decided here: library code logs (``logging.getLogger(__name__)``) and the
messages go to standard error, plain, at INFO (WARNING with ``--quiet``); a
:class:`~data_prep.errors.LocalDamageError` from any command is printed as ``error: ...`` with
exit status 2, and any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from cli import adapt as adapt_cli
from cli import bench_checks, bench_speed, studies
from cli import calibrate as calibrate_cli
from cli import cv as cv_cli
from cli import evaluate as evaluate_cli
from cli import export as export_cli
from cli import geometry as geometry_cli
from cli import labels as labels_cli
from cli import localize as localize_cli
from cli import prepare as prepare_cli
from cli import pretrain as pretrain_cli
from cli import probe as probe_cli
from cli import score as score_cli
from cli import train as train_cli
from cli.options import resolve_models
from data_prep.errors import LocalDamageError
from local_damage import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="local-damage",
        description="Grade building damage from paired pre/post-disaster satellite imagery (LOCAL).",
    )
    parser.add_argument("--version", action="version", version=f"local-damage {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    prepare_cli.register(sub)
    geometry_cli.add_parser(sub)
    train_cli.add_parser(sub)
    score_cli.add_parser(sub)
    evaluate_cli.add_parser(sub)
    cv_cli.add_parser(sub)
    export_cli.add_parser(sub)
    calibrate_cli.add_parser(sub)
    adapt_cli.add_parser(sub)
    probe_cli.add_parser(sub)
    pretrain_cli.add_parser(sub)
    localize_cli.add_parser(sub)
    labels_cli.add_parser(sub)

    bench = sub.add_parser(
        "bench",
        help="performance benchmarks that print figures",
        description="Benchmarks: each prints its figures with ratios against a baseline measured in the same run.",
    )
    bench_sub = bench.add_subparsers(dest="bench", metavar="WHAT", required=True)
    prepare_cli.register_bench(bench_sub)
    bench_speed.add_train(bench_sub)
    bench_speed.add_infer(bench_sub)
    studies.add_fewshot(bench_sub)
    bench_checks.add_flags(bench_sub)
    bench_checks.add_alignment(bench_sub)
    bench_speed.add_score(bench_sub)
    bench_speed.add_city(bench_sub)
    bench_checks.add_adapt(bench_sub)
    bench_speed.add_map(bench_sub)
    studies.add_new_tile(bench_sub)
    bench_speed.add_app(bench_sub)
    return parser


class StderrHandler(logging.Handler):
    """Writes each record to the standard error of the moment (so a redirected or captured
    ``sys.stderr`` gets it), one line each."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


def configure_logging(quiet: bool = False) -> None:
    """Library log records to standard error as plain messages: INFO and up, WARNING and up when
    ``quiet``; the project's loggers only (third-party libraries keep their own settings)."""
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in ("data_prep", "runtime", "local_damage", "app", "cli", "bench"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.WARNING if quiet else logging.INFO)
        logger.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    configure_logging(quiet=bool(getattr(args, "quiet", False)))
    try:
        resolve_models(args)  # --model default, --localizer localizer: from any folder
        return int(args.func(args) or 0)
    except LocalDamageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
