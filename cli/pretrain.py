"""`local-damage pretrain`: self-supervised pretraining of the Siamese encoder on unlabelled imagery."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cli.options import add_batch_size_arg, add_report_args, add_seed_arg


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "pretrain",
        help="pretrain the encoder on unlabelled imagery (contrastive, no labels)",
        description=(
            "Train the shared encoder on random crops of every pre and post image of xBD folders "
            "and of GeoTIFFs, two views per crop, with the balanced contrastive loss (paper 004) "
            "or SimCLR's NT-Xent; labels are never read. Writes OUT/encoder.safetensors, which a "
            "training config takes as model.weights, with OUT/pretrain.yaml, OUT/log.csv and "
            "OUT/summary.json."
        ),
    )
    p.add_argument(
        "--xbd", action="append", default=[], metavar="ROOT", help="xBD folder (repeatable)"
    )
    p.add_argument(
        "--rasters",
        action="append",
        default=[],
        metavar="DIR",
        help="folder searched for GeoTIFFs (repeatable), e.g. Joplin's and Puerto Rico's tiles",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--encoder", default="resnet18", help="encoder name (resnet18)")
    p.add_argument(
        "--loss",
        choices=("balanced", "ntxent"),
        default="balanced",
        help="balanced (paper 004, default) or ntxent (SimCLR)",
    )
    p.add_argument(
        "--alpha",
        type=float,
        default=5.0,
        help="balanced loss: sharpness of the repelling term (5)",
    )
    p.add_argument(
        "--lam", type=float, default=1.0, help="balanced loss: weight of the repelling term (1)"
    )
    p.add_argument("--temperature", type=float, default=0.2, help="ntxent: temperature (0.2)")
    p.add_argument(
        "--views",
        choices=("augment", "prepost"),
        default="augment",
        help="augment: two augmentations of one crop (default); prepost: pre and post of the same xBD window",
    )
    p.add_argument(
        "--augment",
        choices=("light", "simclr"),
        default="light",
        help="light: crops of 0.4-1 of the area, brightness and contrast +-30%% (default, the "
        "recorded runs); simclr: SimCLR's strength (crops of 0.08-1, colour jitter with "
        "saturation and hue, blur)",
    )
    p.add_argument("--crop", type=int, default=128, help="crop side in source pixels (128)")
    p.add_argument(
        "--input-size", type=int, default=64, help="view side the crops are resized to (64)"
    )
    add_batch_size_arg(p, 32, "view pairs per step", metavar=None)
    p.add_argument("--steps", type=int, default=1000, help="optimiser steps (1000)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (0.001)")
    add_seed_arg(p)
    p.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when available, else the CPU; default), cpu or cuda",
    )
    add_report_args(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    # torch-bearing: imported here so that `local-damage --help` needs no torch
    from local_damage.pretrain.crops import PretrainError
    from local_damage.pretrain.loop import ENCODER_FILE, PretrainConfig, pretrain

    if not args.xbd and not args.rasters:
        raise PretrainError("pretrain needs at least one --xbd ROOT or --rasters DIR")
    try:
        cfg = PretrainConfig(
            encoder=args.encoder,
            loss=args.loss,
            alpha=args.alpha,
            lam=args.lam,
            temperature=args.temperature,
            views=args.views,
            augment=args.augment,
            crop=args.crop,
            input_size=args.input_size,
            batch_size=args.batch_size,
            steps=args.steps,
            lr=args.lr,
            seed=args.seed,
            device=args.device,
        )
    except ValueError as exc:
        raise PretrainError(f"pretrain: {exc}") from exc
    summary = pretrain(cfg, args.xbd, args.rasters, args.out, progress=not args.quiet)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"{len(summary['sources'])} images, {summary['steps']} steps, loss "
            f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, {summary['seconds']:.0f} s "
            f"on {summary['device']} ({summary['steps_per_s']:.2f} steps/s, "
            f"{summary['data_seconds']:.0f} s of it making the views)"
        )
        print(
            f"wrote {Path(args.out) / ENCODER_FILE}: train with --set model.weights={Path(args.out) / ENCODER_FILE}"
        )
    return 0
