"""Command-line parsers and handlers for data preparation (`prepare`, `split`, `bench prepare`).

Nothing here imports torch; the libraries that decode imagery (rasterio, OpenCV, Dask) are loaded
by the data_prep functions when a command runs. Errors of the LocalDamageError family are printed
once by :func:`cli.main.main`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from app.web.campaign import export_store
from app.web.sessions import AppError
from bench.prepare import bench_prepare
from cli.options import (
    add_engine_arguments,
    add_json_switch,
    add_report_args,
    add_seed_arg,
    add_spec_args,
    add_xbd_args,
    align_argument,
    engine_of,
    max_pixels_argument,
    resolve_max_pixels,
)
from data_prep.report import PrepareReport
from data_prep.scene_store import SceneOptions, prepare_scene
from data_prep.spec import ChipSpec
from data_prep.split import fold_counts, make_splits
from data_prep.xbd import XbdOptions, prepare_xbd


def _spec(args: argparse.Namespace) -> ChipSpec:
    return ChipSpec(chip_size=args.chip_size, context=args.context, min_size=args.min_size)


def _finish(report: PrepareReport, args: argparse.Namespace) -> int:
    """Print the run's summary (standard error) and, with ``--json``, its report as JSON
    (standard output); the exit status of the report."""
    print(report.summary(), file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    return report.exit_code(args.strict)


def _prepare(args: argparse.Namespace, run) -> int:
    """``run(max_pixels)`` -> report, with the pixel limit resolved and the report finished as
    :func:`_finish` does."""
    max_pixels = resolve_max_pixels(args)
    return _finish(run(max_pixels), args)


def _store_roots(roots: list[str], folder: Path) -> list[str]:
    """The xBD roots, each label store (``.gpkg``) exported as xBD tiles under ``folder``."""
    out = []
    for i, root in enumerate(roots):
        if Path(root).suffix.lower() != ".gpkg":
            out.append(root)
            continue
        done = export_store(root, folder / str(i), vector_name=None)
        for line in done.left_out:
            print(f"warning: left out: {line}", file=sys.stderr)
        if done.xbd is None:
            raise AppError(f"{root}: no corrected xBD tile to cut (georeferenced scenes: export "
                           "it with `labels export` and use `prepare scene --label-field damage`)")  # fmt: skip
        print(f"{root}: {done.xbd_tiles} corrected xBD tile(s)", file=sys.stderr)
        out.append(str(done.xbd))
    return out


def _run_prepare_xbd(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="local-damage-labels-") as tmp:
        roots = _store_roots(args.xbd, Path(tmp))
        return _prepare(args, lambda max_pixels: _cut_xbd(args, roots, max_pixels))


def _cut_xbd(args: argparse.Namespace, roots: list[str], max_pixels: int) -> PrepareReport:
    options = XbdOptions(
        include_unclassified=args.include_unclassified, max_pixels=max_pixels, resume=args.resume
    )
    return prepare_xbd(
        roots,
        args.out,
        spec=_spec(args),
        options=options,
        engine=engine_of(args),
        progress=False if args.quiet else None,
    )


def _run_prepare_scene(args: argparse.Namespace) -> int:
    return _prepare(
        args,
        lambda max_pixels: prepare_scene(
            args.pre,
            args.post,
            args.buildings,
            args.out,
            spec=_spec(args),
            options=SceneOptions(
                label_field=args.label_field,
                event=args.event,
                max_pixels=max_pixels,
                align=args.align,
            ),
            engine=engine_of(args),
            progress=not args.quiet,
        ),
    )


def _run_split(args: argparse.Namespace) -> int:
    path = make_splits(
        args.chips,
        folds=args.folds,
        by=args.by,
        seed=args.seed,
        stratify=args.stratify,
        block_km=args.block_km,
    )
    if args.json:
        print(json.dumps(fold_counts(args.chips), indent=2))
    if not args.quiet:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _run_bench_prepare(args: argparse.Namespace) -> int:
    bench_prepare(
        args.xbd,
        spec=_spec(args),
        workers=args.workers,
        limit=args.limit,
        as_json=args.json,
        repeat=args.repeat,
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `prepare` and `split` to the top-level subcommands."""
    prepare = sub.add_parser(
        "prepare",
        help="cut per-building pre/post chip pairs into a chip store",
        description="Cut per-building pre/post chip pairs from xBD tiles or georeferenced scenes into a chip store (manifest.csv + shards).",
    )
    psub = prepare.add_subparsers(dest="source", metavar="SOURCE", required=True)

    xbd = psub.add_parser(
        "xbd",
        help="from xBD tiles with label JSON",
        description="Cut chips from xBD as distributed: ROOT/images/*_{pre,post}_disaster.{png,tif} with ROOT/labels/*.json, or the split layout ROOT/{train,tier3,test,hold}/...",
    )
    add_xbd_args(
        xbd,
        repeatable=True,
        help="xBD root folder, or the app's label store (WORK/labels.gpkg: its corrected xBD "
        "tiles, the latest grade of each building)",
    )
    xbd.add_argument("--out", required=True, metavar="CHIPS", help="output chip store folder")
    add_spec_args(xbd)
    add_engine_arguments(xbd, "tile")
    xbd.add_argument(
        "--include-unclassified",
        action="store_true",
        help="keep un-classified buildings as unlabelled chips",
    )
    xbd.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run into the same --out: tiles it finished (shards and "
        "shards/<tile>.rows.json present, inputs unchanged) are not cut again; refused when the "
        "store was prepared with other options",
    )
    max_pixels_argument(xbd)
    add_report_args(xbd)
    xbd.set_defaults(func=_run_prepare_xbd)

    scene = psub.add_parser(
        "scene",
        help="from georeferenced GeoTIFFs with footprints",
        description="Cut chips from georeferenced pre/post GeoTIFF tiles (any CRS and resolution; mosaicked virtually, post warped onto the pre grid) and building footprints (GeoJSON, GeoPackage or Shapefile in any CRS).",
    )
    scene.add_argument(
        "--pre", nargs="+", required=True, metavar="PATH", help="pre-disaster GeoTIFF tile(s)"
    )
    scene.add_argument(
        "--post", nargs="+", required=True, metavar="PATH", help="post-disaster GeoTIFF tile(s)"
    )
    scene.add_argument(
        "--buildings",
        required=True,
        metavar="FILE",
        help="building footprints (GeoJSON, GeoPackage or Shapefile)",
    )
    scene.add_argument(
        "--label-field",
        metavar="NAME",
        help="footprint attribute holding the damage label (class name or 0-3)",
    )
    scene.add_argument(
        "--event",
        metavar="NAME",
        help="event name for the manifest (default: the footprint file's name)",
    )
    scene.add_argument("--out", required=True, metavar="CHIPS", help="output chip store folder")
    add_spec_args(scene)
    add_engine_arguments(scene, "part of the scene")
    max_pixels_argument(scene)
    align_argument(scene)
    add_report_args(scene)
    scene.set_defaults(func=_run_prepare_scene)

    split = sub.add_parser(
        "split",
        help="assign tiles of a chip store to cross-validation folds",
        description="Write CHIPS/splits.csv: k folds grouped by tile or by spatial block of neighbouring tiles (stratified by class as far as the groups allow), or leave-one-event-out. No tile is in two folds.",
    )
    split.add_argument("chips", metavar="CHIPS", help="chip store folder")
    split.add_argument(
        "--folds",
        type=int,
        default=5,
        metavar="K",
        help="number of folds for --by tile or block (default 5)",
    )
    split.add_argument(
        "--by",
        choices=("tile", "block", "event"),
        default="tile",
        help="group by tile (k-fold), by spatial block (k-fold of groups of neighbouring tiles, "
        "so no fold holds a neighbour of another fold's tile) or by event (leave-one-event-out)",
    )
    split.add_argument(
        "--block-km",
        type=float,
        default=1.0,
        metavar="KM",
        help="--by block: tiles whose centres lie within KM of each other share a block "
        "(default 1.0; xBD tiles are about 0.5 km wide)",
    )
    add_seed_arg(split)
    split.add_argument(
        "--stratify",
        choices=("class", "event"),
        default="class",
        help="--by tile/block: balance each class's share over the folds (class, the default) or each "
        "event's and class's together, so every fold holds tiles of every event that has enough "
        "(event)",
    )
    add_report_args(split)
    split.set_defaults(func=_run_split)


def register_bench(bench_sub: argparse._SubParsersAction) -> None:
    """Add `bench prepare`."""
    bp = bench_sub.add_parser(
        "prepare",
        help="chip extraction rate against the decode-only rate",
        description="Print buildings per second for `prepare xbd` on ROOT next to the rate of decoding every pre/post image once (measured in the same run), and their ratio.",
    )
    add_xbd_args(bp, repeatable=True, help="xBD root folder")
    add_spec_args(bp)
    bp.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[1, 2],
        metavar="N",
        help="worker counts to measure (default 1 2)",
    )
    bp.add_argument("--limit", type=int, metavar="TILES", help="use only the first TILES tiles")
    bp.add_argument(
        "--repeat",
        type=int,
        default=3,
        metavar="N",
        help="runs of each measurement, alternating; the fastest counts (default 3)",
    )
    add_json_switch(bp, help="print the figures as JSON")
    add_report_args(bp, json=False)
    bp.set_defaults(func=_run_bench_prepare)
