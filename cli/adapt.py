"""`local-damage adapt`: adapt a model's head to a new event, and suggest what to label next."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
from pathlib import Path

from app.adapt.corrections import from_corrections, from_session, from_store, session_folder
from app.adapt.fit import METHODS, UNLABELLED_RULES
from app.adapt.labelled import (
    LabelError,
    ReadOptions,
    concat,
    from_chip_store,
    from_scene,
    from_xbd,
)
from app.adapt.model import (
    AdaptResult,
    NetworkFit,
    adapt_model,
    base_of,
    calibration_after_adapt,
    format_adaptation,
    format_finetune,
    network_block,
    write_adapted,
)
from app.adapt.recalibrate import recalibrate
from app.adapt.suggest import COLUMNS, suggest, write_suggestions
from app.web.sessions import import_corrections
from cli.options import (
    add_batch_size_arg,
    add_chips_args,
    add_model_args,
    add_output_args,
    add_report_args,
    add_seed_arg,
    align_argument,
    comma_list,
)
from data_prep.errors import UsageError
from local_damage.adapt.finetune import (
    FinetuneOptions,
    export_finetuned,
    finetune,
    weights_beside,
)
from local_damage.adapt.network import FinetuneError, require_torch
from runtime.predictor import Predictor
from runtime.registry import default_model


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``local-damage adapt``."""
    p = sub.add_parser(
        "adapt",
        help="adapt a model to a new event from a few labelled buildings (seconds, no PyTorch)",
        description=(
            "Fit a new head on the model's embedding to labelled buildings of a new event and "
            "write a self-describing copy of the model that carries it (the `adaptation` "
            "metadata). Several heads are cross-validated on the labels (base model unchanged, "
            "class prototypes blended with the model's own, logistic regression on the "
            "embedding, and the same with the base model's log-probabilities as a prior, each "
            "with classes without a label kept or discounted); the base model is kept unless a "
            "candidate beats it clearly on the cross-validated log-loss and macro-F1. A class "
            "without a label keeps the base model's probability unless the base model called "
            "labelled buildings so (--unlabelled). Labelled buildings come from a "
            "chip store "
            "(--chips), a labelled footprint file on pre/post imagery (--buildings with "
            "--label-field, or an xBD --labels JSON) and the app's saved corrections "
            "(--corrections); several may be combined. With --suggest N, ranks the unlabelled "
            "buildings of the same inputs to label next (with a model not yet adapted: a random "
            "draw, a fixed shuffle by building id; with an adapted one: the buildings it "
            "hesitates on, spread over the embedding space, alternating with the random draw) "
            "and writes the ranking as CSV. See docs/adapt.md."
        ),
    )
    add_model_args(p, help="base model (default: the bundled model)")
    add_chips_args(p, required=False, fold_help="with --chips: only fold K of CHIPS/splits.csv")
    p.add_argument(
        "--event",
        metavar="NAME",
        help="with --chips: only the buildings of this event; otherwise the event name recorded "
        "for the buildings read (default: the scene name)",
    )
    p.add_argument("--pre", nargs="+", metavar="PATH", help="pre-disaster image(s)")
    p.add_argument("--post", nargs="+", metavar="PATH", help="post-disaster image(s)")
    p.add_argument(
        "--buildings",
        metavar="FILE",
        help="footprints on georeferenced --pre/--post (GeoJSON, GeoPackage, Shapefile)",
    )
    p.add_argument(
        "--label-field",
        metavar="FIELD",
        help="attribute of --buildings holding the class (name or 0-3); empty: unlabelled; "
        "without it every building is unlabelled (only useful with --suggest)",
    )
    p.add_argument(
        "--labels",
        metavar="XBD_JSON",
        help="xBD label JSON (subtype = class) on one pixel-aligned --pre/--post pair",
    )
    p.add_argument(
        "--corrections",
        nargs="+",
        metavar="PATH",
        default=[],
        help="corrections saved by the app: its label store (WORK/labels.gpkg: every corrected "
        "building of --event, or of all events, with its latest grade), or an assessment folder "
        "(session.json) or a file under it; several accumulate; with --suggest and an "
        "assessment folder, the tile's uncorrected buildings are ranked",
    )
    add_output_args(p, required=False, metavar="NAME.onnx", help="adapted model to write")
    p.add_argument(
        "--heads",
        type=comma_list(str, "heads", ",".join(METHODS), empty=()),
        default=",".join(METHODS),
        metavar="LIST",
        help=f"comma-separated heads to try (default {','.join(METHODS)})",
    )
    p.add_argument(
        "--unlabelled",
        choices=UNLABELLED_RULES,
        default="discount",
        help="classes without a label: also try discounting the base probability of those the "
        "base model called on labelled buildings (default), or keep it exactly (docs/adapt.md)",
    )
    p.add_argument(
        "--finetune",
        action="store_true",
        help="fine-tune the last residual block of the encoder and the classifier on the labels "
        "(PyTorch; weights: --weights), the number of epochs chosen by cross-validation on the "
        "labels, instead of adapting the head (docs/adapt.md)",
    )
    p.add_argument(
        "--semi",
        action="store_true",
        help="fine-tune as --finetune and learn from the unlabelled buildings of the inputs as "
        "well (FixMatch pseudo-labels, weak and strong views of each pair)",
    )
    p.add_argument(
        "--weights",
        metavar="SAFETENSORS",
        help="with --finetune/--semi: the base model's fp16 weights (default: NAME.safetensors "
        "beside the model NAME.onnx, as shipped with the bundled model)",
    )
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="with --finetune/--semi: PyTorch threads (default: one per core; 1 is faster when "
        "other work keeps the cores busy)",
    )
    p.add_argument(
        "--suggest",
        type=int,
        metavar="N",
        help="rank N unlabelled buildings of the inputs to label next (with the adapted model "
        "when --out is given, else with --model)",
    )
    p.add_argument(
        "--suggest-out",
        metavar="CSV",
        help="write the ranking here (default: print it)",
    )
    add_seed_arg(p, help="seed of the stratified k-fold split (labels of fewer than 3 tiles)")
    add_batch_size_arg(p, 32, "pairs per batch")
    add_report_args(p)
    align_argument(p)
    p.set_defaults(func=run)


def read_inputs(args: argparse.Namespace, predictor):
    """Every building of the inputs named on the command line (:class:`app.adapt.labelled.Buildings`).

    Raises:
        LabelError: an unusable input, or options that do not go together.
    """
    names, spec = predictor.class_names, predictor.spec
    parts = []
    if args.chips:
        parts.append(from_chip_store(args.chips, names, args.fold, args.event))
    elif args.fold is not None:
        raise LabelError("--fold selects a fold of --chips; give --chips")
    if args.buildings and args.labels:
        raise LabelError("give --buildings (georeferenced) or --labels (xBD), not both")
    if (args.buildings or args.labels) and (not args.pre or not args.post):
        raise LabelError(f"{args.buildings or args.labels}: give the imagery with --pre and --post")
    event = None if args.chips else args.event
    reading = ReadOptions(event, args.align)
    if args.buildings:
        parts.append(
            from_scene(
                args.pre,
                args.post,
                args.buildings,
                spec,
                names,
                args.label_field,
                options=reading,
            )
        )
    if args.labels:
        if len(args.pre) != 1 or len(args.post) != 1:
            raise LabelError(f"{args.labels}: xBD labels take exactly one --pre and one --post")
        parts.append(from_xbd(args.pre[0], args.post[0], args.labels, spec, names, True, reading))
    # to rank, the whole assessed tile is the pool; to adapt, the corrections' own copies suffice
    # several assessments: one that cannot be read is reported and left out, the rest go on
    read = from_session if args.suggest is not None else from_corrections
    left_out = []
    for path in args.corrections:
        try:
            if Path(path).suffix.lower() == ".gpkg":
                if args.suggest is not None:
                    raise LabelError(f"{path}: --suggest ranks one assessed tile: give its folder")
                found, _, problems = from_store(path, spec, names, event, args.align)
                left_out += problems
                parts.append(found)
                continue
            import_corrections(session_folder(path))  # an old folder's corrections.json
            parts.append(read(path, spec, names, event, args.align))
        except LabelError as exc:
            if len(args.corrections) == 1:
                raise
            left_out.append(str(exc))
    for problem in left_out:
        print(f"warning: left out: {problem}", file=sys.stderr)
    if args.corrections and len(left_out) == len(args.corrections):
        raise LabelError(f"none of the {len(left_out)} --corrections could be read (above)")
    if not parts:
        raise LabelError("no buildings given: use --chips, --buildings/--labels or --corrections")
    return concat(parts, spec.chip_size)


def run(args: argparse.Namespace) -> int:
    """Adapt the model (``--out``) and/or rank the buildings to label next (``--suggest``)."""
    if args.out is None and args.suggest is None:
        raise UsageError("give --out (the adapted model) and/or --suggest N")
    if args.suggest is not None and args.suggest < 1:
        raise UsageError(f"--suggest must be at least 1, got {args.suggest}")
    heads = tuple(args.heads)
    predictor = Predictor(args.model if args.model else default_model())
    buildings = read_inputs(args, predictor)
    tune = args.finetune or args.semi
    if tune and args.out is None:
        raise UsageError("--finetune/--semi write a model: give --out")
    if args.out is not None and tune:
        if args.threads is not None and args.threads < 1:
            raise UsageError(f"--threads must be at least 1, got {args.threads}")
        result = finetune_model(
            predictor,
            buildings,
            args.out,
            semi=args.semi,
            seed=args.seed,
            weights=args.weights,
            options=FinetuneOptions(seed=args.seed, threads=args.threads),
        )
    elif args.out is not None:
        result = adapt_model(
            predictor,
            buildings,
            args.out,
            heads,
            args.batch_size,
            args.seed,
            args.unlabelled,
        )
    if args.out is not None:
        block = result.block
        if not args.quiet:
            print(format_adaptation(block), file=sys.stderr)
            if tune:
                print(format_finetune(block), file=sys.stderr)
            what = (
                f"{block['finetune']['epochs']} epoch(s) kept of {block['finetune']['max_epochs']}"
                f" cross-validated, {block['cv']['scheme']}"
                if tune
                else f"{len(heads)} heads cross-validated, {block['cv']['scheme']}, then the "
                "chosen one fitted on all"
            )
            print(
                f"fit: {result.fit_seconds:.3f} s for {block['labels']['n']} labels ({what}); "
                f"embedding pass {result.embed_seconds:.2f} s",
                file=sys.stderr,
            )
            print(f"wrote {result.out}", file=sys.stderr)
        if args.json:
            print(json.dumps(block, indent=1))
        predictor = Predictor(result.out)
    if args.suggest is not None:
        _suggest(args, predictor, buildings)
    return 0


def _suggest(args: argparse.Namespace, predictor, buildings) -> None:
    unlabelled = int((~buildings.labelled).sum())
    if unlabelled == 0:
        raise LabelError(
            f"{'; '.join(buildings.sources)}: every building is labelled; --suggest ranks "
            "unlabelled buildings (a chip store's label -1, footprints without --label-field "
            "or with an empty label, such as a scored tile's output with its --pre/--post, or an "
            "app assessment's uncorrected buildings)"
        )
    rows = suggest(predictor, buildings, args.suggest, batch_size=args.batch_size)
    if args.suggest_out:
        write_suggestions(args.suggest_out, rows)
        if not args.quiet:
            print(
                f"wrote {args.suggest_out} ({len(rows)} of {unlabelled} unlabelled)",
                file=sys.stderr,
            )
        return
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(COLUMNS)
    for r in rows:
        writer.writerow(["" if getattr(r, c) is None else getattr(r, c) for c in COLUMNS])


def finetune_model(
    predictor, buildings, out, semi: bool = False, seed: int = 0, weights=None, options=None
) -> AdaptResult:
    """Fine-tune ``predictor``'s network on the labelled buildings (with ``semi``, FixMatch on
    the unlabelled ones too) and write the self-describing model ``out``: the composition of
    :func:`local_damage.adapt.finetune.finetune` (PyTorch, imported here) and
    :func:`app.adapt.model.network_block`. The web app gets this function from
    ``local-damage app`` when PyTorch is installed.

    Raises:
        FinetuneError: PyTorch missing (the message says what to install), no weights, too few
            labels.
    """
    require_torch()
    base_meta = predictor.metadata
    if isinstance(base_meta.get("adaptation"), dict) and base_meta["adaptation"].get(
        "method"
    ) not in (
        "finetune",
        "semi",
    ):
        raise FinetuneError(
            f"{predictor.path}: carries an adapted head; fine-tune its base model instead"
        )
    labelled = buildings.subset(buildings.labelled)
    sources = "; ".join(buildings.sources) or "the given buildings"
    if len(labelled) == 0:
        raise FinetuneError(f"{sources}: no labelled building to fine-tune on")
    unl = buildings.subset(~buildings.labelled) if semi else None
    if semi and (unl is None or len(unl) == 0):
        raise FinetuneError(
            f"{sources}: --semi learns from unlabelled buildings and the inputs have none "
            "(give the whole tile: footprints with empty labels, an assessment, a chip store "
            "with unlabelled chips)"
        )
    # judged on the grades the analyst will see: under the model's own rule
    options = dataclasses.replace(
        options or FinetuneOptions(seed=seed), false_alarm_cost=predictor.false_alarm_cost
    )
    try:
        result = finetune(
            weights or weights_beside(predictor.path),
            labelled.pre,
            labelled.post,
            labelled.labels,
            options,
            unl.pre if unl is not None else None,
            unl.post if unl is not None else None,
        )
    except FinetuneError as exc:
        raise FinetuneError(f"{sources}: {exc}") from exc
    method = "semi" if semi else "finetune"
    names = list(predictor.class_names)
    chosen = method if result.epochs else "base"
    cv = {
        "scheme": result.scheme,
        "candidates": {"base": result.curve[0]}
        | ({chosen: result.curve[result.epochs]} if result.epochs else {}),
        "curve": result.curve,
    }
    details = {
        "epochs": result.epochs,
        "max_epochs": options.max_epochs,
        "blocks": options.blocks,
        "lr": options.lr,
        "batch_size": options.batch_size,
        "choice": result.clear,
        "unlabelled": 0 if unl is None else len(unl),
        **({"fixmatch": {"confidence": options.confidence, **result.semi}} if semi else {}),
    }
    t0 = 1.0 if result.epochs else base_of(base_meta)[0]
    fit = NetworkFit(
        method if result.epochs else "base",
        int(result.net.cfg.embed_dim),
        cv,
        result.seconds,
        details,
        t0,
        recalibrate(result.oof_logits / t0, labelled.labels, seed),
    )
    block = network_block(fit, names, predictor.path, base_meta, labelled.counts(names))
    if not result.epochs:  # the base network kept: its own graph, exactly
        write_adapted(predictor.path, out, block)
        return AdaptResult(Path(out), block, 0.0, result.seconds)
    props = {"adaptation": block, "calibration": calibration_after_adapt(block)}
    outputs = base_meta.get("outputs") or []
    export_finetuned(result, out, dict(base_meta), props, "change_map" in outputs)
    return AdaptResult(Path(out), block, 0.0, result.seconds)
