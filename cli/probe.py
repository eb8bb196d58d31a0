"""`local-damage probe`: how hard each loss term pulls on the encoder."""

from __future__ import annotations

import argparse

from cli.options import add_report_args
from data_prep.store import write_json
from local_damage.config import load_yaml


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "probe",
        help="how hard each loss term pulls on the encoder, and whether it agrees with the grading",
        description=(
            "For a config (and optionally trained weights), compute on a few training batches the "
            "encoder gradient of each term of the objective (WCE, contrastive on z, contrastive "
            "on l) separately: norms, ratios to the cross-entropy and cosines with it; and per "
            "class, the raw latent map norm and within-class cosines of l and z."
        ),
    )
    p.add_argument("--config", required=True, metavar="YAML", help="training config")
    p.add_argument("--chips", required=True, metavar="CHIPS", help="chip store folder")
    p.add_argument("--init", metavar="RUN", help="weights: a run folder or .safetensors file")
    p.add_argument("--holdout", type=int, metavar="K", help="a fold of splits.csv left out")
    p.add_argument("--batches", type=int, default=20, help="batches to average over (20)")
    p.add_argument("--epoch", type=int, default=0, help="epoch whose alpha weights the terms (0)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    add_report_args(p, json=False)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    # torch-bearing: imported here so that `local-damage --help` needs no torch
    from local_damage.experiments.probe import format_probe, probe
    from local_damage.train.config import Config

    cfg = load_yaml(Config, args.config, args.set)
    result = probe(
        cfg,
        args.chips,
        init=args.init,
        holdout=args.holdout,
        batches=args.batches,
        epoch=args.epoch,
    )
    print(format_probe(result))
    if args.json:
        write_json(args.json, result)
    return 0
