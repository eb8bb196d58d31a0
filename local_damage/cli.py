"""The `local-damage` console script: one entry point, one subcommand per job.

Parsers are cheap to build; each subcommand imports its library (torch, onnxruntime, gradio) only
when it runs, so `local-damage --help` is instant and serving commands never load torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from local_damage import __version__


def build_parser() -> argparse.ArgumentParser:
    from app import adapt_cli, bench_alignment, bench_flags, bench_score
    from app import cli as app_cli
    from data_prep import cli as data_prep_cli
    from local_damage import (
        bench_infer,
        bench_train,
        calibrate,
        cv,
        evaluate,
        export,
        fewshot,
        geometry,
        probe,
    )
    from local_damage.localize import cli as localize_cli
    from local_damage.train import cli as train_cli

    parser = argparse.ArgumentParser(
        prog="local-damage",
        description="Grade building damage from paired pre/post-disaster satellite imagery (LOCAL).",
    )
    parser.add_argument("--version", action="version", version=f"local-damage {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    data_prep_cli.register(sub)
    geometry.add_parser(sub)
    train_cli.add_parser(sub)
    app_cli.add_parser(sub)
    evaluate.add_parser(sub)
    cv.add_parser(sub)
    export.add_parser(sub)
    calibrate.add_parser(sub)
    adapt_cli.add_parser(sub)
    probe.add_parser(sub)
    localize_cli.add_parser(sub)

    bench = sub.add_parser(
        "bench",
        help="performance benchmarks that print figures",
        description="Benchmarks: each prints its figures with ratios against a baseline measured in the same run.",
    )
    bench_sub = bench.add_subparsers(dest="bench", metavar="WHAT", required=True)
    data_prep_cli.register_bench(bench_sub)
    bench_train.add_parser(bench_sub)
    bench_infer.add_parser(bench_sub)
    fewshot.add_parser(bench_sub)
    bench_flags.add_parser(bench_sub)
    bench_alignment.add_parser(bench_sub)
    bench_score.add_parser(bench_sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
