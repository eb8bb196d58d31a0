"""Command-line parsers and handlers for `score`, `score-batch`, `app` and `demo`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from contextlib import contextmanager

from app.scoring.batch import BatchPlan, parse_shard, read_scene_list, score_batch, summary_path
from app.scoring.common import ScoreOptions, check_outputs
from app.scoring.demo import SYNTHETIC_NOTE, run_demo
from app.scoring.detect import pixel_pair, score_scene_detected, score_xbd_detected
from app.scoring.scene import score_scene
from app.scoring.webmap import check_map_path
from app.scoring.writer import OutputPaths
from app.scoring.xbd import score_xbd
from app.web.app import ServeOptions, launch
from app.web.users import Users
from cli.adapt import finetune_model
from cli.options import (
    LOCALIZER_CHOICE,
    add_batch_size_arg,
    add_engine_arguments,
    add_localizer_args,
    add_model_args,
    add_output_args,
    add_report_args,
    align_argument,
    cost_type,
    engine_of,
    max_pixels_argument,
    resolve_max_pixels,
)
from data_prep.errors import UsageError
from runtime.contract import ModelError
from runtime.localizer import load_localizer
from runtime.predictor import TTA_VIEWS, Predictor
from runtime.registry import default_localizer, default_model, default_models_dir

#: Default chips per inference batch.
BATCH_SIZE = 32
#: Default side, in grid pixels, of the blocks whose buildings share one read.
BLOCK_SIZE = 1024
#: How to open the app from elsewhere, printed when it starts (in place of Gradio's own hint).
REACH_HINT = (
    "to open it from other machines: --host 0.0.0.0 (add --username and --password-env), or "
    "--share for a temporary public link"
)
#: Printed when the app starts with --share.
SHARING_NOTE = (
    "--share: asking Gradio's share server for a temporary public link (needs internet); anyone "
    "with the link can use the app and see what is uploaded, so add --username and --password-env"
)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _common(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    add_batch_size_arg(parser, BATCH_SIZE, "chips per inference batch", kind=_positive)
    parser.add_argument(
        "--block-size",
        type=_positive,
        default=BLOCK_SIZE,
        metavar="PX",
        help="side in pre-grid pixels of the blocks whose buildings share one windowed read; "
        f"memory grows with its square, not with the scene (default {BLOCK_SIZE})",
    )
    parser.add_argument(
        "--tta",
        choices=tuple(TTA_VIEWS),
        default="none",
        help="test-time augmentation: grade each building in 4 flips or all 8 turns and mirrors "
        "of its chips and average (4x / 8x the model's time; docs/scoring.md; default none)",
    )
    add_report_args(parser)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="time every stage of scoring a scene with footprints (read, align, cut, context, "
        "infer, flags, outputs, ...) and print the seconds per stage after the summary "
        '(with --json: under "stages")',
    )
    parser.add_argument(
        "--false-alarm-cost",
        type=cost_type,
        default=None,
        metavar="C",
        help="grade a building damaged only where that grade is at least C times as probable "
        "as no-damage: the grade of least expected cost when calling an intact building "
        "damaged costs C times any other mistake (1: the most probable grade; default: the "
        "model's own rule, its card's grade_rule, 1 when it has none; the probabilities are "
        "unchanged; what each C costs in missed damage: docs/scoring.md)",
    )
    max_pixels_argument(parser)
    align_argument(parser)


def _map_argument(parser: argparse.ArgumentParser, metavar: str | None, where: str) -> None:
    """Add ``--map``: the web map (a path for ``score``, a switch for ``score-batch``)."""
    help_text = (
        f"also write a web map{where}: one self-contained HTML file that opens offline in a "
        "browser (pre/post imagery layers, buildings coloured by grade, flagged ones outlined, "
        "click for details; docs/scoring.md)"
    )
    if metavar is None:
        parser.add_argument("--map", action="store_true", help=help_text)
    else:
        parser.add_argument("--map", metavar=metavar, help=help_text)


def _localizer_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--localizer``: the localiser used when no footprints are given."""
    add_localizer_args(
        parser,
        help=f"building localiser used when no footprints are given: {LOCALIZER_CHOICE} "
        "(default: the bundled localizer when present; see docs/localize.md)",
    )


def _load_model(path: str | None, tta: str = "none") -> Predictor:
    """The predictor (the default model when ``path`` is None).

    Raises:
        ModelError: no default model, or not a usable model file.
    """
    return Predictor(path if path is not None else default_model(), tta=tta)


def _load_localizer(path: str | None):
    """The localiser for a command (``--localizer``, else the default).

    Raises:
        ModelError: none available, or not a usable localiser (the message says footprints
            were not given).
    """
    try:
        return load_localizer(path)
    except ModelError as exc:
        raise ModelError(f"no footprints given: {exc}") from exc


def _batch_localizer(path: str | None, scenes):
    """The localiser for ``score-batch`` when some scene has no footprints and one is given or
    bundled; None otherwise (those scenes then fail with a message saying how to get one, and
    the rest are scored).

    Raises:
        ModelError: a given localiser that is not usable.
    """
    if not any(s.buildings is None for s in scenes) or not (path or default_localizer()):
        return None
    return _load_localizer(path)


def _options(args: argparse.Namespace, max_pixels: int) -> ScoreOptions:
    return ScoreOptions(
        batch_size=args.batch_size,
        block_size=args.block_size,
        max_pixels=max_pixels,
        align=args.align,
        progress=not args.quiet,
        profile=args.profile,
        false_alarm_cost=args.false_alarm_cost,
    )


def _run_score(args: argparse.Namespace) -> int:
    check_outputs(args.out, args.raster, args.overlay)
    if args.map:
        check_map_path(args.map)
    if args.labels and (len(args.pre) != 1 or len(args.post) != 1):
        raise UsageError(
            "--labels (xBD mode) takes exactly one --pre and one --post image; "
            "use --buildings for mosaics of georeferenced tiles"
        )
    max_pixels = resolve_max_pixels(args)
    predictor = _load_model(args.model, args.tta)
    options = _options(args, max_pixels)
    paths = OutputPaths(args.out, args.raster, args.overlay, args.map)
    if args.labels:
        pre, post = args.pre[0], args.post[0]
        report = score_xbd(predictor, pre, post, args.labels, paths, options=options)
    elif args.buildings:
        report = score_scene(predictor, args.pre, args.post, args.buildings, paths, options=options)
    else:  # no footprints: the localiser finds the buildings
        localizer = _load_localizer(args.localizer)
        if pixel_pair(args.pre, args.post):
            pre, post = args.pre[0], args.post[0]
            report = score_xbd_detected(
                predictor, pre, post, paths, localizer=localizer, options=options
            )
        else:
            report = score_scene_detected(
                predictor, args.pre, args.post, paths, localizer=localizer, options=options
            )
    print(report.summary(), file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    return 0 if report.scored or not report.buildings else 1


@contextmanager
def _interrupt_on_sigterm():
    """Turn SIGTERM into KeyboardInterrupt, so temporary files are removed on the way out."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_score_batch(args: argparse.Namespace) -> int:
    shard = parse_shard(args.shard) if args.shard else None
    scenes, problems = read_scene_list(args.scenes)
    if not scenes and not problems:
        raise UsageError(f"{args.scenes}: lists no scenes")
    max_pixels = resolve_max_pixels(args)
    predictor = _load_model(args.model, args.tta)
    localizer = _batch_localizer(args.localizer, scenes)
    with _interrupt_on_sigterm():
        report = score_batch(
            predictor,
            scenes,
            args.out,
            BatchPlan(args.format, args.raster, args.overlay, args.map, args.resume, shard),
            options=_options(args, max_pixels),
            localizer=localizer,
            engine=engine_of(args),
            problems=problems,
        )
    print(report.summary(), file=sys.stderr)
    print(f"wrote {summary_path(args.out, shard)}", file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    return report.exit_code()


def _run_app(args: argparse.Namespace) -> int:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    models_dir = args.models if args.models is not None else str(default_models_dir())
    if args.model is None:
        args.model = str(default_model(models_dir))
    _load_model(args.model)  # an unusable model is refused before the app starts
    auth = None
    if args.users and (args.username or args.password_env):
        raise UsageError("give --users FILE or --username/--password-env, not both")
    if args.users:
        auth = Users(args.users)  # a bad users file is refused before the app starts
        print(f"analysts: {', '.join(auth.names)} (from {args.users})", file=sys.stderr)
    elif args.username or args.password_env:
        password = os.environ.get(args.password_env or "", "")
        if not args.username or not password:
            raise UsageError(
                "--username needs a password in the environment variable named by "
                "--password-env (and that variable set)"
            )
        auth = (args.username, password)
    print(f"local-damage app on http://{args.host}:{args.port} (Ctrl+C stops it)", file=sys.stderr)
    print(SHARING_NOTE if args.share else REACH_HINT, file=sys.stderr)
    launch(
        models_dir,
        args.model,
        work_dir=args.work,
        max_pixels=args.max_pixels,
        finetuner=finetuner(),
        serve=ServeOptions(host=args.host, port=args.port, auth=auth, share=args.share),
    )
    return 0


def finetuner():
    """What the app's "Fine-tune the network" runs: :func:`cli.adapt.finetune_model` when
    PyTorch is installed, else None (the app then says how to install it)."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("torch", "segmentation_models_pytorch")):
        return None
    return finetune_model


def _run_demo(args: argparse.Namespace) -> int:
    predictor = _load_model(args.model)
    print(f"model: {predictor.path}", file=sys.stderr)
    localizer = _load_localizer(args.localizer) if args.detect or args.localizer else None
    result = run_demo(predictor, args.out, progress=not args.quiet, localizer=localizer)
    print(result.report.summary(), file=sys.stderr)
    print(f"example scene: {result.scene}", file=sys.stderr)
    print(f"the same with `score`: {result.command}", file=sys.stderr)
    print(SYNTHETIC_NOTE, file=sys.stderr)
    if args.json:
        payload = {**result.report.to_dict(), "example_scene": str(result.scene)}
        print(json.dumps({**payload, "command": result.command}, indent=2))
    return 0 if result.report.scored else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `score`, `score-batch`, `app` and `demo` to the top-level subcommands."""
    score = sub.add_parser(
        "score",
        help="grade every building of a scene with an ONNX model (no PyTorch needed)",
        description=(
            "Grade the damage of every building of a scene with an exported ONNX model. Chips are "
            "cut with the model's own chip spec by the same code as in training. Scene mode: "
            "georeferenced pre/post GeoTIFF tiles (any CRS and resolution) with a footprint file "
            "(--buildings). xBD mode: one pixel-aligned pre/post image pair with an xBD label JSON "
            "(--labels). Without either, a building localiser (--localizer) finds the buildings "
            "on the pre imagery. Writes one feature per building with damage, damage_id, "
            "p_<class>, confidence, status (scored, not_covered, skipped: reason) and source "
            "(given, or detected by the localiser)."
        ),
    )
    score.add_argument(
        "--pre", nargs="+", required=True, metavar="PATH", help="pre-disaster image(s)"
    )
    score.add_argument(
        "--post", nargs="+", required=True, metavar="PATH", help="post-disaster image(s)"
    )
    source = score.add_mutually_exclusive_group()
    source.add_argument(
        "--buildings",
        metavar="FILE",
        help="building footprints (GeoJSON, GeoPackage or Shapefile, any CRS); without "
        "--buildings or --labels, the localiser finds the buildings (a single pair of images "
        "without georeferencing is then scored as in xBD mode)",
    )
    source.add_argument(
        "--labels", metavar="XBD_JSON", help="xBD label JSON whose features.xy are the buildings"
    )
    add_output_args(
        score,
        metavar="OUT",
        help="per-building output: .geojson (RFC 7946, EPSG:4326) or .gpkg (pre-grid CRS)",
    )
    score.add_argument(
        "--raster",
        metavar="OUT.tif",
        help="also write a Cloud-Optimised GeoTIFF of class ids on the pre grid (255 = none)",
    )
    score.add_argument(
        "--overlay",
        metavar="OUT.png",
        help="also write a PNG of the post image with footprints in class colours",
    )
    _map_argument(score, "OUT.html", "")
    _common(score)
    _localizer_argument(score)
    score.set_defaults(func=_run_score)

    batch = sub.add_parser(
        "score-batch",
        help="score many scenes, one model load per worker, on Dask; resumable",
        description=(
            "Score every scene of a CSV (columns pre, post, buildings, optional name; several "
            "files separated by ';'; relative paths from the CSV's folder) or of a folder of "
            "scene folders (each with pre/*.tif, post/*.tif and one footprint file). A scene "
            "without footprints (empty buildings, no footprint file) is scored with the "
            "buildings the localiser (--localizer) finds. Writes "
            "OUT/<scene>.geojson (or .gpkg, plus .tif/.png when asked) and OUT/summary.json. A "
            "bad scene is reported and the rest go on; the exit status is non-zero only when "
            "no scene succeeded. Scenes are Dask jobs: on an embedded local cluster (--workers) "
            "or an existing one (--scheduler); see docs/cluster.md."
        ),
    )
    batch.add_argument(
        "--scenes", required=True, metavar="CSV|DIR", help="scene list CSV or folder of scenes"
    )
    add_output_args(batch)
    batch.add_argument(
        "--format",
        choices=("geojson", "gpkg"),
        default="geojson",
        help="per-building output format (default geojson)",
    )
    batch.add_argument("--raster", action="store_true", help="also write OUT/<scene>.tif")
    batch.add_argument("--overlay", action="store_true", help="also write OUT/<scene>.png")
    _map_argument(batch, None, " for each scene, OUT/<scene>.html")
    batch.add_argument(
        "--resume", action="store_true", help="skip scenes whose outputs already exist"
    )
    batch.add_argument(
        "--shard",
        metavar="I/N",
        help="score only shard I of N (1 <= I <= N; scenes assigned by a stable hash of their "
        "name, the same on every machine); the summary is OUT/summary-I-of-N.json. For "
        "machines that share no Dask cluster; with one, use --scheduler instead",
    )
    add_engine_arguments(batch, "scene")
    _common(batch)
    _localizer_argument(batch)
    batch.set_defaults(func=_run_score_batch)

    web = sub.add_parser(
        "app",
        help="the web app for analysts (Gradio; ONNX Runtime, no PyTorch)",
        description=(
            "Serve the analysts' web app: tile mode (pre/post tile + footprints -> overlay, "
            "per-building table, GeoJSON/CSV, chips, corrections, Adapt to the corrections of "
            "the tile's event and Suggest what to correct next) and chip mode (one chip pair -> "
            "class probabilities and a heatmap of where the model saw change). The same "
            "functions are HTTP API endpoints `assess_tile` and `assess_chip` (gradio_client); "
            "see docs/app.md. Binds to 127.0.0.1 unless --host says otherwise; makes a public "
            "share link only with --share."
        ),
    )
    add_model_args(
        web,
        help="model offered first: a bundled model's name (default) or an .onnx file (default: "
        "default.onnx of --models, else its first model)",
    )
    web.add_argument(
        "--models",
        metavar="DIR",
        help="folder whose *.onnx files the model picker offers (default: ./models when it has "
        "any, else the bundled models/)",
    )
    web.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to bind (default 127.0.0.1, this machine only; 0.0.0.0 for all)",
    )
    web.add_argument("--port", type=_positive, default=7860, help="TCP port (default 7860)")
    web.add_argument(
        "--share",
        action="store_true",
        help="also serve the app on a temporary public https link through Gradio's share server "
        "(needs internet; anyone with the link can use it: add --username/--password-env)",
    )
    web.add_argument(
        "--users",
        metavar="FILE",
        help="users file of the campaign's analysts (name and password hash per line, written "
        "by `local-damage users add FILE NAME`): each logs in by name and each correction "
        "records who made it; read again when it changes",
    )
    web.add_argument(
        "--username", help="require this one login (with --password-env); see also --users"
    )
    web.add_argument(
        "--password-env",
        metavar="VAR",
        help="environment variable holding the password (kept off the command line)",
    )
    web.add_argument(
        "--work",
        metavar="DIR",
        help="folder for each assessment's outputs and corrections (DIR/sessions) and the models "
        "adapted in the app (DIR/models, offered in the picker; default: a temporary folder)",
    )
    max_pixels_argument(
        web, default=12_000 * 12_000
    )  # app.web.app.MAX_PIXELS, without importing it
    web.set_defaults(func=_run_app)

    demo = sub.add_parser(
        "demo",
        help="score an example scene end to end (GeoJSON, raster, overlay) without a browser",
        description=(
            "Write a small synthetic georeferenced example scene (pre tiles in UTM, post tiles in "
            "EPSG:4326, 40 footprints) and score it with the default model exactly as "
            "`local-damage score` would: OUT/buildings.geojson, OUT/damage.tif (COG) and "
            "OUT/overlay.png. Prints the equivalent `score` command for your own GeoTIFFs."
        ),
    )
    add_model_args(demo)
    demo.add_argument(
        "--out", default="work/demo", metavar="DIR", help="output folder (default work/demo)"
    )
    add_report_args(demo)
    demo.add_argument(
        "--detect",
        action="store_true",
        help="leave the footprints aside: the localiser finds the buildings, which are graded",
    )
    _localizer_argument(demo)
    demo.set_defaults(func=_run_demo)
