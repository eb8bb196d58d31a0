"""The Gradio web app for analysts (`local-damage app`), on ONNX Runtime only (no torch).

Two modes, each a plain function first (:mod:`app.web.assess`) and a Gradio event (and HTTP API
endpoint) second:

- tile mode, :func:`app.web.assess.assess_tile`: a pre and a post tile and building footprints (or
  none: the localiser finds the buildings), graded by the same pipeline as `local-damage score`:
  the overlay, counts per class, the building table and the results as files, then the tile's
  pre and post images under a slider and its web map (:mod:`app.web.tile_views`);
  :func:`app.web.assess.building_chips` shows the chips of the building chosen in the table or
  on the map, which both show it; :func:`save_correction` records
  the class an analyst sets for a building (:mod:`app.web.sessions`). "Adapt" adapts the chosen
  model to the corrections of the tile's event and grades the tile again with it; "Suggest next"
  ranks the tile's uncorrected buildings to correct (:mod:`app.web.adapt_panel`).
- chip mode, :func:`app.web.chip.assess_chip`: one pre/post chip pair: class probabilities and a
  heatmap of the latent feature-correlation map over the post chip.

:func:`build_app` composes the app: the models on offer (:mod:`app.web.model_picker`), the
synthetic examples (:mod:`app.web.examples`), the page (:mod:`app.web.layout`: model picker with
model cards, both modes, corrections, Adapt and Suggest) and its events (:mod:`app.web.events`),
which call plain functions (:mod:`app.web.callbacks`); the model card is :mod:`app.web.model_card`.
:func:`launch` serves it: on 127.0.0.1 unless told otherwise, a public share link only when
asked (``local-damage app --share``), optional username/password, an upload size limit and a
request queue with a concurrency limit; Gradio's own console hints (written for Python
callers of ``launch()``) are left out, the command prints its own. Bad input
gives a clear message in the UI and the app keeps serving.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app.web import events, layout
from app.web.adapt_panel import FINETUNE_INSTALL
from app.web.assess import (
    CONCURRENCY_LIMIT,
    DISPLAY_SIZE,
    FOOTPRINT_SUFFIXES,
    IMAGE_SUFFIXES,
    MAX_FILE_SIZE,
    MAX_PIXELS,
    QUEUE_SIZE,
    SUGGEST_COLUMNS,
    SYNTHETIC_NOTE,
    TileOptions,
    TileResult,
    app_max_pixels,
    assess_tile,
    building_chips,
    check_image,
    footprint_kind,
)
from app.web.callbacks import AppContext, on_model
from app.web.chip import ChipResult, assess_chip, heatmap_overlay, read_chip_pair
from app.web.examples import make_examples
from app.web.model_card import card_markdown
from app.web.model_picker import ModelCache, model_choices
from app.web.sessions import AppError, import_work, save_correction
from app.web.tile_views import CHOSEN_CSS

#: The app's public names, the tile and chip functions of :mod:`app.web.assess` included.
__all__ = [
    "CONCURRENCY_LIMIT",
    "ChipResult",
    "DISPLAY_SIZE",
    "FOOTPRINT_SUFFIXES",
    "IMAGE_SUFFIXES",
    "MAX_FILE_SIZE",
    "MAX_PIXELS",
    "QUEUE_SIZE",
    "SUGGEST_COLUMNS",
    "SYNTHETIC_NOTE",
    "TileOptions",
    "TileResult",
    "app_max_pixels",
    "assess_chip",
    "assess_tile",
    "building_chips",
    "check_image",
    "footprint_kind",
    "heatmap_overlay",
    "read_chip_pair",
    "AppError",
    "ModelCache",
    "ServeOptions",
    "build_app",
    "card_markdown",
    "launch",
    "make_examples",
    "model_choices",
    "save_correction",
]


def build_app(
    models_dir: str | os.PathLike = "models",
    model: str | None = None,
    work_dir: str | os.PathLike | None = None,
    max_pixels: int | None = None,
    finetuner=None,
):
    """Build the Gradio Blocks app.

    Args:
        models_dir: folder whose ``*.onnx`` files the model picker offers.
        model: a model file offered first and chosen by default (``--model``).
        work_dir: where each assessment gets its output folder (``work_dir/sessions``) and the
            models adapted in the app go (``work_dir/models``, offered in the picker too); default:
            a new temporary folder.
        max_pixels: pixel limit per uploaded image (default :func:`app_max_pixels`).
        finetuner: what Adapt runs with "Fine-tune the network" ticked (``local-damage app``
            passes ``cli.adapt.finetune_model`` when PyTorch is installed); None: the box is
            greyed out and says how to install PyTorch.

    Returns:
        ``(blocks, allowed_paths)``: the ``gr.Blocks`` and the folders it serves files from.
    """
    import gradio as gr

    work = Path(work_dir or tempfile.mkdtemp(prefix="local-damage-app-"))
    work.mkdir(parents=True, exist_ok=True)
    import_work(work)  # assessments kept before the label store: their corrections.json, once
    choices = model_choices(models_dir, model, work)
    ctx = AppContext(ModelCache(choices), work, models_dir, max_pixels, finetuner)
    examples = make_examples(work / "examples")
    import pyogrio  # noqa: F401  (imported now rather than during the first assessment)

    card = on_model(ctx, choices[0]) if choices else "No model found."
    with gr.Blocks(title="local-damage", analytics_enabled=False) as demo:
        models = layout.model_row(choices, card)
        events.connect_models(demo, ctx, models)
        session = gr.State(None)
        tile = layout.tile_tab(examples["tile"], None if finetuner else FINETUNE_INSTALL)
        chip = layout.chip_tab(examples["chip"])
        events.connect_tabs(ctx, models, session, tile, chip)
    demo.queue(default_concurrency_limit=CONCURRENCY_LIMIT, max_size=QUEUE_SIZE)
    return demo, [str(work)]


@dataclass(frozen=True)
class ServeOptions:
    """How :func:`launch` serves the app.

    Attributes:
        host: interface to bind (127.0.0.1: this machine only).
        port: TCP port.
        auth: optional ``(username, password)`` (one login), or a callable
            ``(username, password) -> bool`` such as :class:`app.web.users.Users` (a users
            file: each analyst logs in by name, and each correction records who made it).
        block: wait until interrupted; False returns at once (the server keeps running in a
            thread; close it with ``blocks.close()``).
        share: also serve it on a temporary public link through Gradio's share server (Gradio
            prints the link).
    """

    host: str = "127.0.0.1"
    port: int = 7860
    auth: tuple[str, str] | Callable[[str, str], bool] | None = None
    block: bool = True
    share: bool = False


def launch(
    models_dir: str | os.PathLike = "models",
    model: str | None = None,
    work_dir: str | os.PathLike | None = None,
    max_pixels: int | None = None,
    finetuner=None,
    serve: ServeOptions | None = None,
):
    """Build and serve the app (upload limit, queue; a share link only with ``serve.share``).

    Args:
        models_dir, model, work_dir, max_pixels, finetuner: see :func:`build_app`.
        serve: host, port, login, blocking and share link (:class:`ServeOptions`; default: its
            defaults, on 127.0.0.1:7860 until interrupted).

    Returns:
        The ``gr.Blocks`` (when ``serve.block`` is False).
    """
    serve = serve or ServeOptions()
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    demo, allowed = build_app(models_dir, model, work_dir, max_pixels, finetuner)
    demo.launch(
        server_name=serve.host,
        server_port=serve.port,
        share=serve.share,
        auth=serve.auth,
        max_file_size=MAX_FILE_SIZE,
        allowed_paths=allowed,
        prevent_thread_lock=not serve.block,
        theme=layout.offline_theme(),
        css=CHOSEN_CSS,
        ssr_mode=False,
        quiet=True,  # Gradio's hints speak of launch() arguments; the command prints its own
        show_error=True,
    )
    return demo
