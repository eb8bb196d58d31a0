"""`local-damage bench new-tile`: a new tile of a known event, k of its buildings labelled, the
rest graded; how often adapting made the model worse.

For each k of ``--k`` and each of ``--draws`` draws: a tile is picked at random among the tiles
of the chip stores (``--chips``, repeatable) that the model did not train on (its metadata's
training tiles are left out) and that hold at least k + ``--min-eval`` labelled buildings; k of
its buildings are labelled at random and the rest of the tile is graded by the base model and by
every arm of ``--arms`` adapted to the k labels:

- ``heads``: :func:`app.adapt.fit.adapt_head`, exactly as ``local-damage adapt``;
- ``finetune``: :func:`local_damage.adapt.finetune.finetune_model`, as ``adapt --finetune``;
- ``semi``: the same with the tile's other buildings as unlabelled chips, as ``adapt --semi``.

It prints, per arm and k, the mean macro-F1 of the base model and of the adapted one on the rest
of the tile, the mean gain, and the share of draws where the adapted model is more than 0.01
below the base model (the goal: at most 5 % at every k).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.adapt.fit import AdaptError, BaseModel, adapt_head
from app.adapt.labelled import concat, from_chip_store
from app.adapt.model import base_model
from data_prep.errors import UsageError
from data_prep.store import atomic_path
from local_damage.adapt.finetune import FinetuneOptions, weights_beside
from local_damage.adapt.network import FinetuneError
from runtime.grading import grade_ids
from runtime.metrics import classification_metrics
from runtime.predictor import Predictor
from runtime.registry import default_model
from runtime.selection import INTACT
from runtime.training_tiles import training_tiles
from studies.finetune_arm import finetune_labels, finetuned_classes

#: Numbers of labels measured by default.
K = (5, 10, 20, 50)
ARMS = ("heads", "finetune", "semi")
#: A draw is "worse" when the adapted macro-F1 is below the base model's by more than this.
WORSE = 0.01


def macro_f1(y: np.ndarray, pred: np.ndarray, names) -> float:
    """Macro-F1 as ``local-damage evaluate`` computes it (classes neither true nor predicted
    left out)."""
    return float(classification_metrics(y, pred, names)["macro_f1"])


@dataclass(frozen=True)
class NewTileOptions:
    """The draws of `bench new-tile` (module docstring; the flags of the same names).

    Attributes:
        ks: numbers of labels measured.
        draws: draws per k.
        seed: seed of the draws (and of fine-tuning: ``seed`` + the draw's number).
        min_eval: labelled buildings a tile must hold besides the k labels (the rest of the
            tile, graded).
        arms: the arms measured, of :data:`ARMS`.
        finetune_options: fields of :class:`local_damage.adapt.finetune.FinetuneOptions` for the
            ``finetune`` and ``semi`` arms (None: its defaults).
        tune_draws: draws per k of the ``finetune`` and ``semi`` arms, the first ones (None:
            every draw).
    """

    ks: Sequence[int] = K
    draws: int = 50
    seed: int = 0
    min_eval: int = 20
    arms: Sequence[str] = ("heads",)
    finetune_options: dict[str, Any] | None = None
    tune_draws: int | None = None


def bench_new_tile(
    model: str | Path, chips: list[str], options: NewTileOptions | None = None
) -> dict[str, Any]:
    """Every draw's figures (module docstring).

    Args:
        model: the model file.
        chips: chip stores whose tiles are drawn.
        options: the draws (default ``NewTileOptions()``).

    Returns:
        ``{"model", "chips", "tiles", "rows", "summary"}``: one row per draw and arm (``k``,
        ``tile``, ``arm``, ``base``, ``adapted`` macro-F1, ``head``, ``seconds``), and per arm
        and k the mean figures and the share of draws worse by more than :data:`WORSE`.
    """
    o = options or NewTileOptions()
    seed = o.seed
    predictor = Predictor(model)
    names = list(predictor.class_names)
    parts = [from_chip_store(c, names) for c in chips]
    everything = concat(parts, predictor.spec.chip_size)
    b = everything.subset(everything.labelled)
    trained = training_tiles(predictor.metadata).tiles or frozenset()
    tile = np.asarray(b.tiles())
    fresh = ~np.isin(tile, sorted(trained))
    b, tile = b.subset(fresh), tile[fresh]
    p = predictor.predict(b.pre, b.post)
    raw = p.raw_logits if p.raw_logits is not None else p.logits
    base = base_model(predictor)  # the base and the heads graded under the model's own rule
    base_pred = grade_ids(p.probabilities, INTACT, base.false_alarm_cost)
    sizes = Counter(tile.tolist())
    weights = weights_beside(model)
    rows: list[dict[str, Any]] = []
    for k in o.ks:
        eligible = sorted(t for t, n in sizes.items() if n >= k + o.min_eval)
        if not eligible:
            continue
        for d in range(o.draws):
            rng = np.random.default_rng([seed, k, d])
            t = eligible[int(rng.integers(len(eligible)))]
            members = np.flatnonzero(tile == t)
            pick = rng.permutation(members)
            given, rest = pick[:k], np.sort(pick[k:])
            y = b.labels
            base_f1 = macro_f1(y[rest], base_pred[rest], names)
            common = {"k": int(k), "draw": d, "tile": t, "n_eval": int(len(rest))}
            common["base"] = round(base_f1, 6)
            for arm in o.arms:
                if arm != "heads" and o.tune_draws is not None and d >= o.tune_draws:
                    continue
                start = time.perf_counter()
                if arm == "heads":
                    pred, head = head_predictions(raw, p.embedding, y, given, rest, tile, base)
                    pred = base_pred[rest] if pred is None else pred
                else:
                    unl = rest if arm == "semi" else None
                    pred, head = tuned_predictions(
                        weights, b, given, rest, unl, base_pred[rest], seed + d, o.finetune_options
                    )
                rows.append(
                    {
                        **common,
                        "arm": arm,
                        "adapted": round(macro_f1(y[rest], pred, names), 6),
                        "head": head,
                        "seconds": round(time.perf_counter() - start, 3),
                    }
                )
    return {
        "model": str(model),
        "chips": [str(c) for c in chips],
        "tiles": {t: int(n) for t, n in sorted(sizes.items())},
        "left_out_training_tiles": int((~fresh).sum()),
        "rows": rows,
        "summary": summarise(rows),
    }


def head_predictions(raw, embedding, labels, given, rest, tiles, base: BaseModel):
    """``(predicted classes of rest, the head kept)`` of the head ``adapt`` fits to the labels
    ``given`` (grouped by ``tiles``); ``(None, "base (refused)")`` when ``adapt`` refuses them and
    the analyst keeps the base model."""
    try:
        a = adapt_head(raw[given], embedding[given], labels[given], base, tiles=tiles[given])
    except AdaptError:
        return None, "base (refused)"
    p = np.exp(a.head.log_probabilities(raw[rest], embedding[rest]))
    return grade_ids(p, INTACT, base.false_alarm_cost), a.head.method


def tuned_predictions(weights, b, given, rest, unlabelled, base_pred, seed, options=None):
    """``(predicted classes of rest, what was kept)`` of the network fine-tuned on the labels
    ``given`` (with the ``unlabelled`` buildings for FixMatch), as ``adapt --finetune`` /
    ``--semi`` would write it; the base model's own predictions when the base network is kept
    or fine-tuning refuses the labels."""
    try:
        r = finetune_labels(
            weights, b, given, unlabelled, FinetuneOptions(seed=seed, **(options or {}))
        )
    except FinetuneError:
        return base_pred, "base (refused)"
    if not r.epochs:
        return base_pred, "base"
    return finetuned_classes(r, b, rest), f"{r.epochs} epochs"


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per arm and k: draws, mean base and adapted macro-F1, mean gain (+- standard error),
    share of draws worse by more than :data:`WORSE`, and the heads chosen."""
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        for k in sorted({r["k"] for r in rows if r["arm"] == arm}):
            sel = [r for r in rows if r["arm"] == arm and r["k"] == k]
            gain = np.asarray([r["adapted"] - r["base"] for r in sel])
            out.append(
                {
                    "arm": arm,
                    "k": k,
                    "draws": len(sel),
                    "base": round(float(np.mean([r["base"] for r in sel])), 4),
                    "adapted": round(float(np.mean([r["adapted"] for r in sel])), 4),
                    "gain": round(float(gain.mean()), 4),
                    "gain_se": round(float(gain.std(ddof=1) / np.sqrt(len(gain))), 4)
                    if len(gain) > 1
                    else 0.0,
                    "worse_share": round(float(np.mean(gain < -WORSE)), 4),
                    "heads": dict(Counter(r["head"] for r in sel).most_common()),
                }
            )
    return out


def plot(summary: list[dict[str, Any]], path: str | Path) -> Path:
    """Two panels against k, one line per arm: mean macro-F1 gain over the base model (+- one
    standard error) and the share of draws worse by more than :data:`WORSE`; PNG, atomic."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.4))
    gain_ax, worse_ax = fig.subplots(1, 2)
    for arm in dict.fromkeys(s["arm"] for s in summary):
        sel = [s for s in summary if s["arm"] == arm]
        ks = [s["k"] for s in sel]
        gain_ax.errorbar(
            ks,
            [s["gain"] for s in sel],
            [s["gain_se"] for s in sel],
            marker="o",
            capsize=3,
            label=arm,
        )
        worse_ax.plot(ks, [100 * s["worse_share"] for s in sel], marker="o", label=arm)
    gain_ax.axhline(0, color="grey", lw=0.8)
    gain_ax.set(xlabel="labelled buildings of the tile (k)", ylabel="macro-F1 gain over the base")
    worse_ax.axhline(100 * 0.05, color="grey", lw=0.8, ls="--")
    worse_ax.set(xlabel="labelled buildings of the tile (k)", ylabel="% of draws worse by > 0.01")
    ks = sorted({s["k"] for s in summary})
    for ax in (gain_ax, worse_ax):
        ax.set_xticks(ks)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("A new tile of a known event (bench new-tile)", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    return path


def format_summary(summary: list[dict[str, Any]]) -> str:
    lines = [
        "| arm | k | draws | base macro-F1 | adapted | gain (+- se) | worse by > 0.01 | kept |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        heads = ", ".join(f"{h} {n}" for h, n in s["heads"].items())
        lines.append(
            f"| {s['arm']} | {s['k']} | {s['draws']} | {s['base']:.3f} | {s['adapted']:.3f} | "
            f"{s['gain']:+.3f} +- {s['gain_se']:.3f} | {100 * s['worse_share']:.0f}% | {heads} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.draws < 1:
        raise UsageError(f"--draws must be at least 1, got {args.draws}")
    options = NewTileOptions(
        ks=args.k,
        draws=args.draws,
        seed=args.seed,
        min_eval=args.min_eval,
        arms=args.arms,
        tune_draws=args.tune_draws,
    )
    result = bench_new_tile(args.model or default_model(), args.chips, options)
    if args.out:
        with atomic_path(Path(args.out), suffix=".json") as tmp:
            Path(tmp).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result["summary"], args.plot)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(
        f"{len(result['tiles'])} tiles the model did not train on "
        f"({result['left_out_training_tiles']} buildings of its training tiles left out)"
    )
    print(format_summary(result["summary"]))
    return 0
