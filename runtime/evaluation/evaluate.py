"""`local-damage evaluate`: score a trained model on labelled chips and write its metrics.

A model is either a run folder (rebuilt and run with PyTorch) or an exported ONNX model (run
through :class:`runtime.predictor.Predictor`, the serving path). Both are wrapped as a
:class:`runtime.evaluation.scorers.Scorer` (the run folder's is
:class:`local_damage.evaluation.torch_scorer.TorchScorer`), whose ``score`` turns a list of
chips into a ``Scored`` bundle (labels, logits, probabilities, ``z``, and ``e_post`` where the
backend exposes it), so everything after that (metrics, representation geometry, figures,
files) is shared and torch-free.

Outputs in ``OUT/``::

    metrics.json          classification metrics, ``calibration`` and ``representation`` blocks
                          and the ``source``
    predictions.csv       chip_id, label, pred, one probability column per class, then one
                          raw logit column per class (for calibration fitted afterwards)
    confusion_matrix.png
    reliability.png       reliability diagram: accuracy per confidence bin, before and after
                          calibration when the model has a temperature
    tsne_z.png            t-SNE of the joint embedding z (unless --no-tsne)
    tsne_e_post.png       t-SNE of the post-image embedding e_post (PyTorch path only)

The calibration block holds the ECE (15 bins), NLL and Brier score of the softmax of the raw
logits (``before``) and, for an ONNX model calibrated by ``local-damage calibrate``, of the
probabilities with its temperature applied (``after``; :mod:`runtime.metrics.calibration`).

The ``training_data`` block says which of the evaluated chips lie on tiles the model was trained
on (:mod:`runtime.training_tiles`): figures on them are in-sample, and the printed summary marks
them "in the model's training data" and gives the figures of the other tiles apart.

The representation block follows Sec. 3.1 of the paper: CAC, CAD, GPU and the class-mean Gram
matrix on ``z`` of the unaugmented chips; SAA and SAD between that view and a second view made
with the training augmentation (seeded), when ``views == 2``. Chips whose ``z`` is the zero
vector (identical pre and post projections, which the fixed-difference correlation maps to 0)
have no direction: they are left out of the representation metrics and t-SNE plots, and counted.
"""

from __future__ import annotations

import csv
import logging
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.store import atomic_path, read_manifest, write_json
from data_prep.xbd import prepare_xbd
from runtime.evaluation.chips import select_chips, warn_spec_mismatch
from runtime.evaluation.scorers import EvaluationError, Scored, Scorer
from runtime.grading import GRADE_RULE_KEY, grade_rule_block, grades, resolve_cost
from runtime.metrics import (
    ECE_BINS,
    calibration_metrics,
    classification_metrics,
    ece_sampling_floor,
    plot_confusion_matrix,
    plot_embedding_tsne,
    plot_reliability_diagram,
    reliability_bins,
    representation_metrics,
    unit_rows,
)
from runtime.predictor import softmax
from runtime.training_tiles import IN_TRAINING, NOT_COMPARABLE, TrainingTiles

log = logging.getLogger(__name__)

METRICS_JSON = "metrics.json"
PREDICTIONS_CSV = "predictions.csv"
RELIABILITY_PNG = "reliability.png"


# --------------------------------------------------------------------------------------------
# the evaluation


@dataclass(frozen=True)
class EvaluationOptions:
    """How labelled chips are evaluated: the views, the figures and the batches (the model, the
    chips and the output folder are :func:`evaluate`'s arguments).

    Attributes:
        views: 2 adds SAA and SAD from a second, augmented view of every chip (the scorer
            needs one: :class:`~runtime.evaluation.scorers.OnnxScorer`'s ``second_view``); 1
            skips them.
        tsne: write the t-SNE figures.
        batch_size: pairs per forward pass.
        seed: seed of the second view's augmentation and of t-SNE.
        progress: show progress bars.
        false_alarm_cost: the grade rule the figures are computed with
            (:mod:`runtime.grading`); None: the model's own (:attr:`Scorer.false_alarm_cost`).
    """

    views: int = 2
    tsne: bool = True
    batch_size: int = 64
    seed: int = 0
    progress: bool = False
    false_alarm_cost: float | None = None


def evaluate(
    scorer: Scorer,
    chips: str | Path,
    chip_ids: Sequence[str],
    out: str | Path,
    options: EvaluationOptions | None = None,
    source: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Score labelled chips and write metrics.json, predictions.csv and the figures to ``out``.

    Args:
        scorer: the model (:class:`~runtime.evaluation.scorers.OnnxScorer`, or
            :class:`~local_damage.evaluation.torch_scorer.TorchScorer` for a run folder).
        chips: chip store folder.
        chip_ids: the labelled chips to evaluate (see :func:`select_chips`); outputs list them
            in manifest order.
        out: output folder.
        options: views, figures, batches, seed and progress (default ``EvaluationOptions()``).
        source: extra entries for the ``source`` block (chips, fold, selection...).

    Returns:
        The metrics dict also written to ``out/metrics.json``: the keys of
        :func:`~runtime.metrics.classification_metrics` (of the grades under ``grade_rule``,
        ``{"false_alarm_cost", "rule"}``), ``calibration`` (see
        :func:`calibration_report`), ``representation`` (see
        :func:`~runtime.metrics.representation_metrics`, plus
        ``zero_embeddings_left_out``, see :func:`~runtime.metrics.unit_rows`; None with
        fewer than 2 usable embeddings), ``source`` and ``views``.
    """
    if not chip_ids:
        raise EvaluationError(f"{chips}: no chips to evaluate")
    options = options or EvaluationOptions()
    views, seed = options.views, options.seed
    out = Path(out)
    scored = scorer.score(
        chips,
        chip_ids,
        views=views,
        batch_size=options.batch_size,
        seed=seed,
        progress=options.progress,
    )
    names = list(scorer.class_names)
    if scored.labels.min() < 0:
        raise EvaluationError(
            f"{chips}: unlabelled chips cannot be evaluated; select labelled ones"
        )
    cost = resolve_cost(options.false_alarm_cost, scorer.false_alarm_cost)
    if cost != 1.0:
        scored.graded = grades(scored.probabilities, names, cost)
    metrics = classification_metrics(scored.labels, scored.predictions, names)
    metrics[GRADE_RULE_KEY] = grade_rule_block(cost)
    metrics["calibration"], reliability = calibration_report(scored, scorer.temperature)
    metrics["per_event"] = per_event_metrics(chips, scored, names)
    tiles = read_manifest(chips).set_index("chip_id").loc[list(scored.chip_ids), "tile"]
    tiles = tiles.astype(str).to_numpy()
    metrics["training_data"] = training_overlap(scorer.training_tiles, tiles, scored, names)
    z, valid = unit_rows(scored.z)
    z2 = None
    if views == 2 and scored.z_view2 is not None:
        z2, valid2 = unit_rows(scored.z_view2)
        valid &= valid2
    representation = None
    if valid.sum() >= 2:
        representation = representation_metrics(
            z[valid], scored.labels[valid], names, z_view2=None if z2 is None else z2[valid]
        )
        representation["zero_embeddings_left_out"] = int((~valid).sum())
    metrics["representation"] = representation
    metrics["views"] = views
    metrics["source"] = {**scorer.source, "input_size": scorer.input_size, **(source or {})}
    metrics["source"]["tiles"] = sorted(set(tiles))

    out.mkdir(parents=True, exist_ok=True)
    write_predictions(out / PREDICTIONS_CSV, scored, names)
    write_json(out / METRICS_JSON, metrics)
    where = ", ".join(f"{k} {v}" for k, v in scorer.source.items())
    plot_confusion_matrix(
        metrics["confusion_matrix"],
        names,
        out / "confusion_matrix.png",
        title=f"{len(scored.labels)} buildings, accuracy {metrics['accuracy']:.3f}",
    )
    plot_reliability_diagram(
        reliability,
        out / RELIABILITY_PNG,
        title=f"{where}\n{len(scored.labels)} buildings, {ECE_BINS} confidence bins",
    )
    if options.tsne:
        for key, emb, what in (
            ("z", scored.z, "z (pre/post joint)"),
            ("e_post", scored.e_post, "e_post (post image)"),
        ):
            if emb is None:
                continue
            unit, ok = unit_rows(emb)
            if ok.sum() < 3:
                continue
            title = f"{what}: {where}"
            if not ok.all():
                title += f"\n{int((~ok).sum())} zero embedding(s) left out"
            plot_embedding_tsne(
                unit[ok], scored.labels[ok], names, out / f"tsne_{key}.png", title, seed
            )
    return metrics


def calibration_report(
    scored: Scored, temperature: float | None
) -> tuple[dict[str, Any], dict[str, dict]]:
    """Calibration figures of scored chips, and the reliability tables to plot.

    Returns:
        ``(block, curves)``: ``block`` is ``{"temperature", "bins", "before", "after"}`` with
        ``before`` the :func:`~runtime.metrics.calibration_metrics` (ECE, NLL, Brier,
        accuracy) of the softmax of the raw logits and ``after`` those of the calibrated
        probabilities (None without a temperature), each with ``ece_floor``: the ECE chance
        alone gives that many predictions at those confidences
        (:func:`~runtime.metrics.ece_sampling_floor`); ``curves`` maps a legend label with the ECE
        to the :func:`~runtime.metrics.reliability_bins` of each.
    """
    raw = softmax(scored.logits)
    before = calibration_metrics(raw, scored.labels)
    before["ece_floor"] = ece_sampling_floor(raw)
    after = None
    if temperature:
        after = calibration_metrics(scored.probabilities, scored.labels)
        after["ece_floor"] = ece_sampling_floor(scored.probabilities)
    curves = {
        f"{'before calibration' if temperature else 'uncalibrated'} (ECE {before['ece']:.3f})": (
            reliability_bins(raw, scored.labels)
        )
    }
    if after is not None:
        label = f"after, T = {temperature:.3f} (ECE {after['ece']:.3f})"
        curves[label] = reliability_bins(scored.probabilities, scored.labels)
    block = {"temperature": temperature, "bins": ECE_BINS, "before": before, "after": after}
    return block, curves


def training_overlap(
    trained: TrainingTiles, tiles: np.ndarray, scored: Scored, class_names: Sequence[str]
) -> dict[str, Any]:
    """Which evaluated chips lie on tiles the model was trained on (``tiles``: the tile of each
    scored chip), and, when only some do, the figures of the others.

    Returns:
        ``known``, ``source`` and ``tiles`` (how many tiles the model lists) of
        :meth:`~runtime.training_tiles.TrainingTiles.to_dict`, plus, when known,
        ``tiles_evaluated``, ``tiles_in_training`` (their names), ``chips_in_training``, ``n``
        and, for a mix, ``held_out``: ``n``, ``tiles``, accuracy, macro-F1 and xView2 damage F1
        of the chips on the other tiles.
    """
    block = trained.to_dict()
    inside = trained.among(tiles)
    if inside is None:
        return block
    mask = np.isin(tiles, inside)
    block.update(
        tiles_evaluated=len(set(tiles)),
        tiles_in_training=inside,
        chips_in_training=int(mask.sum()),
        n=len(tiles),
    )
    if mask.any() and not mask.all():
        keep = ~mask
        m = classification_metrics(scored.labels[keep], scored.predictions[keep], class_names)
        block["held_out"] = {
            "n": int(keep.sum()),
            "tiles": len(set(tiles[keep])),
            **{k: m[k] for k in ("accuracy", "macro_f1", "xview2_damage_f1")},
        }
    return block


def training_lines(block: dict[str, Any] | None) -> tuple[str, list[str]]:
    """``(mark, lines)`` for a printed summary: the mark (``" *"``) its rows carry when some
    chips lie on the model's training tiles, and the lines that say so (or that this is unknown)."""
    if not block:
        return "", []
    if not block.get("known"):
        return "", [
            f"the model's training tiles are unknown ({block.get('source')}): these figures may "
            "be in-sample"
        ]
    inside, n = block.get("chips_in_training", 0), block.get("n", 0)
    tiles = len(block.get("tiles_in_training") or [])
    if not inside:
        return "", [f"none of these {block.get('tiles_evaluated')} tiles is {IN_TRAINING}"]
    lines = [
        f"* {IN_TRAINING}: {inside} of {n} buildings ({tiles} of {block.get('tiles_evaluated')} "
        f"tiles); {NOT_COMPARABLE}"
    ]
    held = block.get("held_out")
    if held:
        lines.append(
            f"held-out tiles only ({held['n']} buildings, {held['tiles']} tiles): accuracy "
            f"{held['accuracy']:.4f}  macro-F1 {held['macro_f1']:.4f}  xView2 damage F1 "
            f"{held['xview2_damage_f1']:.4f}"
        )
    return " *", lines


def per_event_metrics(
    chips: str | Path, scored: Scored, class_names: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Accuracy, macro-F1 and per-class F1 of each event of the store's manifest among the
    scored chips (``{event: {"n", "accuracy", "macro_f1", "per_class_f1", "support"}}``; a
    class absent from an event has F1 None and does not enter its macro-F1)."""
    manifest = read_manifest(chips).set_index("chip_id")
    events = manifest.loc[list(scored.chip_ids), "event"].astype(str).to_numpy()
    out: dict[str, dict[str, Any]] = {}
    for event in sorted(set(events)):
        rows = events == event
        labels, preds = scored.labels[rows], scored.predictions[rows]
        present = [i for i in range(len(class_names)) if (labels == i).any()]
        m = classification_metrics(labels, preds, class_names)
        f1 = {
            name: (m["per_class"][name]["f1"] if i in present else None)
            for i, name in enumerate(class_names)
        }
        scores = [v for v in f1.values() if v is not None]
        out[event] = {
            "n": int(rows.sum()),
            "accuracy": m["accuracy"],
            "macro_f1": float(np.mean(scores)) if scores else None,
            "per_class_f1": f1,
            "support": {name: int((labels == i).sum()) for i, name in enumerate(class_names)},
        }
    return out


def write_predictions(path: str | Path, scored: Scored, class_names: Sequence[str]) -> None:
    """Write ``predictions.csv``: chip_id, label, pred, ``p_<class>`` then ``logit_<class>``
    for every class (the logits raw, before any temperature)."""
    preds = scored.predictions
    with atomic_path(path, suffix=".csv") as tmp, open(tmp, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(
            [
                "chip_id",
                "label",
                "pred",
                *(f"p_{name}" for name in class_names),
                *(f"logit_{name}" for name in class_names),
            ]
        )
        for i, chip_id in enumerate(scored.chip_ids):
            writer.writerow(
                [chip_id, int(scored.labels[i]), int(preds[i])]
                + [f"{float(p):.6f}" for p in scored.probabilities[i]]
                + [f"{float(v):.6f}" for v in scored.logits[i]]
            )


def format_summary(metrics: dict[str, Any]) -> str:
    """A short plain-text table of a metrics dict: per-class scores, then the totals; rows
    computed on the model's training tiles are marked (:func:`training_lines`)."""
    mark, trained = training_lines(metrics.get("training_data"))
    lines = [f"{'class':<14}{'precision':>10}{'recall':>10}{'f1':>10}{'support':>10}"]
    for name, row in metrics["per_class"].items():
        lines.append(
            f"{name:<14}{row['precision']:>10.4f}{row['recall']:>10.4f}{row['f1']:>10.4f}"
            f"{row['support']:>10d}{mark}"
        )
    lines.append(
        f"n {metrics['n']}  accuracy {metrics['accuracy']:.4f}  macro-F1 {metrics['macro_f1']:.4f}"
        f"  xView2 damage F1 {metrics['xview2_damage_f1']:.4f}{mark}"
    )
    if metrics.get("absent_classes"):
        lines.append(f"absent (left out of macro-F1): {', '.join(metrics['absent_classes'])}")
    rule = metrics.get(GRADE_RULE_KEY)
    if rule and rule.get("false_alarm_cost", 1.0) != 1.0:
        lines.append(f"grades: {rule['rule']}")
    cal = metrics.get("calibration")
    if cal:
        parts = []
        for key, name in (("ece", "ECE"), ("nll", "NLL"), ("brier", "Brier")):
            text = f"{name} {cal['before'][key]:.4f}"
            if cal.get("after"):
                text += f" -> {cal['after'][key]:.4f}"
            parts.append(text)
        head = (
            f"calibration (T = {cal['temperature']:.4f}, before -> after)"
            if cal.get("after")
            else "calibration (no temperature)"
        )
        lines.append(f"{head}: {'  '.join(parts)}{mark}")
        floors = [cal[k].get("ece_floor") for k in ("before", "after") if cal.get(k)]
        if floors and all(floors):
            lines.append(
                "ECE a perfectly calibrated model would show on these buildings by chance: "
                + " -> ".join(f"{f['mean']:.4f} (95% under {f['p95']:.4f})" for f in floors)
            )
    rep = metrics.get("representation")
    if rep:
        shown = [
            f"{key.upper()} {rep[key]:.4f}"
            for key in ("saa", "sad", "cac", "cad", "gpu")
            if rep.get(key) is not None
        ]
        if rep.get("max_offdiag_abs_cos") is not None:
            shown.append(f"max |cos| class means {rep['max_offdiag_abs_cos']:.4f}")
        lines.append("representation: " + "  ".join(shown) + mark)
    return "\n".join(lines + trained)


def evaluate_xbd(
    scorer: Scorer,
    roots: Sequence[str | Path],
    out: str | Path,
    options: EvaluationOptions | None = None,
) -> dict[str, Any]:
    """Cut chips from xBD roots with the model's chip spec into a temporary store and evaluate
    every labelled chip of it (``options`` as :func:`evaluate`'s; its ``progress`` also shows
    the cutting).

    Raises:
        EvaluationError: the model's chip spec is unknown (a run without summary.json).
    """
    if scorer.spec is None:
        where = next(iter(scorer.source.values()))
        raise EvaluationError(
            f"{where}: the model's chip spec is unknown (no chip_spec in summary.json), so xBD "
            "tiles cannot be cut as in training; prepare a chip store and use --chips"
        )
    options = options or EvaluationOptions()
    with tempfile.TemporaryDirectory(prefix="evaluate-chips-") as tmp:
        report = prepare_xbd(list(roots), tmp, spec=scorer.spec, progress=options.progress)
        for item in report.skipped:
            log.warning(f"skipped {item}")
        chip_ids, _, unlabelled = select_chips(tmp)
        source = {
            "xbd": [str(r) for r in roots],
            "chip_spec": scorer.spec.to_dict(),
            "fold": None,
            "selection": "all labelled chips cut from the xBD roots",
            "unlabelled_left_out": unlabelled,
            "skipped": report.to_dict()["skipped"],
        }
        return evaluate(scorer, tmp, chip_ids, out, options, source=source)


def evaluate_chips(
    scorer: Scorer,
    chips: str | Path,
    out: str | Path,
    fold: int | None = None,
    options: EvaluationOptions | None = None,
) -> dict[str, Any]:
    """Evaluate the labelled chips of a store (fold ``fold`` of its splits, or all of them).

    Warns (logs) when the store was cut with another chip spec than the model's, and when
    evaluating every chip of the store the run was trained on. ``options`` as :func:`evaluate`'s.
    """
    chips = Path(chips)
    chip_ids, description, unlabelled = select_chips(chips, fold)
    warn_spec_mismatch(scorer, chips)
    summary = getattr(scorer, "summary", {})
    same_store = summary.get("chips") and Path(summary["chips"]).resolve() == chips.resolve()
    if fold is None and same_store and summary.get("fold") is not None:
        log.warning(
            f"note: the run held out fold {summary['fold']}; evaluating every chip includes its "
            f"training chips (use --fold {summary['fold']} for its validation fold)"
        )
    source = {
        "chips": str(chips),
        "fold": fold,
        "selection": description,
        "unlabelled_left_out": unlabelled,
    }
    return evaluate(scorer, chips, chip_ids, out, options, source=source)
