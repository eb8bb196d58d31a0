"""The parsers of the benchmarks that check behaviour rather than speed: `local-damage bench
flags`, `alignment` and `adapt`.

Each benchmark's measurement and its ``run(args)`` live in :mod:`bench`; only the command line is
defined here, with the shared options of :mod:`cli.options`, so that :mod:`bench` never imports
:mod:`cli`. The defaults the parsers show are the benchmark modules' own constants.
"""

from __future__ import annotations

import argparse

from bench import adapt as bench_adapt
from bench import alignment as bench_alignment
from bench import flags as bench_flags
from cli.options import (
    MODEL_CHOICE,
    add_json_switch,
    add_model_args,
    add_report_args,
    add_seed_arg,
    comma_list,
)
from runtime.flags import MISALIGNED_CONTEXT_PX, MISALIGNED_PX


def add_flags(bench_sub: argparse._SubParsersAction) -> None:
    """Register ``local-damage bench flags``."""
    p = bench_sub.add_parser(
        "flags",
        help="abstain flags: false alarms on real chips, detection on corrupted copies",
        description=(
            "Print the share of real chip pairs of a fold that get each abstain flag (false "
            "alarms) and the share of corrupted copies that get the flag they should (black pre "
            "or post -> blank, cloud overlay -> cloud, haze veil -> haze, shifted post -> "
            "misaligned, another event's post -> ood). Seeded; no torch."
        ),
    )
    add_model_args(p, help=f"model to flag with: {MODEL_CHOICE} (default: the bundled default)")
    p.add_argument("--chips", required=True, metavar="CHIPS", help="chip store")
    p.add_argument("--fold", type=int, metavar="K", help="fold of CHIPS/splits.csv (default all)")
    shift = bench_flags.SHIFT_PX
    p.add_argument(
        "--shift",
        type=float,
        default=shift,
        metavar="PX",
        help=f"shift of the shifted-post case in chip pixels (default {shift:g})",
    )
    add_seed_arg(p, help="seed of the corruptions")
    p.add_argument("--limit", type=int, metavar="N", help="use at most N pairs of the fold")
    add_json_switch(p, help="print the figures as JSON")
    add_report_args(p, json=False)
    p.set_defaults(func=bench_flags.run)


def add_alignment(bench_sub: argparse._SubParsersAction) -> None:
    """Register ``local-damage bench alignment``."""
    p = bench_sub.add_parser(
        "alignment",
        help="misaligned flag: false alarms on real xBD tiles, detection on shifted copies",
        description=(
            "For a fold of an xBD chip store: measure and correct each tile's post-to-pre shift "
            "as `score --labels` does, then print the share of real buildings flagged "
            "misaligned and the share flagged once the post imagery is moved by each shift, "
            "for the measurement around each building (scoring) and on the chip pair alone "
            "(chip mode). Seeded; no torch, no model."
        ),
    )
    p.add_argument("--chips", required=True, metavar="CHIPS", help="xBD chip store")
    p.add_argument(
        "--fold",
        type=int,
        nargs="+",
        default=[1],
        metavar="K",
        help="fold, or several folds measured together (default 1)",
    )
    p.add_argument(
        "--context-shifts",
        type=float,
        nargs="+",
        default=[4.0, 8.0, 12.0, 16.0],
        metavar="PX",
        help="post image shifts in source pixels (default 4 8 12 16)",
    )
    p.add_argument(
        "--context-limit",
        type=float,
        default=MISALIGNED_CONTEXT_PX,
        metavar="PX",
        help="misaligned above this residual shift around the building, in source pixels "
        f"(default {MISALIGNED_CONTEXT_PX:g})",
    )
    p.add_argument(
        "--shifts",
        type=float,
        nargs="+",
        default=[4.0, 8.0, 16.0],
        metavar="PX",
        help="post chip shifts in chip pixels (default 4 8 16)",
    )
    p.add_argument(
        "--limit",
        type=float,
        default=MISALIGNED_PX,
        metavar="PX",
        help=f"misaligned above this residual shift of a chip pair, in chip pixels "
        f"(default {MISALIGNED_PX:g})",
    )
    add_seed_arg(p, help="seed of the shift directions")
    add_json_switch(p, help="print the figures as JSON")
    add_report_args(p, json=False)
    p.set_defaults(func=bench_alignment.run)


def add_adapt(bench_sub: argparse._SubParsersAction) -> None:
    """Register ``local-damage bench adapt``."""
    p = bench_sub.add_parser(
        "adapt",
        help="seconds to adapt a model to 10-50 labels and to every label of a store",
        description=(
            "Adapt a model, as `local-damage adapt` does, to random draws of N labelled "
            "buildings of a chip store for each N of --labels, and to all of them (the "
            "baseline); print the seconds of the fit (every head cross-validated, the chosen "
            "one fitted on all), of the embedding pass and of both, with the fit's ratio to "
            "the baseline. Libraries are loaded by one untimed adaptation first. No torch."
        ),
    )
    add_model_args(p)
    p.add_argument("--chips", required=True, metavar="CHIPS", help="labelled chip store")
    p.add_argument("--fold", type=int, metavar="K", help="only fold K of CHIPS/splits.csv")
    p.add_argument("--event", metavar="NAME", help="only the buildings of this event")
    labels = bench_adapt.LABELS
    p.add_argument(
        "--labels",
        type=comma_list(int, "counts", "10,20", at_least=2),
        default=list(labels),
        metavar="N,N",
        help=f"label counts to draw (default {','.join(map(str, labels))})",
    )
    p.add_argument(
        "--repeats", type=int, default=3, metavar="R", help="draws per count (default 3)"
    )
    add_seed_arg(p, help="seed of the first draw")
    add_json_switch(p, help="print the figures as JSON")
    add_report_args(p, json=False)
    p.set_defaults(func=bench_adapt.run)
