"""The functions the web app's events call, as plain functions (:mod:`app.web.events` binds them).

Each takes the :class:`AppContext` of the app (where it has one) and the values of the event's
input components, and returns the values of its output components; a mistake of the analyst
raises :class:`~app.web.sessions.AppError`, which the app shows as a message.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.web.adapt_panel import FINETUNE_INSTALL, adapt_to_event, suggest_next
from app.web.assess import (
    SUGGEST_COLUMNS,
    TileOptions,
    app_localizer,
    assess_tile,
    building_chips,
)
from app.web.chip import assess_chip
from app.web.model_card import card_markdown
from app.web.model_picker import ModelCache
from app.web.sessions import (
    AppError,
    carry_corrections,
    read_corrections_json,
    read_session,
    save_correction,
    session_event,
    set_event,
)
from app.web.tile_views import building_details, enlarge, map_frame, slider_images
from data_prep.label_store import store_for
from runtime.grading import check_cost

#: The heatmap's note when the model has a change map, and when it has none.
HEATMAP_NOTE = (
    "Heatmap: the latent feature-correlation map (channel-averaged pre/post feature "
    "difference), red where the model saw most change."
)
NO_HEATMAP_NOTE = "This model was exported without `--change-map`; showing the post chip only."


class AppContext:
    """What the events of one app share: the offered models, the work folder, the models folder
    (whose localiser finds the buildings of a tile without footprints) and the pixel limit.

    Args:
        models: the offered models.
        work: the app's work folder (assessments under ``work/sessions``, adapted models under
            ``work/models``).
        models_dir: the folder the picker's models come from.
        max_pixels: pixel limit per uploaded image (None: :func:`app.web.assess.app_max_pixels`).
        finetuner: what "Fine-tune the network" runs (see
            :func:`app.web.adapt_panel.adapt_to_event`); None when PyTorch is not installed.
    """

    def __init__(
        self,
        models: ModelCache,
        work: str | os.PathLike,
        models_dir: str | os.PathLike = "models",
        max_pixels: int | None = None,
        finetuner: Callable | None = None,
    ) -> None:
        self.models = models
        self.finetuner = finetuner
        self.work = Path(work)
        self.models_dir = models_dir
        self.max_pixels = max_pixels
        self._count = 0
        self._lock = threading.Lock()

    def new_session(self) -> Path:
        """A new assessment folder, ``work/sessions/<time>-<n>`` (not created)."""
        with self._lock:
            self._count += 1
            n = self._count
        return self.work / "sessions" / f"{time.strftime('%Y%m%d-%H%M%S')}-{n:04d}"


def file_path(f: Any) -> str | None:
    """The path of an uploaded file as Gradio passes it (a path, or an object with ``.name``)."""
    if f is None:
        return None
    return f if isinstance(f, str) else getattr(f, "name", None) or str(f)


def picker_choices(paths: list[str]) -> list[tuple[str, str]]:
    """``(file name, path)`` of each model file, as the model picker lists them."""
    return [(Path(c).name, c) for c in paths]


def offered_models(ctx: AppContext):
    """The model picker offering every model of the app, those adapted since it started too."""
    import gradio as gr

    return gr.Dropdown(choices=picker_choices(ctx.models.allowed))


def on_model(ctx: AppContext, path: str | None) -> str:
    """The model card of the chosen model, or why it cannot be used."""
    try:
        return card_markdown(ctx.models.get(path))
    except AppError as exc:
        return f"**Model not usable:** {exc}"


def on_assess_tile(ctx: AppContext, model_path, pre, post, footprints, false_alarm_cost=None):
    """Grade every building of a pre/post tile pair (xBD label JSON, GeoJSON or GeoPackage
    footprints), a damaged grade only where at least ``false_alarm_cost`` times as probable as
    no-damage (:mod:`runtime.grading`; empty: the model's own rule); returns the overlay PNG, a Markdown summary,
    the building table, the GeoJSON/CSV files and the session folder."""

    missing = [n for n, f in (("pre", pre), ("post", post)) if not f]
    if missing:
        raise AppError(f"upload the {', '.join(missing)} file(s) first")
    try:
        text = "" if false_alarm_cost is None else str(false_alarm_cost).strip()
        cost = None if text == "" else check_cost(float(text))
    except ValueError as exc:  # a cost that is no number, or not a positive one
        raise AppError(f"false-alarm cost {false_alarm_cost!r}: {exc}") from None
    predictor = ctx.models.get(model_path)
    result = assess_tile(
        predictor,
        file_path(pre),
        file_path(post),
        file_path(footprints),
        ctx.new_session(),
        TileOptions(max_pixels=ctx.max_pixels, false_alarm_cost=cost),
        localizer=None if footprints else app_localizer(ctx.models_dir),
    )
    return (
        str(result.overlay),
        result.summary(),
        corrected_table(result.session, result.rows),
        [str(result.vector), str(result.csv)],
        str(result.session),
    )


def on_assess_chip(ctx: AppContext, model_path, pre, post):
    """Grade one pre/post chip pair; returns class probabilities and the change heatmap."""
    if not pre or not post:
        raise AppError("upload both the pre and the post chip first")
    predictor = ctx.models.get(model_path)
    result = assess_chip(predictor, file_path(pre), file_path(post))
    note = HEATMAP_NOTE if result.change_map is not None else NO_HEATMAP_NOTE
    return result.probabilities, result.heatmap, f"**{result.damage}**. {note}"


def on_chips(ctx: AppContext, session, model_path, row):
    """The pre and post chips of building ``row``, enlarged to the page's chip size."""
    if not session:
        raise AppError("assess a tile first")
    pre, post = building_chips(ctx.models.get(model_path), session, int(row))
    return enlarge(pre), enlarge(post)


def on_building(ctx: AppContext, session, model_path, row):
    """The chosen building (the ``#`` box changed: a table row, a suggestion or a building on
    the map chosen, or a number typed): its chips side by side and its row of the table."""
    if not session or row is None:
        return None, None, ""
    pre, post = on_chips(ctx, session, model_path, row)
    return pre, post, building_details(session, int(row))


def on_views(session):
    """After an assessment: the pre/post slider's images and the tile's map."""
    if not session:
        return None, ""
    return slider_images(session), map_frame(session)


def no_building():
    """A new tile assessed: the ``#`` box empty until a building is chosen."""
    return None


def on_select(evt):
    """A row of the building table clicked (``evt``: Gradio's selection): its ``#``."""
    row_value = getattr(evt, "row_value", None)
    return int(row_value[0]) if row_value else int(evt.index[0])


def on_map_pick(evt):
    """A building clicked on the map (``evt.index``: its ``#``)."""
    return int(evt.index)


def on_pick(table, evt):
    """A suggested building clicked: its ``#`` in the building table."""
    row_value = getattr(evt, "row_value", None)
    if not row_value:
        row_value = table.iloc[int(evt.index[0])].tolist()
    return int(row_value[SUGGEST_COLUMNS.index("#")])


def analyst_name(request) -> str:
    """The analyst of a request: the name logged in with, else ``anonymous``."""
    return getattr(request, "username", None) or "anonymous"


def corrected_table(session, rows: list[dict[str, Any]] | None = None):
    """The building table of an assessment with each building's latest correction (any
    analyst's) in ``corrected`` and who set it in ``by``."""
    import pandas as pd

    if rows is None:
        table = pd.read_csv(read_session(session)["csv"], dtype={"uid": str})
        text = table.select_dtypes(exclude="number").columns
        table[text] = table[text].fillna("")
    else:
        table = pd.DataFrame(rows)
    done = read_corrections_json(session)
    if len(table):
        table["corrected"] = [done.get(str(i), {}).get("damage", "") for i in range(len(table))]
        table["by"] = [done.get(str(i), {}).get("analyst", "") for i in range(len(table))]
    return table


def on_correct(session, row, damage, request=None):
    """Save the class an analyst sets for building ``row`` in the label store, as the analyst
    logged in (``request``); returns a message and the store's file."""
    if not session:
        raise AppError("assess a tile first")
    if row is None or row == "":
        raise AppError("choose a building first: its # in the table, on the map or in the # box")
    who = analyst_name(request)
    path = save_correction(session, int(row), damage, analyst=who)
    store = store_for(session)
    return (
        f"Saved: building #{int(row)} is **{damage}** (by {who}) in the label store `{store}` "
        f"and the label file `{path}`",
        str(path),
    )


def on_corrected(session, row):
    """After a correction: the table with every correction and the building's details."""
    if not session:
        return None, ""
    details = "" if row is None or row == "" else building_details(session, int(row))
    return corrected_table(session), details


def on_assessed(session):
    """After an assessment: its event in the Event box, no suggestions yet."""
    import pandas as pd

    return session_event(session), pd.DataFrame(columns=SUGGEST_COLUMNS)


def on_adapt(ctx: AppContext, model_path, session, event, finetune=False):
    """Adapt the chosen model to the corrections of the tile's event (its head, or with
    ``finetune`` its network), offer and choose the adapted model, and grade the tile again with
    it."""
    import gradio as gr
    import pandas as pd

    if not session:
        raise AppError("assess a tile and correct a few buildings first")
    if finetune and ctx.finetuner is None:
        raise AppError(FINETUNE_INSTALL)
    tuner = ctx.finetuner if finetune else None
    done = adapt_to_event(ctx.models.get(model_path), ctx.work, session, event, finetuner=tuner)
    path = ctx.models.add(done.model)
    predictor = ctx.models.get(path)
    info = read_session(session)
    result = assess_tile(
        predictor,
        info["pre"],
        info["post"],
        info["footprints"],
        ctx.new_session(),
        TileOptions(max_pixels=ctx.max_pixels, source=info.get("source", "given")),
    )
    set_event(result.session, done.labels.event)
    carried = carry_corrections(session, result.session)
    status = (
        f"{done.status()}\n- graded the tile again with it in {result.seconds:.1f} s (the "
        f"overlay and table now show its grades; {carried} correction(s) carried over)"
    )
    return (
        gr.Dropdown(choices=picker_choices(ctx.models.allowed), value=path),
        card_markdown(predictor),
        status,
        str(result.overlay),
        result.summary(),
        corrected_table(result.session, result.rows),
        [str(result.vector), str(result.csv)],
        str(result.session),
        done.labels.event,
        pd.DataFrame(columns=SUGGEST_COLUMNS),
    )


def on_suggest(ctx: AppContext, model_path, session):
    """Rank the tile's uncorrected buildings to correct next."""
    import pandas as pd

    if not session:
        raise AppError("assess a tile first")
    rows = suggest_next(ctx.models.get(model_path), session, work=ctx.work)
    return pd.DataFrame(rows, columns=SUGGEST_COLUMNS)
