"""The Gradio web app for analysts (`local-damage app`), on ONNX Runtime only (no torch).

Two modes, each a plain function first (:mod:`app.web.assess`) and a Gradio event (and HTTP API
endpoint) second:

- tile mode, :func:`app.web.assess.assess_tile`: a pre and a post tile and building footprints (or
  none: the localiser finds the buildings), graded by the same pipeline as `local-damage score`:
  the overlay, counts per class, the building table and the results as files;
  :func:`app.web.assess.building_chips` shows one building's chips; :func:`save_correction` records
  the class an analyst sets for a building (:mod:`app.web.sessions`). "Adapt" adapts the chosen
  model to the corrections of the tile's event and grades the tile again with it; "Suggest next"
  ranks the tile's uncorrected buildings to correct (:mod:`app.web.adapt_panel`).
- chip mode, :func:`app.web.assess.assess_chip`: one pre/post chip pair: class probabilities and a
  heatmap of the latent feature-correlation map over the post chip.

:func:`build_app` assembles the Blocks UI (model picker with model cards, both modes, synthetic
examples, corrections, Adapt and Suggest) and :func:`launch` serves it: on 127.0.0.1 unless told
otherwise, no public share link, optional username/password, an upload size limit and a request
queue with a concurrency limit. Bad input gives a clear message in the UI and the app keeps serving.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

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
    ChipResult,
    TileResult,
    app_max_pixels,
    assess_chip,
    assess_tile,
    building_chips,
    check_image,
    footprint_kind,
    heatmap_overlay,
    read_chip_pair,
)
from app.web.model_card import card_markdown
from app.web.sessions import (
    AppError,
    carry_corrections,
    read_session,
    save_correction,
    session_event,
    set_event,
)

if TYPE_CHECKING:
    from runtime.predictor import Predictor

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
    "build_app",
    "card_markdown",
    "launch",
    "make_examples",
    "model_choices",
    "save_correction",
]


def model_choices(
    models_dir: str | os.PathLike = "models",
    extra: str | None = None,
    work_dir: str | os.PathLike | None = None,
) -> list[str]:
    """Model files the picker offers: ``extra`` (``--model``) first, then ``models_dir/*.onnx``,
    then the models adapted in the app (``work_dir/models/*.onnx``, when ``work_dir`` is given)."""
    from app.web.adapt_panel import MODELS_FOLDER
    from runtime.registry import list_models

    paths = [str(Path(extra).resolve())] if extra else []
    folders = [Path(models_dir)] + ([Path(work_dir) / MODELS_FOLDER] if work_dir else [])
    for p in (p for folder in folders for p in list_models(folder)):
        if str(p.resolve()) not in paths:
            paths.append(str(p.resolve()))
    return paths


class ModelCache:
    """Loaded predictors by path, restricted to the offered model files (thread safe)."""

    def __init__(self, allowed: list[str]) -> None:
        self.allowed = list(allowed)
        self._loaded: dict[str, Predictor] = {}
        self._lock = threading.Lock()

    def add(self, path: str | os.PathLike) -> str:
        """Offer one more model file (e.g. a model adapted in the app); returns its path."""
        path = str(Path(path).resolve())
        with self._lock:
            if path not in self.allowed:
                self.allowed.append(path)
        return path

    def get(self, path: str | None) -> Predictor:
        """The predictor of an offered model file.

        Raises:
            AppError: no model chosen, a path that is not offered, or not a valid model.
        """
        from runtime.contract import ModelError
        from runtime.predictor import Predictor

        if not path:
            raise AppError("no model chosen; put .onnx files in models/ or start with --model")
        if path not in self.allowed:
            raise AppError(f"model {Path(path).name} is not one of the models this app offers")
        with self._lock:
            if path not in self._loaded:
                try:
                    predictor = Predictor(path)
                except ModelError as exc:
                    raise AppError(f"model {Path(path).name}: {exc}") from exc
                # one warm-up run, so that the first analyst does not wait for it
                chip = np.zeros((1, predictor.input_size, predictor.input_size, 3), np.uint8)
                predictor.predict(chip, chip)
                self._loaded[path] = predictor
            return self._loaded[path]


def make_examples(folder: str | os.PathLike, seed: int = 0) -> dict[str, list[list[str]]]:
    """Write synthetic examples (one xBD-format tile and two chip pairs) into ``folder``.

    Returns:
        ``{"tile": [[pre, post, label_json]], "chip": [[pre, post], ...]}`` file paths.
    """
    import cv2

    from data_prep.report import PrepareReport
    from data_prep.spec import ChipSpec
    from data_prep.synthetic import make_xbd, tile_name
    from data_prep.windows import chip_window, cut_chip
    from data_prep.xbd import parse_buildings, read_tile_image

    folder = Path(folder)
    make_xbd(folder, seed=seed, n_tiles=1)
    name = tile_name(0)
    pre = next((folder / "images").glob(f"{name}_pre_disaster.*"))
    post = next((folder / "images").glob(f"{name}_post_disaster.*"))
    label = folder / "labels" / f"{name}_post_disaster.json"
    _, buildings = parse_buildings(label, PrepareReport())
    spec = ChipSpec()
    images = [read_tile_image(pre), read_tile_image(post)]
    chips = []
    for wanted in (0, 3):  # an intact and a destroyed building
        b = next((b for b in buildings if b.label == wanted), None)
        if b is None:
            continue
        window = chip_window(b.centroid, b.bbox, spec)
        pair = []
        for phase, image in zip(("pre", "post"), images, strict=True):
            chip = cut_chip(image, window, spec.chip_size)
            path = folder / "chips" / f"{b.uid[:8]}_{phase}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            cv2.imwrite(str(path), cv2.cvtColor(chip, cv2.COLOR_RGB2BGR))
            pair.append(str(path))
        chips.append(pair)
    return {"tile": [[str(pre), str(post), str(label)]], "chip": chips}


# --------------------------------------------------------------------------------------------
# The UI


def _offline_theme():
    import gradio as gr

    # system fonts only: the default theme would fetch web fonts from the internet
    return gr.themes.Default(
        font=["ui-sans-serif", "system-ui", "sans-serif"],
        font_mono=["ui-monospace", "monospace"],
    )


def build_app(
    models_dir: str | os.PathLike = "models",
    model: str | None = None,
    work_dir: str | os.PathLike | None = None,
    max_pixels: int | None = None,
):
    """Build the Gradio Blocks app.

    Args:
        models_dir: folder whose ``*.onnx`` files the model picker offers.
        model: a model file offered first and chosen by default (``--model``).
        work_dir: where each assessment gets its output folder (``work_dir/sessions``) and the
            models adapted in the app go (``work_dir/models``, offered in the picker too); default:
            a new temporary folder.
        max_pixels: pixel limit per uploaded image (default :func:`app_max_pixels`).

    Returns:
        ``(blocks, allowed_paths)``: the ``gr.Blocks`` and the folders it serves files from.
    """
    import gradio as gr
    import pandas as pd

    from app.scoring import detect
    from app.web import adapt_panel as web_adapt

    work = Path(work_dir or tempfile.mkdtemp(prefix="local-damage-app-"))
    work.mkdir(parents=True, exist_ok=True)
    choices = model_choices(models_dir, model, work)
    models = ModelCache(choices)
    examples = make_examples(work / "examples")
    import pyogrio  # noqa: F401  (imported now rather than during the first assessment)

    counter = {"n": 0}
    counter_lock = threading.Lock()

    def new_session() -> Path:
        with counter_lock:
            counter["n"] += 1
            n = counter["n"]
        return work / "sessions" / f"{time.strftime('%Y%m%d-%H%M%S')}-{n:04d}"

    def fail(exc: Exception):
        return gr.Error(str(exc), print_exception=False)

    def _path(f) -> str | None:
        if f is None:
            return None
        return f if isinstance(f, str) else getattr(f, "name", None) or str(f)

    def on_model(path):
        try:
            return card_markdown(models.get(path))
        except AppError as exc:
            return f"**Model not usable:** {exc}"

    def on_assess_tile(model_path, pre, post, footprints):
        """Grade every building of a pre/post tile pair (xBD label JSON, GeoJSON or GeoPackage
        footprints); returns the overlay PNG, a Markdown summary, the building table, the
        GeoJSON/CSV files and the session folder."""
        missing = [n for n, f in (("pre", pre), ("post", post)) if not f]
        if missing:
            raise gr.Error(f"upload the {', '.join(missing)} file(s) first", print_exception=False)
        try:
            predictor = models.get(model_path)
            result = assess_tile(
                predictor,
                _path(pre),
                _path(post),
                _path(footprints),
                new_session(),
                max_pixels=max_pixels,
                localizer=None if footprints else detect.app_localizer(models_dir),
            )
        except AppError as exc:
            raise fail(exc) from exc
        table = pd.DataFrame(result.rows)
        return (
            str(result.overlay),
            result.summary(),
            table,
            [str(result.vector), str(result.csv)],
            str(result.session),
        )

    def on_assess_chip(model_path, pre, post):
        """Grade one pre/post chip pair; returns class probabilities and the change heatmap."""
        if not pre or not post:
            raise gr.Error("upload both the pre and the post chip first", print_exception=False)
        try:
            predictor = models.get(model_path)
            result = assess_chip(predictor, _path(pre), _path(post))
        except AppError as exc:
            raise fail(exc) from exc
        note = (
            "Heatmap: the latent feature-correlation map (channel-averaged pre/post feature "
            "difference), red where the model saw most change."
            if result.change_map is not None
            else "This model was exported without `--change-map`; showing the post chip only."
        )
        return result.probabilities, result.heatmap, f"**{result.damage}**. {note}"

    def on_select(session, model_path, evt: gr.SelectData):
        row_value = getattr(evt, "row_value", None)
        row = int(row_value[0]) if row_value else int(evt.index[0])
        return (row, *on_chips(session, model_path, row))

    def on_pick(session, model_path, table, evt: gr.SelectData):
        """A suggested building clicked: select it in the building table and show its chips."""
        row_value = getattr(evt, "row_value", None)
        if not row_value:
            row_value = table.iloc[int(evt.index[0])].tolist()
        row = int(row_value[SUGGEST_COLUMNS.index("#")])
        return (row, *on_chips(session, model_path, row))

    # the type hint tells Gradio to pass the selection; set as an object, since this module's
    # annotations are strings and gradio is imported only here
    on_select.__annotations__["evt"] = gr.SelectData
    on_pick.__annotations__["evt"] = gr.SelectData

    def on_chips(session, model_path, row):
        if not session:
            raise gr.Error("assess a tile first", print_exception=False)
        try:
            pre, post = building_chips(models.get(model_path), session, int(row))
        except (AppError, ValueError, TypeError) as exc:
            raise fail(exc) from exc
        import cv2

        size = (DISPLAY_SIZE, DISPLAY_SIZE)
        return (
            cv2.resize(pre, size, interpolation=cv2.INTER_NEAREST),
            cv2.resize(post, size, interpolation=cv2.INTER_NEAREST),
        )

    def on_correct(session, row, damage):
        if not session:
            raise gr.Error("assess a tile first", print_exception=False)
        try:
            path = save_correction(session, int(row), damage)
        except (AppError, ValueError, TypeError) as exc:
            raise fail(exc) from exc
        return f"Saved: building #{int(row)} is **{damage}** in `{path}`", str(path)

    def on_assessed(session):
        """After an assessment: its event in the Event box, no suggestions yet."""
        return session_event(session), pd.DataFrame(columns=SUGGEST_COLUMNS)

    def on_adapt(model_path, session, event):
        """Adapt the chosen model to the corrections of the tile's event, offer and choose the
        adapted model, and grade the tile again with it."""
        if not session:
            raise gr.Error("assess a tile and correct a few buildings first", print_exception=False)
        try:
            done = web_adapt.adapt_to_event(models.get(model_path), work, session, event)
            path = models.add(done.model)
            predictor = models.get(path)
            info = read_session(session)
            result = assess_tile(
                predictor,
                info["pre"],
                info["post"],
                info["footprints"],
                new_session(),
                max_pixels=max_pixels,
                source=info.get("source", "given"),
            )
            set_event(result.session, done.labels.event)
            carried = carry_corrections(session, result.session)
        except (AppError, ValueError, OSError) as exc:
            raise fail(exc) from exc
        status = (
            f"{done.status()}\n- graded the tile again with it in {result.seconds:.1f} s (the "
            f"overlay and table now show its grades; {carried} correction(s) carried over)"
        )
        return (
            gr.Dropdown(choices=[(Path(c).name, c) for c in models.allowed], value=path),
            card_markdown(predictor),
            status,
            str(result.overlay),
            result.summary(),
            pd.DataFrame(result.rows),
            [str(result.vector), str(result.csv)],
            str(result.session),
            done.labels.event,
            pd.DataFrame(columns=SUGGEST_COLUMNS),
        )

    def on_suggest(model_path, session):
        """Rank the tile's uncorrected buildings to correct next."""
        if not session:
            raise gr.Error("assess a tile first", print_exception=False)
        try:
            rows = web_adapt.suggest_next(models.get(model_path), session, work=work)
        except (AppError, ValueError, OSError) as exc:
            raise fail(exc) from exc
        return pd.DataFrame(rows, columns=SUGGEST_COLUMNS)

    class_names = ["no-damage", "minor-damage", "major-damage", "destroyed"]
    with gr.Blocks(title="local-damage", analytics_enabled=False) as demo:
        gr.Markdown(
            "# local-damage: building damage from pre/post imagery\n"
            "Grades each building no-damage / minor-damage / major-damage / destroyed with a "
            "LOCAL model on ONNX Runtime. Inputs stay on this machine."
        )
        with gr.Row():
            model_in = gr.Dropdown(
                choices=[(Path(c).name, c) for c in choices],
                value=choices[0] if choices else None,
                label="Model",
                elem_id="model",
                scale=1,
            )
            card = gr.Markdown(on_model(choices[0]) if choices else "No model found.")
        model_in.change(on_model, model_in, card, api_visibility="private")
        # a page opened later offers the models adapted since the app started too
        demo.load(
            lambda: gr.Dropdown(choices=[(Path(c).name, c) for c in models.allowed]),
            None,
            model_in,
            api_visibility="private",
        )
        session = gr.State(None)

        with gr.Tab("Tile"):
            with gr.Row():
                pre_in = gr.File(label="Pre tile (PNG, JPEG, GeoTIFF)", elem_id="tile-pre")
                post_in = gr.File(label="Post tile", elem_id="tile-post")
                fp_in = gr.File(
                    label="Footprints (xBD label JSON, GeoJSON, GeoPackage; none: detected)",
                    elem_id="tile-fp",
                )
            gr.Examples(
                examples=examples["tile"],
                inputs=[pre_in, post_in, fp_in],
                label="Synthetic example tile (generated, not real imagery)",
            )
            gr.Markdown(SYNTHETIC_NOTE)
            assess_btn = gr.Button("Assess", variant="primary", elem_id="assess-tile")
            with gr.Row():
                overlay_out = gr.Image(
                    label="Post tile, buildings by predicted class",
                    type="filepath",
                    elem_id="overlay",
                    interactive=False,
                    scale=2,
                )
                with gr.Column(scale=1):
                    summary_out = gr.Markdown(elem_id="summary")
                    files_out = gr.File(label="Download (GeoJSON, CSV)", file_count="multiple")
            from app.scoring.scene import probability_columns

            table_out = gr.Dataframe(
                headers=["#", "uid", "damage", "confidence"]
                + probability_columns(class_names)
                + ["flags", "status"],
                label="Buildings (click a row for its chips; click a header to sort)",
                interactive=False,
                elem_id="buildings",
                max_height=400,
            )
            with gr.Row():
                row_in = gr.Number(label="Building #", precision=0, value=0, elem_id="row")
                chips_btn = gr.Button("Show chips")
                chip_pre_out = gr.Image(
                    label="Pre chip", interactive=False, height=DISPLAY_SIZE, elem_id="bldg-pre"
                )
                chip_post_out = gr.Image(
                    label="Post chip", interactive=False, height=DISPLAY_SIZE, elem_id="bldg-post"
                )
            with gr.Row():
                correct_in = gr.Dropdown(
                    class_names, value=class_names[0], label="Right class", elem_id="right-class"
                )
                correct_btn = gr.Button("Save correction", elem_id="save-correction")
                correct_msg = gr.Markdown(elem_id="correct-msg")
                correct_file = gr.File(label="Corrections file")
            with gr.Row():
                event_in = gr.Textbox(
                    label="Event (Adapt pools the corrections of all its tiles)",
                    elem_id="event",
                    max_lines=1,
                    scale=2,
                )
                adapt_btn = gr.Button("Adapt", elem_id="adapt", scale=1)
                suggest_btn = gr.Button("Suggest next", elem_id="suggest", scale=1)
            adapt_msg = gr.Markdown(elem_id="adapt-status")
            suggest_out = gr.Dataframe(
                headers=SUGGEST_COLUMNS,
                label="Buildings to correct next, most useful first (click one for its chips)",
                interactive=False,
                elem_id="suggestions",
                max_height=300,
            )

        with gr.Tab("Chip"):
            with gr.Row():
                cpre_in = gr.Image(label="Pre chip", type="filepath", elem_id="chip-pre")
                cpost_in = gr.Image(label="Post chip", type="filepath", elem_id="chip-post")
            if examples["chip"]:
                gr.Examples(
                    examples=examples["chip"],
                    inputs=[cpre_in, cpost_in],
                    label="Synthetic example chips (generated, not real imagery)",
                )
            chip_btn = gr.Button("Assess chip", variant="primary", elem_id="assess-chip")
            with gr.Row():
                probs_out = gr.Label(label="Class probabilities", num_top_classes=4)
                heat_out = gr.Image(label="Where the model saw change", interactive=False)
            chip_msg = gr.Markdown()

        assess_btn.click(
            on_assess_tile,
            [model_in, pre_in, post_in, fp_in],
            [overlay_out, summary_out, table_out, files_out, session],
            api_name="assess_tile",
        ).success(on_assessed, session, [event_in, suggest_out], api_visibility="private")
        chip_btn.click(
            on_assess_chip,
            [model_in, cpre_in, cpost_in],
            [probs_out, heat_out, chip_msg],
            api_name="assess_chip",
        )
        table_out.select(
            on_select,
            [session, model_in],
            [row_in, chip_pre_out, chip_post_out],
            api_visibility="private",
        )
        chips_btn.click(
            on_chips,
            [session, model_in, row_in],
            [chip_pre_out, chip_post_out],
            api_visibility="private",
        )
        correct_btn.click(
            on_correct,
            [session, row_in, correct_in],
            [correct_msg, correct_file],
            api_visibility="private",
        )
        adapt_btn.click(
            on_adapt,
            [model_in, session, event_in],
            [
                model_in,
                card,
                adapt_msg,
                overlay_out,
                summary_out,
                table_out,
                files_out,
                session,
                event_in,
                suggest_out,
            ],
            api_visibility="private",
        )
        suggest_btn.click(on_suggest, [model_in, session], suggest_out, api_visibility="private")
        suggest_out.select(
            on_pick,
            [session, model_in, suggest_out],
            [row_in, chip_pre_out, chip_post_out],
            api_visibility="private",
        )
    demo.queue(default_concurrency_limit=CONCURRENCY_LIMIT, max_size=QUEUE_SIZE)
    return demo, [str(work)]


def launch(
    models_dir: str | os.PathLike = "models",
    model: str | None = None,
    host: str = "127.0.0.1",
    port: int = 7860,
    auth: tuple[str, str] | None = None,
    work_dir: str | os.PathLike | None = None,
    block: bool = True,
    max_pixels: int | None = None,
):
    """Build and serve the app (no share link, upload limit, queue).

    Args:
        models_dir, model, work_dir, max_pixels: see :func:`build_app`.
        host: interface to bind (127.0.0.1: this machine only).
        port: TCP port.
        auth: optional ``(username, password)``.
        block: wait until interrupted; False returns at once (the server keeps running in a
            thread; close it with ``blocks.close()``).

    Returns:
        The ``gr.Blocks`` (when ``block`` is False).
    """
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    demo, allowed = build_app(models_dir, model, work_dir, max_pixels)
    demo.launch(
        server_name=host,
        server_port=port,
        share=False,
        auth=auth,
        max_file_size=MAX_FILE_SIZE,
        allowed_paths=allowed,
        prevent_thread_lock=not block,
        theme=_offline_theme(),
        ssr_mode=False,
        quiet=not block,
        show_error=True,
    )
    return demo
