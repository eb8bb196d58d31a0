"""`local-damage bench adapt`: how long adapting a model takes for a few labels and for many.

Draws N labelled buildings at random from a chip store (or one fold or event of it) for each N
of ``--labels``, ``--repeats`` times, and adapts the model to them exactly as `local-damage
adapt` does (:func:`app.adapt.model.adapt_model`: the embedding pass, every head
cross-validated, the chosen head written into a model file). It prints, per N, the
cross-validation scheme, the seconds of the fit (cross-validation and final fit), of the
embedding pass and of the whole adaptation, with the fit's ratio to the baseline: every
labelled building of the selection, the many-labels case. One untimed adaptation first loads
the libraries, so the figures are the work itself, not Python's imports (no torch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from app.adapt.labelled import from_chip_store
from app.adapt.model import adapt_model
from runtime.predictor import Predictor
from runtime.registry import default_model

#: Label counts measured by default: the analyst's common case.
LABELS = (10, 20, 40, 50)


def bench_adapt(
    model: str | Path,
    chips: str | Path,
    fold: int | None = None,
    event: str | None = None,
    labels: list[int] | tuple[int, ...] = LABELS,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """Time :func:`~app.adapt.model.adapt_model` on random draws of N labelled buildings.

    Returns:
        ``{"model", "chips", "fold", "event", "pool", "rows"}``; each row: ``labels`` (N, or the
        whole pool for the baseline), ``baseline``, ``scheme``, ``fit_s``, ``embed_s`` and
        ``adapt_s`` (one value per repeat), ``heads`` (the head chosen, counted).
    """
    predictor = Predictor(model)
    buildings = from_chip_store(chips, predictor.class_names, fold, event)
    pool = buildings.subset(buildings.labelled)
    sizes = [n for n in labels if n < len(pool)] + [len(pool)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-adapt-") as tmp:
        out = Path(tmp) / "adapted.onnx"
        adapt_model(predictor, pool, out)  # untimed: loads scikit-learn and SciPy
        for n in sizes:
            row: dict[str, Any] = {
                "labels": n,
                "baseline": n == len(pool),
                "fit_s": [],
                "embed_s": [],
                "adapt_s": [],
                "heads": Counter(),
            }
            for r in range(1 if n == len(pool) else repeats):
                pick = np.zeros(len(pool), bool)
                pick[np.random.default_rng(seed + r).choice(len(pool), n, replace=False)] = True
                result = adapt_model(predictor, pool.subset(pick), out)
                row["scheme"] = result.block["cv"]["scheme"]
                row["fit_s"].append(result.fit_seconds)
                row["embed_s"].append(result.embed_seconds)
                row["adapt_s"].append(result.fit_seconds + result.embed_seconds)
                row["heads"][result.block["method"]] += 1
            rows.append(row)
    return {
        "model": str(model),
        "chips": str(chips),
        "fold": fold,
        "event": event,
        "pool": len(pool),
        "repeats": repeats,
        "rows": rows,
    }


def _span(values: list[float]) -> str:
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid:.3f}"
    return f"{mid:.3f} ({min(values):.3f}-{max(values):.3f})"


def format_result(result: dict[str, Any]) -> str:
    """The figures as a plain-text table; seconds as median (min-max) over the repeats."""
    where = ", ".join(f"{k} {result[k]}" for k in ("fold", "event") if result.get(k) is not None)
    base = next(r for r in result["rows"] if r["baseline"])
    base_fit = statistics.median(base["fit_s"])
    lines = [
        f"adapt {result['model']} to random draws of the {result['pool']} labelled buildings of "
        f"{result['chips']}{f' ({where})' if where else ''}, {result['repeats']} draws per count; "
        "seconds: median (min-max)",
        f"{'labels':>7}  {'cross-validation':<28}{'fit s':>22}{'embedding s':>14}"
        f"{'adapt s':>10}{'fit / base':>12}  heads chosen",
    ]
    for row in result["rows"]:
        name = f"{row['labels']}{'*' if row['baseline'] else ''}"
        heads = ", ".join(f"{h} {c}" for h, c in sorted(row["heads"].items()))
        ratio = statistics.median(row["fit_s"]) / base_fit if base_fit > 0 else float("nan")
        lines.append(
            f"{name:>7}  {row['scheme']:<28}{_span(row['fit_s']):>22}"
            f"{statistics.median(row['embed_s']):>14.3f}{statistics.median(row['adapt_s']):>10.3f}"
            f"{ratio:>11.2f}x  {heads}"
        )
    lines.append(
        "* baseline: every labelled building of the selection; fit = every head cross-validated "
        "and the chosen one fitted on all; adapt = embedding pass + fit"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    model = args.model if args.model is not None else default_model()
    result = bench_adapt(
        model, args.chips, args.fold, args.event, args.labels, max(1, args.repeats), args.seed
    )
    print(json.dumps(result, indent=2, default=dict) if args.json else format_result(result))
    return 0
