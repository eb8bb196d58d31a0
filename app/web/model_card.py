"""The model card the web app shows beside its model picker, as Markdown: classes, training
data, validation and held-out test metrics, calibration, the ``ood`` flag and the adaptation to a
new event (:meth:`runtime.predictor.Predictor.card`).

Test figures measured on tiles the model was trained on (:mod:`runtime.training_tiles`) are
marked "in the model's training data" and not called held-out."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from app.adapt.model import few_tiles_text, unlabelled_text
from runtime.calibration import RAW_METHOD
from runtime.training_tiles import IN_TRAINING, TrainingTiles, training_tiles

if TYPE_CHECKING:
    from runtime.predictor import Predictor


def card_markdown(predictor: Predictor) -> str:
    """A model card as Markdown: classes, training data, validation and test metrics,
    calibration, licence."""
    card = predictor.card()
    trained = training_tiles(predictor.metadata)
    lines = [
        f"**{card['name']}** ({card.get('encoder') or '?'}, {card.get('method') or '?'}, "
        f"{card['precision']}, {card['input_size']} px input, {card['size_mb']} MB)",
        "",
        f"- classes: {', '.join(card['classes'])}",
        f"- training data: {_training_text(card.get('training_data'), trained)}",
        f"- licence: {_text(card.get('license'))}",
        f"- change map (heatmap): {'yes' if predictor.has_change_map else 'no'}",
        f"- validation: {_validation_text(card.get('validation_metrics'))}",
    ]
    tested = card.get("test_metrics")
    if isinstance(tested, dict):
        lines.append(_test_text(tested, trained))
    lines.append(f"- calibration: {_calibration_text(card.get('calibration'))}")
    lines.append(f"- grades: {_grade_text(card.get('grade_rule'))}")
    lines.append(f"- ood flag: {_ood_text(card.get('ood'))}")
    lines.append(f"- adapted to a new event: {_adaptation_text(card.get('adaptation'))}")
    return "\n".join(lines)


def _adaptation_text(block: Any) -> str:
    if not isinstance(block, dict):
        return "no (the trained head; adapt it with `local-damage adapt`)"
    labels = block.get("labels") or {}
    per_class = ", ".join(f"{k} {v}" for k, v in (labels.get("per_class") or {}).items() if v)
    events = ", ".join(str(e) for e in (labels.get("events") or {}))
    chosen = (block.get("cv") or {}).get("candidates", {}).get(block.get("method")) or {}
    base = block.get("cv", {}).get("candidates", {}).get("base") or {}
    base_model = block.get("base_model") or {}
    text = (
        f"yes, {block.get('method')} head fitted on {labels.get('n', '?')} labelled buildings "
        f"({per_class}) of {events or '?'}; base model {base_model.get('file', '?')}"
    )
    if chosen and base:
        text += (
            f"; cross-validated accuracy {_text(chosen.get('accuracy'))} "
            f"(base {_text(base.get('accuracy'))}), macro-F1 {_text(chosen.get('macro_f1'))} "
            f"(base {_text(base.get('macro_f1'))})"
        )

    for extra in (unlabelled_text(block), few_tiles_text(block)):
        if extra:
            text += f"; {extra}"
    return text


def _grade_text(block: Any) -> str:
    if not isinstance(block, dict) or float(block.get("false_alarm_cost", 1.0)) == 1.0:
        return "the most probable grade (no false-alarm cost of its own)"
    return (
        f"{block.get('rule')}: the model's own rule (false-alarm cost "
        f"{_text(float(block['false_alarm_cost']))}), used when the cost field is left empty"
    )


def _ood_text(block: Any) -> str:
    if not isinstance(block, dict) or block.get("threshold") is None:
        return "off: the model carries no class prototypes (add them with `local-damage calibrate`)"
    src, thr = block.get("prototypes_from") or {}, block.get("threshold_from") or {}
    carried = thr.get("rank_from_folds")
    where = (
        f"threshold flags {_text(thr.get('flagged'))} of {thr.get('n', '?')} buildings of fold "
        f"{thr.get('fold', '?')}"
        if not isinstance(carried, dict)
        else f"threshold carried over from {len(carried.get('folds') or [])} fold models, where "
        f"it flagged {_text(block.get('quantile'))} of their held-out buildings: it flags "
        f"{_text(thr.get('flagged'))} of this model's {thr.get('n', '?')} training buildings"
    )
    return (
        f"on, when the largest cosine to a class prototype is below "
        f"{_text(float(block['threshold']))} (prototypes from {src.get('selection', '?')}; "
        f"{where})"
    )


def _calibration_text(block: Any) -> str:
    if not isinstance(block, dict) or block.get("temperature") is None:
        return "none: the probabilities are the plain softmax of the logits, likely over-confident"
    fitted = block.get("fitted_on") or {}
    if block.get("adapted"):
        t = float(block.get("temperature") or 1.0)
        return f"T = {_text(t)} on the adapted model's output: {_text(fitted.get('selection'))}"
    if block.get("method") == RAW_METHOD:
        text = (
            "none applied on purpose: the plain softmax of the logits (T = 1) was kept; a "
            f"temperature fitted on {fitted.get('n', '?')} held-out buildings "
            f"({_text(fitted.get('selection'))}) would be T = "
            f"{_text(float(block.get('fitted_temperature', 1.0)))}"
        )
        before, after = block.get("before"), block.get("after_if_fitted")
        if (
            isinstance(before, dict)
            and isinstance(after, dict)
            and "ece" in before
            and "ece" in after
        ):
            text += f" (ECE there {_text(before['ece'])} raw, {_text(after['ece'])} with it)"
        return text
    where = fitted.get("selection") or (
        f"fold {fitted['fold']} of {fitted.get('chips')}"
        if fitted.get("fold") is not None
        else _text(fitted.get("chips"))
    )
    text = (
        f"calibrated by temperature scaling, T = {_text(float(block['temperature']))}, fitted on "
        f"{fitted.get('n', '?')} buildings ({where})"
    )
    before, after = block.get("before"), block.get("after")
    if isinstance(before, dict) and isinstance(after, dict) and "ece" in before and "ece" in after:
        text += f"; ECE {_text(before['ece'])} before, {_text(after['ece'])} after, on those chips"
    return text


def _test_text(tested: dict[str, Any], trained: TrainingTiles) -> str:
    """The test figures' line: held-out when none of their tiles is a training tile, marked
    :data:`IN_TRAINING` when some are, and saying so when that cannot be told."""
    f1 = tested.get("f1") or {}
    figures = (
        f"accuracy {_text(tested.get('accuracy'))}, macro-F1 {_text(tested.get('macro_f1'))}"
        + (", F1 " + ", ".join(f"{k} {_text(v)}" for k, v in f1.items()) if f1 else "")
    )
    tiles = tested.get("tiles")
    inside = trained.among(tiles) if isinstance(tiles, list) else None
    n = f"{tested.get('n', '?')} buildings" + (f", {len(tiles)} tiles" if tiles else "")
    cv = tested.get("cross_validation")
    if isinstance(cv, dict):
        folds = cv.get("folds") or []
        cost = cv.get("false_alarm_cost")
        rule = (
            f"; graded at false-alarm cost {float(cost):g}, the model's own rule"
            if isinstance(cost, (int, float)) and float(cost) != 1.0
            else ""
        )
        return (
            f"- its recipe cross-validated ({n}, {len(folds)} folds; each building graded by a "
            f"model of the same recipe that never saw its tile, not by this model{rule}): "
            f"{figures}"
            + (f", ECE {_text(cv['ece'])}" if cv.get("ece") is not None else "")
            + (
                f", intact buildings called damaged {cv['intact_called_damaged']:.1%}"
                if isinstance(cv.get("intact_called_damaged"), float)
                else ""
            )
        )
    if inside:
        return (
            f"- test figures ({n}), **{IN_TRAINING}** ({len(inside)} of {len(tiles)} tiles): not "
            f"held-out figures of this model (from {_text(tested.get('source'))}): {figures}"
        )
    if inside is None:
        why = "its test tiles are not recorded" if not tiles else trained.source
        return f"- test ({n}; whether the model trained on them is unknown: {why}): {figures}"
    return f"- held-out test ({n}, none {IN_TRAINING}): {figures}"


def _training_text(info: Any, trained: TrainingTiles) -> str:
    if not isinstance(info, dict):
        return _text(info)
    events = info.get("events") or []
    text = f"{info.get('source', 'unknown')}"
    if info.get("train_chips") is not None:
        text += f", {info['train_chips']} training buildings"
    if trained.tiles is not None:
        text += f" on {len(trained.tiles)} tiles"
    if events:
        text += f" from {len(events)} event(s): {', '.join(map(str, events))}"
    if info.get("credit"):
        text += f" ({info['credit']})"
    if trained.tiles is None:
        text += f"; training tiles unknown ({trained.source})"
    return text


def _validation_text(metrics: Any) -> str:
    if not isinstance(metrics, dict) or not metrics:
        return "not recorded"
    if metrics.get("macro_f1") is None:
        return "none (trained on every labelled chip; see the test figures)"
    shown = {k: v for k, v in metrics.items() if v is not None and not isinstance(v, (dict, list))}
    return ", ".join(f"{k} {_text(v)}" for k, v in shown.items())


def _text(value: Any) -> str:
    if value is None:
        return "not recorded"
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, default=str)[:300]
    return str(value)
