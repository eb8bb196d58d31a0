"""`local-damage bench fewshot`: the leave-one-event-out few-shot report.

For each event of a chip store held out in turn:

1. A base model is trained on the labelled chips of the other events (``OUT/<event>/base``,
   reused when finished, resumed from its last checkpoint when interrupted), a share of their
   tiles (``--val-share``) kept out as a validation slice. It is exported to ONNX
   (``OUT/<event>/base.onnx``, :func:`local_damage.export.model.export_run`) with a temperature and
   class prototypes fitted on that slice, as the bundled model carries them.
2. Per repeat, the event's labelled buildings are split at random into a pool and an evaluation
   set (the same for every arm and k of the repeat). From the pool, k labels are taken: the first
   k of a random order (``adapt-random``), or the suggestions (``adapt-suggested``) in rounds as
   an analyst gets them: the first round (the smallest k) by
   :func:`app.adapt.suggest.suggestion_order` with the base model (a random draw: the random arm's),
   each later round adding the top of the rest of the pool ranked with the head adapted to the
   labels so far (its uncertain buildings interleaved with the next of the random draw). The head is adapted to them with
   :func:`app.adapt.fit.adapt_head` (every head, the lowest cross-validated log-loss kept, as
   ``local-damage adapt`` does, with its rule for classes without a label, ``--unlabelled``) and
   the evaluation set is graded with it. Labels of a single
   class are refused by ``adapt``; the analyst then keeps the base model, and so does the report
   (the row says so).
3. ``finetune``: ``train --init`` from the base run on the random arm's k labels for
   ``--finetune-epochs`` epochs (batch size at most k, the last epoch kept), scored on the same
   evaluation set; its run folder is temporary.

``k = 0`` is the base model. Everything is written to ``OUT/fewshot.json``, ``OUT/fewshot.md``
and ``OUT/fewshot.png`` (:mod:`bench.fewshot_report`). An event's measurements are kept
in ``OUT/<event>/measurements.json`` and reused when the settings and base model are the same.

This module is the command line; the settings and chip splits are in
:mod:`bench.fewshot_settings`, the base models in :mod:`bench.fewshot_base`, the measurements in
:mod:`bench.fewshot_measure` and the report in :mod:`bench.fewshot_run`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from app.adapt.fit import UNLABELLED_RULES
from bench import fewshot_report as report
from bench.fewshot_settings import (
    DEFAULT_CONFIG,
    DEFAULT_K,
    FEWSHOT_JSON,
    FEWSHOT_MD,
    FEWSHOT_PNG,
    Settings,
)
from cli.options import add_report_args


def _ks(text: str) -> list[int]:
    try:
        return [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers of labels such as 0,5,20, got {text!r}"
        ) from None


def add_parser(bench_sub: argparse._SubParsersAction) -> None:
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
        type=_ks,
        default=list(DEFAULT_K),
        metavar="K,K,...",
        help="numbers of labels (default 0,5,10,20,50,100; 0 is the base model)",
    )
    p.add_argument("--repeats", type=int, default=5, help="draws per k (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws and splits (default 0)")
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
        type=_ks,
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # torch-bearing: imported here so that `local-damage --help` needs no torch
    from bench.fewshot_run import run_fewshot

    settings = Settings(
        k=args.k,
        repeats=args.repeats,
        seed=args.seed,
        finetune_epochs=args.finetune_epochs,
        tune_k=args.tune_k,
        val_share=args.val_share,
        pool_share=args.pool_share,
        min_eval=args.min_eval,
        unlabelled=args.unlabelled,
        draw=args.draw,
    )
    events = [e.strip() for e in args.events.split(",") if e.strip()] if args.events else None
    results = run_fewshot(
        args.chips, args.out, args.config, args.set, events, settings, not args.quiet
    )
    ks = results["settings"]["k"]
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    else:
        print("macro-F1 on the rest of the held-out event (mean +- sd)")
        print(report.table(results["summary"], ks, "macro_f1"))
        print("accuracy")
        print(report.table(results["summary"], ks, "accuracy"))
        print("share of draws where adapting made it worse (macro-F1 below k = 0 by > 0.01)")
        print(report.worse_table(results["summary"], ks))
        print("goals:")
        print(report.format_goals(results["goals"]))
    for item in results["skipped"]:
        print(f"not measured: {item['event']}: {item['reason']}", file=sys.stderr)
    out = Path(args.out)
    print(f"wrote {out / FEWSHOT_JSON}, {out / FEWSHOT_MD}, {out / FEWSHOT_PNG}")
    return 0
