"""The parsers of the studies reached as benchmarks: `local-damage bench fewshot` (the
leave-one-event-out few-shot report) and `local-damage bench new-tile` (a new tile of a known
event). Their work and ``run(args)`` live in :mod:`studies`; only the command line is here.
"""

from __future__ import annotations

import argparse

from app.adapt.fit import UNLABELLED_RULES
from cli.options import add_model_args, add_report_args, add_seed_arg, comma_list
from studies import fewshot as studies_fewshot
from studies import newtile as studies_newtile
from studies.fewshot_settings import DEFAULT_CONFIG, DEFAULT_K

#: ``--k`` and ``--tune-k``: numbers of labels, commas or spaces between them.
_KS = comma_list(int, "numbers of labels", "0,5,20", spaces=True, empty=())


def add_fewshot(bench_sub: argparse._SubParsersAction) -> None:
    """Register ``local-damage bench fewshot``."""
    p = bench_sub.add_parser(
        "fewshot",
        help="leave-one-event-out few-shot report: adapt and fine-tune on k labels of an unseen event",
        description=(
            "Hold out each event of CHIPS in turn: train a base model on the others "
            "(OUT/<event>/base, reused when finished), then per repeat take k labelled buildings "
            "of the held-out event (at random, and by the suggestion ranking), adapt the head to "
            "them (as `local-damage adapt`), fine-tune the network on the random ones (`train "
            "--init`), and score accuracy and macro-F1 on the rest of the event. Writes "
            "OUT/fewshot.json, OUT/fewshot.md (tables) and OUT/fewshot.png (macro-F1 against k), "
            "prints the table and the goal checks. See docs/adapt.md."
        ),
    )
    p.add_argument(
        "--chips", required=True, metavar="CHIPS", help="labelled chip store with events"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        metavar="YAML",
        help=f"training config of the base models (default {DEFAULT_CONFIG})",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of the config, e.g. --set train.epochs=5 (repeatable)",
    )
    p.add_argument(
        "--events", metavar="A,B", help="events to hold out, comma-separated (default: every event)"
    )
    p.add_argument(
        "--k",
        type=_KS,
        default=list(DEFAULT_K),
        metavar="K,K,...",
        help="numbers of labels (default 0,5,10,20,50,100; 0 is the base model)",
    )
    p.add_argument("--repeats", type=int, default=5, help="draws per k (default 5)")
    add_seed_arg(p, help="seed of the draws and splits")
    p.add_argument(
        "--finetune-epochs",
        type=int,
        default=8,
        metavar="N",
        help="most epochs of `adapt --finetune` on the k labels, the number kept chosen by "
        "cross-validation on them (default 8; 0: no finetune and semi arms)",
    )
    p.add_argument(
        "--tune-k",
        type=_KS,
        metavar="K,K,...",
        help="the numbers of labels at which the finetune and semi arms run (default: every k "
        "of --k; each fine-tuning takes tens of seconds)",
    )
    p.add_argument(
        "--val-share",
        type=float,
        default=0.1,
        metavar="F",
        help="share of the training events' chips (whole tiles) kept out of training to "
        "calibrate the base model (default 0.1; 0: none, uncalibrated)",
    )
    p.add_argument(
        "--pool-share",
        type=float,
        default=0.5,
        metavar="F",
        help="share of the held-out event's buildings the labels are drawn from; the rest is "
        "evaluated (default 0.5; at least max k)",
    )
    p.add_argument(
        "--draw",
        choices=("random", "area"),
        default="random",
        help="pool and graded buildings split at random (default) or by area: whole spatial "
        "blocks of tiles (`split --by block`), so the labels come from some neighbourhoods and "
        "the others are graded",
    )
    p.add_argument(
        "--min-eval",
        type=int,
        default=20,
        metavar="N",
        help="fewest buildings left to evaluate on; a smaller event is skipped (default 20)",
    )
    p.add_argument(
        "--unlabelled",
        choices=UNLABELLED_RULES,
        default="discount",
        help="adapt's rule for classes without a label (as `local-damage adapt --unlabelled`; "
        "default discount)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_report_args(p, quiet=False)
    p.set_defaults(func=studies_fewshot.run)


def add_new_tile(bench_sub: argparse._SubParsersAction) -> None:
    """Register ``local-damage bench new-tile``."""
    p = bench_sub.add_parser(
        "new-tile",
        help="a new tile of a known event: adapt to k of its buildings, grade the rest; how "
        "often adapting made it worse",
        description=(
            "For each k, draw tiles the model did not train on from the chip stores, label k of "
            "a tile's buildings at random, adapt the model to them (--arms: heads as `adapt`, "
            "finetune as `adapt --finetune`, semi as `adapt --semi`), grade the rest of the tile, "
            "and print the mean macro-F1 of the base and adapted models and the share of draws "
            "where adapting lost more than 0.01 macro-F1. See docs/experiments/fewshot.md."
        ),
    )
    add_model_args(p, help="base model (default: the bundled model)")
    p.add_argument(
        "--chips", action="append", required=True, metavar="CHIPS", help="chip store (repeatable)"
    )
    p.add_argument(
        "--k",
        type=comma_list(int, "numbers of labels", "5,20", at_least=2, spaces=True),
        default=list(studies_newtile.K),
        metavar="K,K",
        help="labels (default 5,10,20,50)",
    )
    p.add_argument("--draws", type=int, default=50, metavar="N", help="draws per k (default 50)")
    add_seed_arg(p, help="seed of the draws")
    p.add_argument(
        "--min-eval", type=int, default=20, metavar="N", help="buildings left to grade (default 20)"
    )
    p.add_argument(
        "--arms",
        type=comma_list(str, "arms", "heads,semi", choices=studies_newtile.ARMS),
        default=["heads"],
        metavar="LIST",
        help="heads,finetune,semi",
    )
    p.add_argument(
        "--tune-draws",
        type=int,
        metavar="N",
        help="draws per k for the finetune and semi arms (default: --draws; each takes tens "
        "of seconds)",
    )
    p.add_argument("--out", metavar="JSON", help="also write every draw here")
    p.add_argument("--plot", metavar="PNG", help="also plot the gain and the share made worse")
    add_report_args(p)
    p.set_defaults(func=studies_newtile.run)
