"""What a model file says about where it came from: training data (with the tiles trained on)
and its licence, the run's validation figures and held-out test figures (metadata props
``training_data``, ``license``, ``validation_metrics`` and ``test_metrics``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from local_damage.export.options import ExportError
from runtime.training_tiles import run_training_tiles

#: Attribution a model trained on xBD chips must carry, and its licence.
XBD_CREDIT = "xBD (Gupta et al. 2019), CC BY-NC-SA 4.0"
XBD_LICENSE = "CC BY-NC-SA 4.0"
#: Event-name prefix of the synthetic xBD-format data of :mod:`data_prep.synthetic`.
SYNTHETIC_EVENT_PREFIX = "synthetic-"


def is_xbd_store(meta: Mapping[str, Any], events: Sequence[str]) -> bool:
    """Whether chips came from real xBD tiles: an xBD-source store with a non-synthetic event."""
    return meta.get("source") == "xbd" and any(
        not str(e).startswith(SYNTHETIC_EVENT_PREFIX) for e in events
    )


def training_data_info(
    meta: Mapping[str, Any],
    events: Sequence[str],
    chips: str | None,
    train_chips: int | None,
    tiles: Sequence[str] | None = None,
    folds: Mapping[str, int | None] | None = None,
) -> tuple[dict[str, Any], str | None]:
    """``(training_data, license)`` metadata of a model trained on a chip store.

    Args:
        meta: the store's ``store.json`` (``source`` is ``xbd`` or ``scene``).
        events: the events of the training chips.
        chips: the chip store path.
        train_chips: number of training chips.
        tiles: the tiles trained on (:func:`run_tiles`), listed as ``train_tiles`` so that
            every report can mark figures computed on them (:mod:`runtime.training_tiles`);
            None when unknown (the key is then left out).
        folds: ``validation_fold`` and ``holdout_fold`` of the run's splits.

    Returns:
        The ``training_data`` dict (events, chips, source, train_chips, train_tiles, the folds,
        and ``credit`` for xBD) and the licence the model must carry (``None`` when the data's
        terms are not known).
    """
    source = meta.get("source") or "unknown"
    if source == "xbd" and not is_xbd_store(meta, events):
        source = "synthetic xBD-format data (data_prep.synthetic)"
    info: dict[str, Any] = {
        "source": source,
        "events": sorted(map(str, events)),
        "chips": chips,
        "train_chips": train_chips,
    }
    if tiles is not None:
        info["train_tiles"] = sorted(map(str, tiles))
    info.update({k: v for k, v in (folds or {}).items() if v is not None})
    licence = None
    if is_xbd_store(meta, events):
        info["source"] = "xBD"
        info["credit"] = XBD_CREDIT
        licence = XBD_LICENSE
    return info, licence


def run_tiles(
    summary: Mapping[str, Any], store: str | os.PathLike, run: str | os.PathLike
) -> list[str] | None:
    """The tiles a run trained on: its summary's ``train_tiles`` (runs of this version), else
    the tiles of ``store``'s splits outside its validation and held-out folds; None when
    neither can be known."""
    found = run_training_tiles({**summary, "chips": str(store)}, run)
    return sorted(found.tiles) if found.tiles is not None else None


def validation_metrics(summary: Mapping[str, Any], metrics: Sequence[Mapping[str, str]]) -> dict:
    """Best validation macro-F1 and accuracy of a run, with its fold and epoch."""
    best_epoch = summary.get("best_epoch")
    accuracy = None
    for row in metrics:
        if str(row.get("epoch")) == str(best_epoch) and row.get("val_accuracy") not in (None, ""):
            accuracy = float(row["val_accuracy"])
    return {
        "fold": summary.get("fold"),
        "macro_f1": summary.get("best_val_macro_f1"),
        "accuracy": accuracy,
        "epoch": best_epoch,
        "val_chips": summary.get("val_chips"),
    }


def summarize_test_metrics(
    path: str | os.PathLike, class_names: Sequence[str] | None = None, cost: float = 1.0
) -> dict[str, Any]:
    """The headline figures of an ``evaluate`` metrics.json, for a model's metadata.

    Out-of-fold figures (``cv``'s or ``fold_table.py``'s ``oof_metrics.json``, whose
    ``cross_validation`` block names its predictions CSV) are graded by the most probable class;
    for a model whose own grade rule has another false-alarm ``cost`` they are graded again from
    that CSV under the model's rule (:func:`oof_at_cost`), so that the figures the model carries
    are those of the grades it gives.

    Raises:
        ExportError: the file is missing, not JSON, or lacks accuracy / macro_f1; out-of-fold
            figures to grade again whose predictions CSV cannot be read.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ExportError(f"{path}: test metrics file not found") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExportError(f"{path}: not a metrics.json of `local-damage evaluate` ({exc})") from exc
    if not isinstance(data, dict) or "accuracy" not in data or "macro_f1" not in data:
        raise ExportError(
            f"{path}: no accuracy / macro_f1; expected `local-damage evaluate` output"
        )
    cv = data.get("cross_validation") if isinstance(data.get("cross_validation"), dict) else None
    if cv is not None and cost != 1.0 and class_names is not None:
        data = {**data, **oof_at_cost(data, path, class_names, cost)}
        cv = data["cross_validation"]
    per_class = data.get("per_class") or {}
    source = data.get("source") if isinstance(data.get("source"), dict) else {}
    where = {k: source[k] for k in ("selection", "tiles") if source.get(k) is not None}
    return {
        "accuracy": data["accuracy"],
        "macro_f1": data["macro_f1"],
        "xview2_damage_f1": data.get("xview2_damage_f1"),
        "f1": {name: v.get("f1") for name, v in per_class.items() if isinstance(v, dict)},
        "n": data.get("n"),
        **where,
        "source": str(path),
        **({"cross_validation": cv} if cv is not None else {}),
    }


def oof_at_cost(
    data: Mapping[str, Any], path: Path, class_names: Sequence[str], cost: float
) -> dict[str, Any]:
    """``cv``'s out-of-fold figures (:func:`local_damage.experiments.cv_report.oof_metrics`) of
    the predictions CSV that ``data["cross_validation"]["predictions"]`` names (looked for in
    ``path``'s folder when not found as given), each building graded at false-alarm ``cost``
    (:func:`runtime.grading.grades`); the ``cross_validation`` block records the cost.

    Raises:
        ExportError: the CSV cannot be read or lacks a column the figures need.
    """
    import numpy as np
    import pandas as pd

    from local_damage.experiments.cv_report import oof_metrics
    from runtime.grading import grades

    csv = Path(str(data["cross_validation"].get("predictions") or ""))
    if not csv.is_file() and (path.parent / csv.name).is_file():
        csv = path.parent / csv.name
    try:
        frame = pd.read_csv(csv)
    except (OSError, ValueError) as exc:
        raise ExportError(
            f"{path}: its out-of-fold predictions ({csv}) cannot be read to grade them at the "
            f"model's false-alarm cost {cost:g}: {exc}"
        ) from exc
    columns = [f"p_{c}" for c in class_names]
    needed = ("label", "tile", "event", "fold", "intact_tile", *columns)
    missing = [c for c in needed if c not in frame.columns]
    if missing:
        raise ExportError(f"{csv}: no {', '.join(missing)} column(s) to grade at cost {cost:g}")
    frame["pred"] = grades(frame[columns].to_numpy(np.float64), class_names, cost)
    figures = oof_metrics(frame, class_names, csv)
    figures["cross_validation"]["false_alarm_cost"] = float(cost)
    return figures
