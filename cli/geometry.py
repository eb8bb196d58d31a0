"""`local-damage geometry`: where SCL and OCL put class embeddings (no images)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cli.options import add_report_args, add_seed_arg, comma_list
from data_prep.errors import UsageError
from local_damage.experiments.geometry import (
    LOSS_NAMES,
    XBD_PROPORTIONS,
    GeometryConfig,
    GeometryError,
    markdown_table,
    run_geometry,
    write_outputs,
)


def add_parser(sub) -> argparse.ArgumentParser:
    """Register the ``geometry`` subcommand on an argparse subparsers object."""
    p = sub.add_parser(
        "geometry",
        help="SCL vs OCL class geometry on free unit vectors (no images)",
        description=(
            "Optimise free unit vectors (N samples, K classes, dimension D) under SCL and OCL with "
            "shuffled mini-batches and report the geometry of the class means: Gram matrix, "
            "largest |cos| between classes, within-class cosine, full-batch loss against the "
            "theorems' values. Writes NAME.json, NAME.md and NAME.png to --out and prints the "
            "table."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--proportions",
        type=comma_list(float, "numbers", "0.25,0.25,0.25,0.25"),
        default=XBD_PROPORTIONS,
        help="class proportions, comma-separated (normalised to sum 1); the default is "
        "xBD-like, 0.25,0.25,0.25,0.25 is balanced",
    )
    p.add_argument(
        "--batch-sizes",
        type=comma_list(int, "integers", "8,64", empty=()),
        default=(8, 64),
        help="mini-batch sizes, comma-separated",
    )
    p.add_argument(
        "--losses",
        type=comma_list(str.lower, "losses", "scl,ocl", empty=()),
        default=LOSS_NAMES,
        help="scl and/or ocl",
    )
    p.add_argument("--n", type=int, default=400, help="number of samples N")
    p.add_argument("--dim", type=int, default=16, help="embedding dimension D")
    p.add_argument("--steps", type=int, default=10_000, help="optimiser steps per run")
    p.add_argument("--lr", type=float, default=0.01, help="Adam learning rate")
    p.add_argument("--temperature", type=float, default=0.5, help="contrastive temperature t")
    add_seed_arg(p)
    p.add_argument(
        "--tol",
        type=float,
        default=1e-3,
        help="converged when the full-batch loss changes by less than this (relative) "
        "over the last 10%% of the steps",
    )
    p.add_argument("--out", type=Path, default=Path("runs/geometry"), help="output directory")
    p.add_argument("--name", default="geometry", help="stem of the output files")
    add_report_args(p)
    p.set_defaults(func=_cmd_geometry)
    return p


def _cmd_geometry(args: argparse.Namespace) -> int:
    try:
        cfg = GeometryConfig(
            proportions=args.proportions,
            batch_sizes=args.batch_sizes,
            losses=args.losses,
            n=args.n,
            dim=args.dim,
            steps=args.steps,
            lr=args.lr,
            temperature=args.temperature,
            seed=args.seed,
            tol=args.tol,
        )
    except GeometryError as exc:  # the settings, named as the command names them
        raise UsageError(f"local-damage geometry: {exc}") from exc
    log = None if args.quiet else (lambda msg: print(msg, file=sys.stderr))
    results = run_geometry(cfg, log=log)
    paths = write_outputs(results, args.out, args.name)
    print(json.dumps(results, indent=2, default=str) if args.json else markdown_table(results))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
