"""The web app's wiring: which event of :mod:`app.web.layout` calls which function of
:mod:`app.web.callbacks`, with which components as inputs and outputs.

Three events are the app's HTTP API (``/assess_tile``, ``/assess_chip`` and
``/save_correction``, e.g. for ``gradio_client``, which keeps a client's assessment between its
calls); the others are private to the page.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from app.web import callbacks as cb
from app.web.callbacks import AppContext
from app.web.layout import ChipTab, ModelRow, TileTab
from app.web.sessions import AppError
from app.web.tile_views import CORRECTED_JS, SHOW_JS

#: What a building's chips and a correction show as a message (a bad row number included).
ROW_ERRORS = (AppError, ValueError, TypeError)
#: What Adapt and Suggest show as a message (an unreadable file included).
ADAPT_ERRORS = (AppError, ValueError, OSError)


def bind(fn: Callable, *bound: Any, errors: tuple[type[Exception], ...] = (AppError,)) -> Callable:
    """``fn`` as a Gradio event function: its first arguments ``bound``, the event's inputs the
    rest, its ``errors`` shown to the analyst as a message (``gr.Error``).

    The function keeps ``fn``'s name (the event's name in the app's API) and the signature of its
    remaining parameters; a parameter named ``evt`` receives Gradio's ``SelectData``.
    """
    import gradio as gr

    params = list(inspect.signature(fn).parameters.values())[len(bound) :]

    def event(*inputs):
        try:
            return fn(*bound, *inputs)
        except errors as exc:
            raise gr.Error(str(exc), print_exception=False) from exc

    event.__name__ = event.__qualname__ = fn.__name__
    event.__doc__ = fn.__doc__
    event.__signature__ = inspect.Signature(params)
    # Gradio passes the selection (the request) to a parameter annotated with the class itself
    kinds = {"evt": gr.SelectData, "request": gr.Request}
    event.__annotations__ = {p.name: kinds[p.name] for p in params if p.name in kinds}
    return event


def connect_models(demo, ctx: AppContext, models: ModelRow) -> None:
    """The model picker shows the chosen model's card; a page opened later offers the models
    adapted since the app started too."""
    models.picker.change(
        bind(cb.on_model, ctx), models.picker, models.card, api_visibility="private"
    )
    demo.load(lambda: cb.offered_models(ctx), None, models.picker, api_visibility="private")


def connect_tabs(ctx: AppContext, models: ModelRow, session, tile: TileTab, chip: ChipTab) -> None:
    """The events of both modes; ``session`` is the ``gr.State`` holding the assessment folder."""
    model = models.picker
    building = [tile.chip_pre, tile.chip_post, tile.details]
    views = [tile.slider, tile.map]
    assessed = tile.assess.click(
        bind(cb.on_assess_tile, ctx),
        [model, tile.pre, tile.post, tile.footprints, tile.cost],
        [tile.overlay, tile.summary, tile.table, tile.files, session],
        api_name="assess_tile",
    )
    assessed.success(
        cb.on_assessed, session, [tile.event, tile.suggestions], api_visibility="private"
    )
    assessed.success(cb.on_views, session, views, api_visibility="private")
    # a new tile: no building chosen yet (so choosing any #, 0 included, shows it)
    assessed.success(cb.no_building, None, tile.row, api_visibility="private")
    chip.assess.click(
        bind(cb.on_assess_chip, ctx),
        [model, chip.pre, chip.post],
        [chip.probabilities, chip.heatmap, chip.message],
        api_name="assess_chip",
    )
    # one building chosen in the table, the suggestions, the map or the # box: its chips and row
    # beside them, and (in the page) the same building shown on the map and marked in the table
    tile.table.select(bind(cb.on_select), None, tile.row, api_visibility="private")
    tile.map.select(bind(cb.on_map_pick), None, tile.row, api_visibility="private")
    tile.suggestions.select(bind(cb.on_pick), tile.suggestions, tile.row, api_visibility="private")
    tile.row.change(
        bind(cb.on_building, ctx, errors=ROW_ERRORS),
        [session, model, tile.row],
        building,
        js=SHOW_JS,
        api_visibility="private",
    )
    tile.show_chips.click(
        bind(cb.on_chips, ctx, errors=ROW_ERRORS),
        [session, model, tile.row],
        building[:2],
        api_visibility="private",
    )
    saved = tile.save.click(
        bind(cb.on_correct, errors=ROW_ERRORS),
        [session, tile.row, tile.right_class],
        [tile.correct_msg, tile.correct_file],
        api_name="save_correction",
    )
    saved.success(
        bind(cb.on_corrected), [session, tile.row], [tile.table, tile.details],
        api_visibility="private",
    )  # fmt: skip
    saved.success(None, [tile.row, tile.right_class], None, js=CORRECTED_JS,
                  api_visibility="private")  # fmt: skip
    adapted = tile.adapt.click(
        bind(cb.on_adapt, ctx, errors=ADAPT_ERRORS),
        [model, session, tile.event, tile.finetune],
        [
            model,
            models.card,
            tile.adapt_msg,
            tile.overlay,
            tile.summary,
            tile.table,
            tile.files,
            session,
            tile.event,
            tile.suggestions,
        ],
        api_visibility="private",
    )
    adapted.success(cb.on_views, session, views, api_visibility="private")
    tile.suggest.click(
        bind(cb.on_suggest, ctx, errors=ADAPT_ERRORS),
        [model, session],
        tile.suggestions,
        api_visibility="private",
    )
