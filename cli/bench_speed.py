"""The parsers of the speed benchmarks: `local-damage bench train`, `infer`, `score`, `city`,
`map` and `app`.

Each benchmark's measurement and its ``run(args)`` live in :mod:`bench`; only the command line is
defined here, with the shared options of :mod:`cli.options`, so that :mod:`bench` never imports
:mod:`cli`. The defaults the parsers show are the benchmark modules' own constants.
"""

from __future__ import annotations

import argparse

from bench import app_load as bench_app_load
from bench import city as bench_city
from bench import infer as bench_infer
from bench import map as bench_map
from bench import score as bench_score
from bench import train as bench_train
from cli.options import (
    add_batch_size_arg,
    add_json_switch,
    add_model_args,
    add_report_args,
    add_seed_arg,
    comma_list,
)


def add_train(bench_sub: argparse._SubParsersAction) -> None:
    """Register ``local-damage bench train``."""
    p = bench_sub.add_parser(
        "train",
        help="training step time and activation memory per pair: naive vs optimised",
        description=(
            "Time a LOCAL training step (forward, OCL+WCE objective, backward, AdamW) and count "
            "the activation memory saved for backward per pair, for a naive configuration (fp32, "
            "pre and post as two encoder passes, no checkpointing) and the optimised one (pair "
            "as one 2B batch, encoder activation checkpointing, bf16 autocast, channels-last), "
            "with the ratio optimised / naive."
        ),
    )
    p.add_argument(
        "--encoders",
        type=comma_list(str, "encoders", "resnet18,resnet50"),
        default=list(bench_train.DEFAULT_ENCODERS),
        metavar="A,B",
        help="encoders (default resnet18,resnet50)",
    )
    p.add_argument(
        "--sizes",
        type=comma_list(int, "input sides in px", "128,224"),
        default=list(bench_train.DEFAULT_SIZES),
        metavar="N,M",
        help="input sides in px, multiples of 32 (default 128,224,512)",
    )
    p.add_argument(
        "--batches",
        type=comma_list(int, "pairs per step", "8,16"),
        default=list(bench_train.DEFAULT_BATCHES),
        metavar="N,M",
        help="pairs per step (default 8,16)",
    )
    p.add_argument(
        "--steps", type=int, default=2, metavar="N", help="timed steps after 1 warm-up (default 2)"
    )
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default cpu)"
    )
    add_seed_arg(p, help="seed of weights and batches")
    add_json_switch(p, help="print the rows as JSON records")
    add_report_args(p, json=False)
    _add_train_scale_args(p)
    p.set_defaults(func=bench_train.run)


def _add_train_scale_args(p: argparse.ArgumentParser) -> None:
    """The options of the simulated-store mode of ``bench train`` (:mod:`bench.train_scale`)."""
    g = p.add_argument_group("training at xBD scale, simulated (given --chips)")
    g.add_argument(
        "--chips",
        metavar="N,N",
        help="measure the loader against the training step "
        "on simulated chip stores of these sizes (e.g. 2000,200000) instead",
    )
    g.add_argument(
        "--loader-workers",
        type=int,
        default=2,
        metavar="N",
        help="loader worker processes (default 2)",
    )
    g.add_argument(
        "--timed-batches",
        type=int,
        default=40,
        metavar="N",
        help="timed loader batches per store (default 40; at most one pass over the store)",
    )
    g.add_argument(
        "--config",
        metavar="YAML",
        help="training config (default: configs/default.yaml when it exists, else the defaults)",
    )
    g.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of the training config, as `train --set` does, e.g. --set "
        "model.encoder=resnet50 --set data.input_size=512 (repeatable)",
    )
    g.add_argument(
        "--source",
        metavar="CHIPS",
        help="chip store whose chips are repeated (default: one prepared from synthetic xBD tiles)",
    )
    g.add_argument(
        "--dir",
        metavar="DIR",
        help="where the stores are made and kept (default: a temporary folder)",
    )


def _thread_count(text: str) -> int | None:
    """One ``bench infer --threads`` value: a count of at least 1, or ``default`` (None: ONNX
    Runtime's own)."""
    if text == "default":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be at least 1, got {value}")
    return value


def add_infer(bench_sub: argparse._SubParsersAction) -> None:
    """Register ``local-damage bench infer``."""
    p = bench_sub.add_parser(
        "infer",
        help="chip pairs per second: PyTorch eager vs ONNX Runtime fp32 / int8",
        description=(
            "Print chip pairs per second for PyTorch eager fp32, ONNX Runtime fp32 and int8 "
            "(and fp16 with the CUDA provider) on the same chips and batch size, with ratios to "
            "eager and argmax agreement with eager. Random ResNet-18/50 models on synthetic "
            "chips, or --run RUN for a trained model on its validation chips."
        ),
    )
    p.add_argument(
        "--encoders",
        nargs="+",
        default=list(bench_infer.DEFAULT_ENCODERS),
        metavar="NAME",
        help="encoders of the random models, by spaces or commas (default resnet18 resnet50)",
    )
    p.add_argument("--run", metavar="RUN", help="use this trained run's model and validation chips")
    p.add_argument(
        "--input-size", type=int, default=128, metavar="PX", help="input side (default 128)"
    )
    add_batch_size_arg(p, 32, "pairs per call")
    p.add_argument("--pairs", type=int, default=128, metavar="N", help="pairs per pass (128)")
    p.add_argument(
        "--threads",
        type=comma_list(_thread_count, "thread counts", "1,2", spaces=True, empty=[None]),
        default=[None],
        metavar="N[,N]",
        help="ONNX Runtime intra-op thread counts to measure, e.g. 1,2 (default: its own)",
    )
    p.add_argument(
        "--int8",
        nargs="+",
        choices=["static", "dynamic"],
        default=["static"],
        help="int8 quantizations to measure (default static)",
    )
    p.add_argument(
        "--calibration", type=int, default=64, metavar="N", help="static int8 calibration chips"
    )
    p.add_argument("--repeat", type=int, default=2, metavar="N", help="timed passes per row (2)")
    add_seed_arg(p, help="seed of random weights and data")
    add_json_switch(p, help="print the rows as JSON records")
    add_report_args(p, json=False)
    p.set_defaults(func=bench_infer.run)


def add_score(bench_sub: argparse._SubParsersAction) -> None:
    """Register ``local-damage bench score``."""
    p = bench_sub.add_parser(
        "score",
        help="score-batch scenes/s and buildings/s for 1 and 2 workers, as ratios",
        description=(
            "Score the same scenes with `score-batch` for each worker count (1: in this process; "
            "more: an embedded Dask cluster, started and warmed up before timing) and print "
            "scenes/s and buildings/s with their ratio to the first worker count. Default "
            "inputs: a synthetic batch made on the fly; --scenes for real ones."
        ),
    )
    p.add_argument(
        "--scenes",
        metavar="CSV_OR_DIR",
        help="scene list or folder of scene folders, as score-batch (default: a synthetic batch)",
    )
    p.add_argument(
        "--count",
        type=int,
        default=24,
        metavar="N",
        help="scenes in the synthetic batch (default 24)",
    )
    add_model_args(p)
    p.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[1, 2],
        metavar="N",
        help="worker counts; the first is the baseline (default 1 2)",
    )
    p.add_argument("--repeat", type=int, default=1, metavar="N", help="timed batches (default 1)")
    p.add_argument("--raster", action="store_true", help="also write class rasters")
    large = bench_score.LARGE
    p.add_argument(
        "--large",
        type=int,
        default=large,
        metavar="PX",
        help=f"side of the large synthetic scene scored on one core (default {large}: "
        f"{(large // 100) ** 2} buildings; 0: none)",
    )
    p.add_argument(
        "--no-one-core",
        action="store_true",
        help="leave out the one-core comparison with the network alone and its stage times",
    )
    add_json_switch(p, help="print the figures as JSON")
    add_report_args(p, json=False)
    p.set_defaults(func=bench_score.run)


def add_city(bench_sub: argparse._SubParsersAction) -> None:
    """Register ``local-damage bench city``."""
    p = bench_sub.add_parser(
        "city",
        help="a synthetic city (40,000 buildings) scored end to end against a 4,000-building "
        "scene: time per building and peak memory, on 1 and 2 workers",
        description=(
            "Make two synthetic scenes of the same density (a city and a small scene), score "
            "each end to end on one worker (a fresh process each) and on an embedded Dask "
            "cluster, and print seconds per building, their ratio and peak resident memory."
        ),
    )
    add_model_args(p)
    p.add_argument(
        "--buildings",
        type=int,
        default=bench_city.CITY,
        metavar="N",
        help=f"buildings of the city (default {bench_city.CITY})",
    )
    p.add_argument(
        "--small",
        type=int,
        default=bench_city.SMALL,
        metavar="N",
        help=f"buildings of the small scene (default {bench_city.SMALL})",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        metavar="N",
        help="workers of the Dask run (default 2; 1: none)",
    )
    p.add_argument(
        "--spacing",
        type=int,
        default=100,
        metavar="PX",
        help="pixels per building cell (default 100)",
    )
    p.add_argument(
        "--dir",
        metavar="DIR",
        help="where the scenes are made and kept (default: a temporary folder)",
    )
    add_json_switch(p, help="print the figures as JSON")
    p.set_defaults(func=bench_city.run)


def add_map(bench_sub: argparse._SubParsersAction) -> None:
    """Register ``local-damage bench map``."""
    p = bench_sub.add_parser(
        "map",
        help="size, write time and browser draw time of score --map's web map",
        description=(
            "Score the Joplin GeoTIFFs (--joplin) and a synthetic scene of --size px with the "
            "bundled model, without and with --map; print the map file's size, what writing it "
            "adds, and the time headless Chromium takes to draw it offline."
        ),
    )
    p.add_argument(
        "--joplin", metavar="DIR", help="the Joplin GeoTIFF folder (pre/, post/, footprints/)"
    )
    p.add_argument(
        "--size",
        type=int,
        default=12288,
        metavar="PX",
        help="side of the synthetic scene in px, one building per 100 px cell (12288; 0: none)",
    )
    add_seed_arg(p, help="seed of the synthetic scene")
    add_report_args(p, quiet=False)
    p.set_defaults(func=bench_map.run)


def add_app(bench_sub: argparse._SubParsersAction) -> None:
    """Register ``local-damage bench app``."""
    app = bench_app_load
    p = bench_sub.add_parser(
        "app",
        help="the web app under load: latency, throughput, refusals and memory of its server",
        description=(
            "Start `local-damage app` in its own process on 127.0.0.1 and drive it through its "
            "HTTP API, one gradio_client per simulated analyst: each assesses the same tiles "
            "(/assess_tile) and saves corrections after each (/save_correction); one client "
            "first (the baseline), then each number of --clients at once. Prints requests "
            "answered, refused (queue full) and failed, latency p50/p95/max and assessments per "
            "second against the baseline, the server's peak memory, whether the grades were "
            "the same every time, and the corrections acknowledged and kept in the label store."
        ),
    )
    add_model_args(p)
    counts = comma_list(int, "counts", "8,16")
    for flag, kind, default, metavar, text in (
        ("--clients", counts, [8], "N[,N]", "simulated analysts at once, one load level per "
         f"count (default 8, at most {app.MAX_CLIENTS})"),
        ("--tiles", int, 2, "T", f"tiles each client assesses (default 2, at most {app.MAX_TILES})"),
        ("--corrections", int, 2, "C", "corrections saved after each assessment (default 2)"),
        ("--tiles-dir", str, None, "DIR", "xBD folder (images/*_pre_disaster.*, "
         "images/*_post_disaster.*, labels/*_post_disaster.json) whose first T tiles are "
         "assessed (default: synthetic tiles)"),
        ("--tile-size", int, app.SYNTHETIC_SIZE, "PX", "side of the synthetic tiles (default "
         f"{app.SYNTHETIC_SIZE}, a multiple of 64)"),
        ("--timeout", float, app.TIMEOUT, "SECONDS", "time limit from the app's first answer: "
         f"past it nothing more is sent and an unanswered request fails (default {app.TIMEOUT:g})"),
        ("--host", str, "127.0.0.1", "HOST", "interface the app binds: 127.0.0.1 (default) or "
         "localhost; nothing else"),
    ):  # fmt: skip
        p.add_argument(flag, type=kind, default=default, metavar=metavar, help=text)
    p.add_argument(
        "--no-baseline", action="store_true", help="skip the one-client baseline (no ratios)"
    )
    add_json_switch(p, help="print the figures as JSON")
    add_report_args(p, json=False)
    p.set_defaults(func=bench_app_load.run)
