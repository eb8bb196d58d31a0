"""Cross-validated figures beyond accuracy: per event, false alarms on intact tiles, calibration
per fold, and the pooled out-of-fold predictions that calibration can be fitted on.

Every fold's evaluation writes ``predictions.csv`` (probabilities and raw logits per chip). This
module joins them with the chip store's manifest into one table of out-of-fold predictions
(``OUT/<method>/oof_predictions.csv``: every labelled chip once, graded by the model that never
saw its tile) and computes from it, per fold and pooled:

- accuracy, macro-F1 and per-class F1 (per fold: mean and min-max over folds, as the paper
  reports; pooled: every out-of-fold prediction scored at once), and one row per event;
- **false alarms on intact tiles**: an *intact tile* is one whose labelled buildings are all
  no-damage; the share of its buildings graded anything else (and the count graded destroyed);
- **ECE** (15 bins, top label) of the probabilities on each fold, and on its intact tiles;
- **calibration fitted on the out-of-fold predictions**, cross-fitted fold by fold, and whether
  any map may ship (:mod:`local_damage.experiments.oof_calibration`).

``cv_table.md`` lays these out per method (:func:`protocol_table`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.store import atomic_path, read_manifest, write_json
from local_damage.experiments.cost_rule import cost_curve, cost_table
from local_damage.experiments.oof_calibration import calibration_study, calibration_table
from runtime.evaluation.evaluate import PREDICTIONS_CSV
from runtime.metrics import classification_metrics, present_class_f1
from runtime.metrics.calibration import expected_calibration_error

OOF_CSV = "oof_predictions.csv"
OOF_METRICS = "oof_metrics.json"
CV_TABLE = "cv_table.md"


def intact_tiles(manifest) -> set[str]:
    """Tiles whose labelled buildings are all no-damage (label 0), from a manifest DataFrame."""
    labelled = manifest[manifest["label"] >= 0]
    worst = labelled.groupby("tile")["label"].max()
    return {str(t) for t in worst[worst == 0].index}


def fold_predictions(run: str | Path, manifest, fold: int, intact: set[str]):
    """One fold's ``predictions.csv`` joined with tile and event: a DataFrame with ``fold``,
    ``tile``, ``event`` and ``intact_tile`` added to its columns."""
    import pandas as pd

    path = Path(run) / PREDICTIONS_CSV
    frame = pd.read_csv(path, dtype={"chip_id": str})
    where = manifest.set_index("chip_id").loc[frame["chip_id"], ["tile", "event"]]
    frame.insert(1, "fold", int(fold))
    frame.insert(2, "tile", where["tile"].astype(str).to_numpy())
    frame.insert(3, "event", where["event"].astype(str).to_numpy())
    frame.insert(4, "intact_tile", frame["tile"].isin(intact).to_numpy())
    return frame


def _probabilities(frame, class_names: Sequence[str]) -> np.ndarray:
    return frame[[f"p_{c}" for c in class_names]].to_numpy(dtype=np.float64)


def false_alarms(frame, class_names: Sequence[str]) -> dict[str, Any] | None:
    """Buildings on intact tiles graded damaged: ``{"n", "damaged", "destroyed", "share"}``
    (share = damaged / n), or None when the frame has no intact tile."""
    rows = frame[frame["intact_tile"]]
    if len(rows) == 0:
        return None
    damaged = int((rows["pred"] != 0).sum())
    destroyed = int((rows["pred"] == class_names.index("destroyed")).sum())
    return {
        "n": len(rows),
        "damaged": damaged,
        "destroyed": destroyed,
        "share": damaged / len(rows),
    }


def _ece(frame, class_names: Sequence[str]) -> float | None:
    if len(frame) == 0:
        return None
    return expected_calibration_error(_probabilities(frame, class_names), frame["label"].to_numpy())


def scores(frame, class_names: Sequence[str]) -> dict[str, Any]:
    """Accuracy, macro-F1 over the classes present, per-class F1 (None when absent), support."""
    labels, preds = frame["label"].to_numpy(), frame["pred"].to_numpy()
    m = classification_metrics(labels, preds, list(class_names))
    f1 = present_class_f1(m, labels, class_names)
    values = [v for v in f1.values() if v is not None]
    return {
        "n": len(frame),
        "accuracy": m["accuracy"],
        "macro_f1": float(np.mean(values)) if values else None,
        "per_class_f1": f1,
        "support": {name: int((labels == i).sum()) for i, name in enumerate(class_names)},
    }


def fold_figures(frame, class_names: Sequence[str]) -> dict[str, Any]:
    """One fold's (or the pooled) figures: :func:`scores` plus ``tiles``, ``events``,
    ``ece``, ``ece_intact`` and ``false_alarms``."""
    out = scores(frame, class_names)
    out["tiles"] = int(frame["tile"].nunique())
    out["events"] = sorted(frame["event"].unique())
    out["ece"] = _ece(frame, class_names)
    out["ece_intact"] = _ece(frame[frame["intact_tile"]], class_names)
    out["false_alarms"] = false_alarms(frame, class_names)
    return out


def oof_metrics(pooled, class_names: Sequence[str], csv: str | Path) -> dict[str, Any]:
    """The pooled out-of-fold figures in the shape of ``evaluate``'s metrics.json, for
    ``export --test-metrics`` of a model trained on every tile with this recipe: accuracy,
    macro-F1 and per-class F1, the tiles, and a ``cross_validation`` block (folds, ECE, intact
    buildings called damaged) that says each building was graded by a model that never saw its
    tile, not by the model that carries the figures."""
    figures = fold_figures(pooled, class_names)
    intact = pooled["label"].to_numpy() == 0
    folds = sorted(int(f) for f in pooled["fold"].unique())
    return {
        "accuracy": figures["accuracy"],
        "macro_f1": figures["macro_f1"],
        "n": figures["n"],
        "per_class": {name: {"f1": f1} for name, f1 in figures["per_class_f1"].items()},
        "source": {
            "selection": f"out-of-fold predictions of folds {', '.join(map(str, folds))}",
            "tiles": sorted(str(t) for t in pooled["tile"].unique()),
        },
        "cross_validation": {
            "folds": folds,
            "predictions": str(csv),
            "ece": figures["ece"],
            "intact_called_damaged": float(np.mean(pooled["pred"].to_numpy()[intact] != 0))
            if intact.any()
            else None,
        },
    }


def _stats(values: Sequence[float | None]) -> dict[str, float | None]:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"mean": None, "min": None, "max": None}
    return {"mean": float(np.mean(vals)), "min": min(vals), "max": max(vals)}


def protocol_summary(
    runs: dict[int, Path], chips: str | Path, class_names: Sequence[str], out: str | Path
) -> dict[str, Any] | None:
    """Pool one method's folds, write ``out/oof_predictions.csv`` and summarise.

    Args:
        runs: ``{fold: run folder}`` of the folds evaluated (each with predictions.csv).
        chips: the chip store (manifest.csv).
        class_names: class names in label order.
        out: the method's folder.

    Returns:
        ``{"folds": {fold: fold_figures}, "over_folds": {key: {"mean", "min", "max"}} for
        accuracy, macro_f1, ece, ece_intact, false_alarm_share and f1_<class>, "pooled":
        fold_figures of every out-of-fold prediction, "per_event": {event: scores} pooled,
        "calibration": maps fitted on the out-of-fold predictions, cross-fitted by fold, and the
        one that ships (:func:`local_damage.experiments.oof_calibration.calibration_study`),
        "false_alarm_cost": intact false alarms and macro-F1 per false-alarm cost
        (:func:`local_damage.experiments.cost_rule.cost_curve`),
        "oof": the CSV path}``; None without folds. The pooled figures are also written as
        ``out/oof_metrics.json`` (:func:`oof_metrics`).
    """
    import pandas as pd

    if not runs:
        return None
    manifest = read_manifest(chips)
    intact = intact_tiles(manifest)
    frames = [fold_predictions(run, manifest, fold, intact) for fold, run in sorted(runs.items())]
    pooled = pd.concat(frames, ignore_index=True)
    path = Path(out) / OOF_CSV
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, suffix=".csv") as tmp:
        pooled.to_csv(tmp, index=False)
    write_json(Path(out) / OOF_METRICS, oof_metrics(pooled, class_names, path))
    folds = {int(f["fold"].iloc[0]): fold_figures(f, class_names) for f in frames}
    figures = list(folds.values())
    over = {
        key: _stats([f[key] for f in figures])
        for key in ("accuracy", "macro_f1", "ece", "ece_intact")
    }
    over["false_alarm_share"] = _stats(
        [f["false_alarms"]["share"] if f["false_alarms"] else None for f in figures]
    )
    for name in class_names:
        over[f"f1_{name}"] = _stats([f["per_class_f1"][name] for f in figures])
    per_event = {
        str(event): scores(part, class_names) for event, part in pooled.groupby("event", sort=True)
    }
    return {
        "folds": folds,
        "over_folds": over,
        "pooled": fold_figures(pooled, class_names),
        "per_event": per_event,
        "calibration": calibration_study(pooled, class_names),
        "false_alarm_cost": cost_curve(pooled, class_names),
        "oof": str(path),
    }


def _f(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _range(stats: dict[str, float | None], digits: int = 3) -> str:
    if stats["mean"] is None:
        return "n/a"
    return f"{_f(stats['mean'], digits)} ({_f(stats['min'], digits)}-{_f(stats['max'], digits)})"


def _alarms(block: dict[str, Any] | None) -> str:
    if not block:
        return "n/a"
    return f"{100 * block['share']:.1f}% ({block['damaged']}/{block['n']}; {block['destroyed']} destroyed)"


def _md(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
    ]


def protocol_table(methods: Sequence[dict[str, Any]], class_names: Sequence[str]) -> str:
    """Markdown: over folds (mean (min-max)) per method, then each fold, then each event pooled.

    Args:
        methods: ``[{"name", "protocol": protocol_summary(...)}]``.
        class_names: class names in label order.
    """
    short = [n.replace("-damage", "") for n in class_names]
    lines = ["## Over folds: mean (min-max)", ""]
    header = [
        "method",
        "folds",
        "accuracy",
        "macro-F1",
        *(f"F1 {s}" for s in short),
        "intact called damaged",
        "ECE",
        "ECE intact",
    ]
    rows = []
    for m in methods:
        p = m.get("protocol")
        if not p:
            continue
        o = p["over_folds"]
        rows.append(
            [
                m["name"],
                str(len(p["folds"])),
                _range(o["accuracy"]),
                _range(o["macro_f1"]),
                *(_range(o[f"f1_{n}"]) for n in class_names),
                _range(o["false_alarm_share"]),
                _range(o["ece"]),
                _range(o["ece_intact"]),
            ]
        )
    lines += _md(header, rows)
    lines += ["## Pooled out-of-fold predictions", ""]
    header = ["method", "n", "accuracy", "macro-F1", *(f"F1 {s}" for s in short)]
    header += ["intact called damaged (pooled)", "ECE", "ECE intact"]
    rows = []
    for m in methods:
        p = m.get("protocol")
        if not p:
            continue
        q = p["pooled"]
        rows.append(
            [
                m["name"],
                str(q["n"]),
                _f(q["accuracy"]),
                _f(q["macro_f1"]),
                *(_f(q["per_class_f1"][n]) for n in class_names),
                _alarms(q["false_alarms"]),
                _f(q["ece"]),
                _f(q["ece_intact"]),
            ]
        )
    lines += _md(header, rows)
    lines += ["## Each fold", ""]
    header = ["method", "fold", "tiles", "n", "events", "accuracy", "macro-F1"]
    header += ["intact called damaged", "ECE", "ECE intact"]
    rows = []
    for m in methods:
        for fold, q in sorted(((m.get("protocol") or {}).get("folds") or {}).items()):
            rows.append(
                [
                    m["name"],
                    str(fold),
                    str(q["tiles"]),
                    str(q["n"]),
                    ", ".join(e.split("-")[0] for e in q["events"]),
                    _f(q["accuracy"]),
                    _f(q["macro_f1"]),
                    _alarms(q["false_alarms"]),
                    _f(q["ece"]),
                    _f(q["ece_intact"]),
                ]
            )
    lines += _md(header, rows)
    lines += ["## Each event, pooled out-of-fold", ""]
    header = ["method", "event", "n", "accuracy", "macro-F1", *(f"F1 {s}" for s in short)]
    rows = []
    for m in methods:
        for event, q in ((m.get("protocol") or {}).get("per_event") or {}).items():
            rows.append(
                [
                    m["name"],
                    event,
                    str(q["n"]),
                    _f(q["accuracy"]),
                    _f(q["macro_f1"]),
                    *(_f(q["per_class_f1"][n]) for n in class_names),
                ]
            )
    lines += _md(header, rows)
    for key, title, table in (
        (
            "false_alarm_cost",
            "Intact buildings called damaged against the false-alarm cost",
            cost_table,
        ),
        ("calibration", "Calibration fitted on out-of-fold predictions", calibration_table),
    ):
        blocks = [(m["name"], (m.get("protocol") or {}).get(key)) for m in methods]
        if any(block for _, block in blocks):
            lines += [f"## {title}", ""]
            for name, block in blocks:
                if block:
                    lines += table(name, block)
    return "\n".join(lines)


def write_protocol_table(
    methods: Sequence[dict[str, Any]], class_names: Sequence[str], out: str | Path
) -> str:
    """Write ``out/cv_table.md`` (:func:`protocol_table`) atomically and return its text."""
    text = protocol_table(methods, class_names)
    with atomic_path(Path(out) / CV_TABLE, suffix=".md") as tmp:
        tmp.write_text(text)
    return text
