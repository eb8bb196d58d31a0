"""`local-damage evaluate` (labelled chips) and `local-damage evaluate xview2` (whole xBD tiles)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from app.scoring.xview2 import METRICS_JSON as XVIEW2_METRICS_JSON
from app.scoring.xview2 import TileSelection, evaluate_xview2, format_table
from cli.options import (
    LOCALIZER_CHOICE,
    MODEL_CHOICE,
    add_batch_size_arg,
    add_localizer_args,
    add_model_args,
    add_report_args,
    add_seed_arg,
    add_xbd_args,
    cost_type,
)
from data_prep.errors import UsageError
from runtime.evaluation.evaluate import (
    METRICS_JSON,
    PREDICTIONS_CSV,
    EvaluationOptions,
    evaluate_chips,
    evaluate_xbd,
    format_summary,
)
from runtime.evaluation.scorers import EvaluationError, OnnxScorer, Scorer
from runtime.registry import default_model


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="score a trained model on labelled chips: metrics, predictions, figures",
        description=(
            "Evaluate a run folder (PyTorch) or an exported ONNX model on labelled chips and write "
            "OUT/metrics.json (accuracy, macro-F1, per-class scores, xView2 damage F1, confusion "
            "matrix, calibration ECE/NLL/Brier before and after the model's temperature, "
            "representation metrics SAA/SAD/CAC/CAD/GPU), OUT/predictions.csv, "
            "OUT/confusion_matrix.png, OUT/reliability.png and t-SNE plots of the embeddings. "
            "One of --chips/--xbd and --out are required; the model is --run, --model or the "
            "bundled default. "
            "`local-damage evaluate xview2` scores whole xBD tiles with the xView2 challenge "
            "metric instead."
        ),
    )
    # not required=True: `evaluate xview2` brings its own options; run() checks them
    model = p.add_mutually_exclusive_group()
    model.add_argument("--run", metavar="RUN", help="run folder of `local-damage train`")
    add_model_args(
        p, help=f"exported model: {MODEL_CHOICE} (default: the bundled default)", group=model
    )
    data = p.add_mutually_exclusive_group()
    data.add_argument("--chips", metavar="CHIPS", help="chip store folder")
    add_xbd_args(
        p,
        required=False,
        repeatable=True,
        help="xBD root: cut chips with the model's chip spec into a temporary store",
        group=data,
    )
    p.add_argument(
        "--fold",
        type=int,
        metavar="K",
        help="evaluate fold K of CHIPS/splits.csv (the run's validation fold); default: every labelled chip",
    )
    p.add_argument("--out", metavar="DIR", help="output folder")
    add_batch_size_arg(p, 64, "pairs per batch")
    p.add_argument(
        "--views",
        type=int,
        choices=(1, 2),
        default=2,
        help="2 (default): embed a second augmented view of each chip for SAA and SAD; 1: skip them",
    )
    add_seed_arg(p, help="seed of the second view and t-SNE")
    p.add_argument(
        "--tta",
        choices=("none", "flips", "d8"),
        default="none",
        help="test-time augmentation of an ONNX --model: average each pair's outputs over 4 "
        "flips or the 8 turns and mirrors (default none; docs/experiments/results.md measures it)",
    )
    p.add_argument(
        "--false-alarm-cost",
        type=cost_type,
        metavar="C",
        help="grade as `score --false-alarm-cost C` does: a damaged grade only where at least C "
        "times as probable as no-damage (default: the model's own rule, 1 unless its card says "
        "otherwise)",
    )
    p.add_argument(
        "--device", default="auto", help="PyTorch device for --run: auto (the run's), cpu, cuda[:N]"
    )
    p.add_argument(
        "--no-tsne", action="store_true", help="skip the t-SNE figures (slow on many chips)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_report_args(p, quiet=False)
    p.set_defaults(func=run)
    tasks = p.add_subparsers(dest="evaluate_task", metavar="[xview2]", title="task (optional)")
    add_xview2_parser(tasks)


def run(args: argparse.Namespace) -> int:
    needed = [
        ("--chips or --xbd", args.chips or args.xbd),
        ("--out", args.out),
    ]
    missing = [flag for flag, given in needed if not given]
    if missing:
        raise UsageError(
            f"evaluate needs {', '.join(missing)} (see `local-damage evaluate --help`)"
        )
    if args.fold is not None and args.xbd:
        raise UsageError("--fold applies to --chips; with --xbd every cut chip is evaluated")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {args.batch_size}")
    options = EvaluationOptions(
        views=args.views,
        tsne=not args.no_tsne,
        batch_size=args.batch_size,
        seed=args.seed,
        progress=not args.quiet,
        false_alarm_cost=args.false_alarm_cost,
    )
    model = args.model if args.model or args.run else str(default_model())
    scorer = load_scorer(args.run, model, args.device, args.tta, args.views)
    if args.xbd:
        metrics = evaluate_xbd(scorer, args.xbd, args.out, options)
    else:
        metrics = evaluate_chips(scorer, args.chips, args.out, args.fold, options)
    if args.json:
        print(json.dumps(metrics, indent=2, default=str))
    else:
        print(f"{metrics['source'].get('selection', '')}")
        print(format_summary(metrics))
    print(f"wrote {Path(args.out) / METRICS_JSON} and {PREDICTIONS_CSV}")
    return 0


def load_scorer(
    run: str | Path | None = None,
    model: str | Path | None = None,
    device: str = "auto",
    tta: str = "none",
    views: int = 1,
) -> Scorer:
    """A :class:`~local_damage.evaluation.torch_scorer.TorchScorer` for a run folder or an
    :class:`~runtime.evaluation.scorers.OnnxScorer` for an ONNX file; torch is imported only
    for a run folder or a second view (``views`` 2: the training augmentation).

    ``tta``: test-time augmentation of the ONNX model (``runtime.predictor.TTA_VIEWS``).

    Raises:
        EvaluationError: the run folder lacks config.yaml or best.safetensors, or the ONNX file
            does not exist; both or neither of ``run`` and ``model``; ``tta`` with a run folder.
    """
    if (run is None) == (model is None):
        raise EvaluationError("give exactly one of a run folder or an ONNX model")
    if run is not None and tta != "none":
        raise EvaluationError(
            f"test-time augmentation ({tta}) grades an exported model: export the run and give "
            "it as --model"
        )
    if run is None and views == 1:
        return OnnxScorer(model, tta)
    # torch-bearing: imported here so that evaluating an ONNX model on one view needs no torch
    from local_damage.evaluation.torch_scorer import TorchScorer, augmented_view

    if run is None:
        return OnnxScorer(model, tta, second_view=augmented_view)
    return TorchScorer(run, device=device)


def add_xview2_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "xview2",
        help="the xView2 challenge score (localisation F1, damage F1, overall) on xBD tiles",
        description=(
            "Score a damage model on xBD tiles as the xView2 challenge scores: targets drawn "
            "from the post labels' polygons, predictions from the model's graded buildings, "
            "pixel counts pooled over tiles; localisation F1, damage F1 (harmonic mean of the "
            "four class F1) and overall = 0.3 x localisation + 0.7 x damage. Footprints given "
            "(the label polygons) and, with --localizer, detected. Writes OUT/metrics.json and "
            "each tile's graded buildings and class raster."
        ),
    )
    add_xbd_args(p, repeatable=True, help="xBD root: images/ and labels/ (or splits)")
    add_model_args(p, help=f"damage model: {MODEL_CHOICE} (default: the bundled default)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--fold",
        type=int,
        metavar="K",
        help="score the tiles of fold K of CHIPS/splits.csv (needs --chips)",
    )
    which.add_argument(
        "--tiles", nargs="+", metavar="TILE", help="score these tiles (<event>_<id>)"
    )
    p.add_argument(
        "--chips",
        metavar="CHIPS",
        help="chip store whose splits.csv deals tiles to folds (with --fold)",
    )
    add_localizer_args(
        p,
        help=f"building localiser ({LOCALIZER_CHOICE}): also score with the footprints it detects",
    )
    p.add_argument(
        "--pngs",
        action="store_true",
        help="also write the challenge scorer's PNG inputs under OUT/xview2",
    )
    add_batch_size_arg(p, 32, "chips per batch")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_report_args(p, quiet=False)
    p.set_defaults(func=run_xview2)


def run_xview2(args: argparse.Namespace) -> int:
    metrics = evaluate_xview2(
        args.xbd,
        args.model if args.model is not None else default_model(),
        args.out,
        TileSelection(args.tiles, args.chips, args.fold),
        localizer=args.localizer,
        pngs=args.pngs,
        batch_size=args.batch_size,
        progress=not args.quiet,
    )
    if args.json:
        print(json.dumps(metrics, indent=2, default=str))
    else:
        print(metrics["selection"])
        print(format_table(metrics))
    for item in metrics["failed"]:
        print(f"failed {item['tile']}: {item['reason']}", file=sys.stderr)
    print(f"wrote {Path(args.out) / XVIEW2_METRICS_JSON}")
    return 1 if metrics["failed"] else 0
