"""The web app's Adapt and Suggest: adapt a model to the corrections of one event, and rank
the buildings of an assessed tile to correct next (no torch, no Gradio).

The corrections an analyst saves (:func:`app.web.sessions.save_correction`) accumulate over every
assessment of the same event in the app's work folder: :func:`event_labels` reads them all
from the work folder's label store (:func:`app.adapt.corrections.from_store`), a building corrected
in several assessments or by several analysts counting once, with its latest class. :func:`adapt_to_event` fits a head on them (:func:`app.adapt.model.adapt_model`)
and writes the adapted model, atomically, as ``WORK/models/<event>-adapted-<n>.onnx``, the folder
whose models the app adds to its picker. :func:`suggest_next` lists the tile's uncorrected
buildings to correct next (:func:`app.adapt.suggest.suggest`: a random draw before the model is adapted,
then its uncertain buildings and the random draw in turn).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.adapt.corrections import from_session, from_store
from app.adapt.labelled import LabelError
from app.adapt.model import adapt_model, few_tiles_text, format_finetune, unlabelled_text
from app.adapt.recalibrate import recalibration_text
from app.adapt.suggest import suggest
from app.web.sessions import (
    AppError,
    import_work,
    list_sessions,
    read_corrections_json,
    read_session,
    session_event,
    set_event,
)
from data_prep.errors import LocalDamageError
from data_prep.label_store import STORE_NAME
from data_prep.store import safe_name

if TYPE_CHECKING:
    from app.adapt.labelled import Buildings
    from app.adapt.model import AdaptResult
    from runtime.predictor import Predictor

#: Sub-folder of the app's work folder holding the adapted models.
MODELS_FOLDER = "models"
#: How many buildings Suggest ranks by default.
SUGGEST_N = 10
#: Below this many corrections the status warns that the gain is uncertain (docs/experiments/fewshot.md:
#: on events a model had not seen, the gain from 5 or 10 labels varied widely between draws).
FEW_LABELS = 20

_name_lock = threading.Lock()


@dataclass
class EventLabels:
    """The corrected buildings of one event, and where they came from.

    Attributes:
        event: the event name.
        buildings: the labelled buildings (one per building, its latest correction).
        sessions: the assessment folders read.
        left_out: one line per assessment of the event whose corrections could not be read.
    """

    event: str
    buildings: Buildings
    sessions: list[Path] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)


def event_sessions(work: str | os.PathLike, event: str) -> list[Path]:
    """The assessments under ``work/sessions`` of ``event`` that show corrections, oldest first."""
    out = []
    for session in list_sessions(work):
        try:
            if session_event(session) == event and read_corrections_json(session):
                out.append(session)
        except (AppError, ValueError, OSError):  # unreadable: not one of this event's
            continue
    return out


def event_labels(predictor: Predictor, work: str | os.PathLike, event: str) -> EventLabels:
    """Every correction saved for ``event`` in the app's work folder's label store, as labelled
    buildings (:func:`app.adapt.corrections.from_store`): each building once, with its latest
    grade, whichever analyst or assessment set it.

    Raises:
        AppError: no correction of ``event`` can be read.
    """
    spec, names = predictor.spec, predictor.class_names
    import_work(work)  # assessments kept before the store: their corrections.json, once
    try:
        buildings, read, left_out = from_store(Path(work) / STORE_NAME, spec, names, event)
    except LabelError as exc:
        raise AppError(
            f"no corrections saved for event {event} yet ({exc}): select a building, pick its "
            "right class and click 'Save correction' first"
        ) from exc
    return EventLabels(event, buildings, read, left_out)


def next_model_path(folder: str | os.PathLike, event: str) -> Path:
    """``folder/<event>-adapted-<n>.onnx`` with ``n`` one more than the largest there."""
    stem = f"{safe_name(event)}-adapted-"
    taken = [
        int(m.group(1))
        for p in Path(folder).glob(f"{stem}*.onnx")
        if (m := re.fullmatch(re.escape(stem) + r"(\d+)\.onnx", p.name))
    ]
    return Path(folder) / f"{stem}{max(taken, default=0) + 1}.onnx"


@dataclass
class EventAdaptation:
    """What :func:`adapt_to_event` did: the adapted model, its labels, and the seconds taken."""

    model: Path
    labels: EventLabels
    result: AdaptResult
    seconds: float

    @property
    def block(self) -> dict[str, Any]:
        """The adapted model's ``adaptation`` metadata."""
        return self.result.block

    def status(self) -> str:
        """A short Markdown report: labels per class, the head kept, its cross-validated figures
        against the base model's, the time."""
        block = self.block
        labels = block["labels"]
        per_class = ", ".join(f"{k} {v}" for k, v in labels["per_class"].items() if v)
        n_sessions = len(self.labels.sessions)
        cv = block["cv"]
        chosen = cv["candidates"].get(block["method"]) or {}
        base = cv["candidates"].get("base") or {}
        tuned = block.get("finetune")
        lines = [
            f"**Adapted** to {labels['n']} corrected buildings of event **{self.labels.event}** "
            f"({n_sessions} assessment{'s' if n_sessions != 1 else ''}): {per_class}.",
            "",
            _what_was_kept(block, tuned, cv["scheme"]),
        ]
        if base and chosen:
            lines.append(
                f"- cross-validated accuracy {chosen['accuracy']:.3f} (base model "
                f"{base['accuracy']:.3f}), macro-F1 {chosen['macro_f1']:.3f} (base "
                f"{base['macro_f1']:.3f}), log-loss {chosen['nll']:.3f} (base {base['nll']:.3f}"
                + (
                    f", recalibrated {base['nll_recalibrated']:.3f}: the one to beat)"
                    if base.get("nll_recalibrated") is not None
                    else ")"
                )
            )

        for text in (
            unlabelled_text(block, "correction yet"),
            recalibration_text(block),
            few_tiles_text(block),
        ):
            if text:
                lines.append(f"- {text}")
        if labels["n"] < FEW_LABELS:
            lines.append(
                f"- few corrections: on events a model had not seen, the gain from fewer than "
                f"{FEW_LABELS} labels varied widely between draws of the labels (docs/experiments/fewshot.md); "
                "compare the figures above, correct more buildings (Suggest next) and Adapt again"
            )
        lines.append(
            f"- wrote `{self.model.name}` in {self.seconds:.1f} s (embedding pass "
            f"{self.result.embed_seconds:.2f} s, fit {self.result.fit_seconds:.2f} s), on base "
            f"model {block['base_model'].get('file')}"
        )
        for problem in self.labels.left_out:
            lines.append(f"- left out: {problem}")
        if tuned:
            lines += ["", "```", format_finetune(block), "```"]
        return "\n".join(lines)


def _what_was_kept(block: dict[str, Any], tuned: dict[str, Any] | None, scheme: str) -> str:
    """The status line saying which model the adaptation kept."""
    if tuned and tuned.get("epochs"):
        return (
            f"- network fine-tuned: **{tuned['epochs']} epoch(s)** of the last block and the "
            f"classifier, chosen by cross-validation ({scheme}); the held-out curve below"
        )
    if tuned:
        return (
            f"- fine-tuning cross-validated over {tuned.get('max_epochs', '?')} epoch(s) "
            f"({scheme}) and **the base network was kept**: no epoch beat it clearly (the curve "
            "below), so the new model grades as the base model does"
        )
    text = f"- head: **{block['method']}** (the base model unless a candidate beats it clearly, {scheme})"
    if block["method"] == "base":
        text += "; no head beat the base model on these labels, so the new model grades as the base model does"
    return text


#: What the app says when fine-tuning is asked for and PyTorch is not installed.
FINETUNE_INSTALL = (
    "fine-tuning the network needs PyTorch, which this installation lacks: pip install "
    "'torch>=2.4' 'torchvision>=0.19' 'segmentation-models-pytorch>=0.3.4' safetensors, then "
    "restart `local-damage app` (Adapt without it fits the head in seconds)"
)


def adapt_to_event(
    predictor: Predictor,
    work: str | os.PathLike,
    session: str | os.PathLike,
    event: str | None = None,
    models_dir: str | os.PathLike | None = None,
    finetuner: Callable | None = None,
) -> EventAdaptation:
    """Adapt ``predictor``'s model to every correction of the event of ``session``.

    Args:
        predictor: the base model (an adapted one is refitted from its graph, not stacked).
        work: the app's work folder (assessments under ``work/sessions``).
        session: the current assessment; its event is set to ``event`` when given.
        event: the event name (default: the one recorded for ``session``).
        models_dir: where to write the model (default ``work/models``).
        finetuner: fine-tune the network instead of adapting the head:
            ``finetuner(predictor, buildings, out)`` returning an
            :class:`app.adapt.model.AdaptResult` (``local-damage app`` passes
            ``cli.adapt.finetune_model`` when PyTorch is installed; the app itself never imports
            torch).

    Returns:
        The :class:`EventAdaptation`; the model is ``models_dir/<event>-adapted-<n>.onnx``.

    Raises:
        AppError: no assessment, no corrections of the event, a single correction, or
            anything else :func:`app.adapt.model.adapt_model` refuses; nothing is written then.
    """
    start = time.perf_counter()
    event = set_event(session, event) if event and event.strip() else session_event(session)
    labels = event_labels(predictor, work, event)
    n = int(labels.buildings.labelled.sum())
    if n < 2:
        raise AppError(
            f"event {event} has {n} correction: adapting needs at least two (correct another "
            "building too)"
        )
    folder = Path(models_dir) if models_dir is not None else Path(work) / MODELS_FOLDER
    with _name_lock:  # two Adapt clicks at once must not pick the same name
        out = next_model_path(folder, event)
        try:
            if finetuner is not None:
                result = finetuner(predictor, labels.buildings, out)
            else:
                result = adapt_model(predictor, labels.buildings, out)
        except LocalDamageError as exc:
            raise AppError(f"event {event}: {exc}") from exc
    return EventAdaptation(out, labels, result, time.perf_counter() - start)


def suggest_next(
    predictor: Predictor,
    session: str | os.PathLike,
    n: int = SUGGEST_N,
    work: str | os.PathLike | None = None,
) -> list[dict[str, Any]]:
    """The ``n`` uncorrected buildings of an assessed tile to correct next, best first.

    Args:
        predictor: the model whose uncertainty counts (the one in the picker).
        session: the assessment folder.
        n: how many to rank.
        work: the app's work folder: the corrections of other assessments of the same event
            count as labelled too (picks are kept away from them); None: this tile's only.

    Returns:
        One dict per building: ``rank``, ``#`` (its row of the building table), ``uid``,
        ``damage`` (the model's grade), ``confidence``, ``uncertainty`` (1 minus the margin
        between the two likeliest classes) and ``distance`` (cosine distance in the embedding
        space to the nearest building corrected or ranked before it).

    Raises:
        AppError: no assessment, its imagery gone, or no uncorrected building left.
    """
    info = read_session(session)
    event = session_event(session)
    try:
        pool = from_session(session, predictor.spec, predictor.class_names, event)
    except LabelError as exc:
        raise AppError(str(exc)) from exc
    if not (~pool.labelled).any():
        raise AppError(
            f"every gradable building of {info.get('scene')} is corrected already; nothing to "
            "suggest"
        )
    others = None
    if work is not None:
        try:
            others = event_labels(predictor, work, event).buildings
        except AppError:  # nothing corrected elsewhere yet
            others = None
    ranked = suggest(predictor, pool, max(1, int(n)), labelled=others)
    rows = {uid: i for i, uid in reversed(list(enumerate(info["uids"])))}
    return [
        {
            "rank": s.rank,
            "#": s.row if s.row is not None else rows.get(s.id, -1),
            "uid": s.id,
            "damage": s.predicted,
            "confidence": round(s.confidence, 4),
            "uncertainty": round(1.0 - s.margin, 4),
            "distance": round(s.distance, 4),
        }
        for s in ranked
    ]
