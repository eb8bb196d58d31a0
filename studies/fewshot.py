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
and ``OUT/fewshot.png`` (:mod:`studies.fewshot_report`). An event's measurements are kept
in ``OUT/<event>/measurements.json`` and reused when the settings and base model are the same.

This module is the command line; the settings and chip splits are in
:mod:`studies.fewshot_settings`, the base models in :mod:`studies.fewshot_base`, the measurements in
:mod:`studies.fewshot_measure` and the report in :mod:`studies.fewshot_run`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from studies import fewshot_report as report
from studies.fewshot_settings import FEWSHOT_JSON, FEWSHOT_MD, FEWSHOT_PNG, Settings


def run(args: argparse.Namespace) -> int:
    # torch-bearing: imported here so that `local-damage --help` needs no torch
    from studies.fewshot_run import run_fewshot

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
