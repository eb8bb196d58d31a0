"""A finished training run, read back for export: its config, summary, metrics and model."""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from data_prep.store import MANIFEST
from local_damage.config import ConfigError, load_yaml
from local_damage.export.options import ExportError
from local_damage.models import build_model
from local_damage.train import checkpoint as ckpt
from local_damage.train.config import Config
from local_damage.train.loop import model_config_for


@dataclass
class RunInfo:
    """What an export needs from a run folder.

    Attributes:
        path: the run folder.
        cfg: the resolved training :class:`~local_damage.train.config.Config`.
        summary: ``summary.json``.
        metrics: rows of ``metrics.csv`` (dicts of text), possibly empty.
        model: the LocalNet with the run's best weights, on CPU, in eval mode.
    """

    path: Path
    cfg: Any
    summary: dict
    metrics: list[dict]
    model: Any


def load_run(run: str | os.PathLike) -> RunInfo:
    """Rebuild the model of a run folder with its best weights.

    Raises:
        ExportError: the folder lacks config.yaml, summary.json or weights, or they do not fit.
    """
    run = Path(run)
    if not run.is_dir():
        raise ExportError(f"{run}: run folder not found")
    for name in ("config.yaml", "summary.json"):
        if not (run / name).is_file():
            raise ExportError(
                f"{run / name}: missing; is {run} a finished `local-damage train` run folder?"
            )
    try:
        cfg = load_yaml(Config, run / "config.yaml")
    except ConfigError as exc:
        raise ExportError(str(exc)) from exc
    try:
        summary = json.loads((run / "summary.json").read_text())
    except json.JSONDecodeError as exc:
        raise ExportError(f"{run / 'summary.json'}: not valid JSON ({exc})") from exc
    metrics: list[dict] = []
    if (run / "metrics.csv").is_file():
        with open(run / "metrics.csv", newline="") as fh:
            metrics = list(csv.DictReader(fh))
    model = build_model(replace(model_config_for(cfg), weights=None))
    try:
        weights = ckpt.resolve_weights(run)
        ckpt.load_weights(model, weights)
    except (FileNotFoundError, ValueError) as exc:
        raise ExportError(str(exc)) from exc
    except RuntimeError as exc:  # state dict does not fit the config
        raise ExportError(f"{run}: weights do not fit config.yaml ({exc})") from exc
    return RunInfo(run, cfg, summary, metrics, model.eval())


def resolve_chips(info: RunInfo, chips: str | os.PathLike | None) -> Path:
    """The chip store of an export: ``chips``, else the one recorded in the run's summary.

    Raises:
        ExportError: that folder has no manifest.
    """
    path = Path(chips) if chips is not None else Path(str(info.summary.get("chips") or ""))
    if not str(path) or not (path / MANIFEST).is_file():
        raise ExportError(
            f"{info.path}: the run's chip store {str(path) or '(not recorded)'} has no "
            f"{MANIFEST}; pass --chips CHIPS with the store the run was trained on"
        )
    return path
