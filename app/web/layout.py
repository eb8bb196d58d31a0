"""The web app's page: the Gradio components, section by section, with nothing wired.

Each function adds one section to the open ``gr.Blocks`` and returns its components for
:mod:`app.web.events` to wire: :func:`model_row` (title, model picker, model card),
:func:`tile_tab` (tile mode: overlay, pre/post slider, map, table, the chosen building's chips;
corrections, Adapt and Suggest) and :func:`chip_tab` (chip mode).
The ``elem_id`` of a component is what the browser test and scripts find it by.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.scoring.common import probability_columns
from app.web.assess import SUGGEST_COLUMNS, SYNTHETIC_NOTE
from app.web.callbacks import picker_choices
from app.web.tile_views import CHIP_VIEW_SIZE, MAP_HEIGHT, MAP_JS_ON_LOAD
from data_prep.spec import CLASS_NAMES

#: The title and the line under it.
TITLE = (
    "# local-damage: building damage from pre/post imagery\n"
    f"Grades each building {' / '.join(CLASS_NAMES)} with a "
    "LOCAL model on ONNX Runtime. Inputs stay on this machine."
)


def offline_theme():
    """The default Gradio theme on system fonts only (it would fetch web fonts otherwise)."""
    import gradio as gr

    return gr.themes.Default(
        font=["ui-sans-serif", "system-ui", "sans-serif"],
        font_mono=["ui-monospace", "monospace"],
    )


@dataclass
class ModelRow:
    """The model picker (a ``gr.Dropdown`` of model file paths) and the chosen model's card."""

    picker: Any
    card: Any


@dataclass
class TileTab:
    """The components of the tile mode.

    Attributes:
        pre, post, footprints: the uploaded tiles and footprints (``gr.File``).
        assess: the Assess button.
        overlay, summary, files, table: the results: overlay image, Markdown summary,
            GeoJSON/CSV files and the building table.
        slider, map: the tile's pre and post images under a slider (``gr.ImageSlider``) and its
            web map (``gr.HTML`` holding the map file in a frame; :mod:`app.web.tile_views`).
        row, show_chips, chip_pre, chip_post, details: the chosen building's ``#``, its button,
            its chips side by side and its row of the table.
        right_class, save, correct_msg, correct_file: a correction: the class, its button, the
            message and the corrections file.
        event, adapt, suggest, adapt_msg, suggestions: the event name, the Adapt and Suggest
            buttons, Adapt's report and the ranked buildings.
        cost: the false-alarm cost of the grades (``gr.Textbox``, empty: the model's own rule;
            :mod:`runtime.grading`).
    """

    pre: Any
    post: Any
    footprints: Any
    assess: Any
    overlay: Any
    summary: Any
    files: Any
    table: Any
    slider: Any
    map: Any
    row: Any
    show_chips: Any
    chip_pre: Any
    chip_post: Any
    details: Any
    right_class: Any
    save: Any
    correct_msg: Any
    correct_file: Any
    event: Any
    adapt: Any
    suggest: Any
    adapt_msg: Any
    suggestions: Any
    finetune: Any
    cost: Any


@dataclass
class ChipTab:
    """The components of the chip mode: the chips, the button, probabilities, heatmap, note."""

    pre: Any
    post: Any
    assess: Any
    probabilities: Any
    heatmap: Any
    message: Any


def model_row(choices: list[str], card: str) -> ModelRow:
    """The title, the model picker offering ``choices`` (the first chosen) and its ``card``."""
    import gradio as gr

    gr.Markdown(TITLE)
    with gr.Row():
        picker = gr.Dropdown(
            choices=picker_choices(choices),
            value=choices[0] if choices else None,
            label="Model",
            elem_id="model",
            scale=1,
        )
        card_out = gr.Markdown(card)
    return ModelRow(picker, card_out)


def tile_tab(examples: list[list[str]], finetune_note: str | None = None) -> TileTab:
    """The "Tile" tab, with the synthetic example tiles ``[[pre, post, footprints], ...]``;
    ``finetune_note``: why "Fine-tune the network" cannot be offered (None: it can)."""
    import gradio as gr

    class_names = list(CLASS_NAMES)
    with gr.Tab("Tile"):
        with gr.Row():
            pre_in = gr.File(label="Pre tile (PNG, JPEG, GeoTIFF)", elem_id="tile-pre")
            post_in = gr.File(label="Post tile", elem_id="tile-post")
            fp_in = gr.File(
                label="Footprints (xBD label JSON, GeoJSON, GeoPackage; none: detected)",
                elem_id="tile-fp",
            )
        gr.Examples(
            examples=examples,
            inputs=[pre_in, post_in, fp_in],
            label="Synthetic example tile (generated, not real imagery)",
        )
        gr.Markdown(SYNTHETIC_NOTE)
        with gr.Row():
            cost_in = gr.Textbox(
                value="",
                placeholder="the model's own rule",
                label="False-alarm cost",
                info="Grade a building damaged only where that grade is at least this many "
                "times as probable as no-damage (empty: the model's own rule, on its card; 1: the "
                "most probable grade; 3 halves the intact buildings called damaged: "
                "docs/scoring.md)",
                elem_id="false-alarm-cost",
                scale=1,
            )
            assess_btn = gr.Button("Assess", variant="primary", elem_id="assess-tile", scale=2)
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
        with gr.Row():
            slider_out = gr.ImageSlider(
                label="Pre / post: drag the slider",
                type="filepath",
                interactive=False,
                elem_id="slider",
                max_height=MAP_HEIGHT,
                scale=1,
            )
            map_out = gr.HTML(
                "",
                label="Map",
                elem_id="map",
                js_on_load=MAP_JS_ON_LOAD,
                min_height=MAP_HEIGHT // 2,
                scale=1,
            )
        table_out = gr.Dataframe(
            headers=["#", "uid", "damage", "confidence"]
            + probability_columns(class_names)
            + ["flags", "status", "source"],
            label="Buildings (click a row, or a building on the map, for its chips; click a "
            "header to sort)",
            interactive=False,
            elem_id="buildings",
            max_height=400,
        )
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=220):
                row_in = gr.Number(label="Building #", precision=0, value=None, elem_id="row")
                chips_btn = gr.Button("Show chips")
                details_out = gr.Markdown(elem_id="bldg-details")
            chip_pre_out = gr.Image(
                label="Pre chip", interactive=False, height=CHIP_VIEW_SIZE, elem_id="bldg-pre",
                scale=2,
            )  # fmt: skip
            chip_post_out = gr.Image(
                label="Post chip", interactive=False, height=CHIP_VIEW_SIZE, elem_id="bldg-post",
                scale=2,
            )  # fmt: skip
        with gr.Row():
            correct_in = gr.Dropdown(
                class_names, value=class_names[0], label="Right class", elem_id="right-class"
            )
            correct_btn = gr.Button("Save correction", elem_id="save-correction")
            correct_msg = gr.Markdown(elem_id="correct-msg")
            correct_file = gr.File(label="This tile's corrections as a label file (for prepare)")
        with gr.Row():
            event_in = gr.Textbox(
                label="Event (Adapt pools the corrections of all its tiles)",
                elem_id="event",
                max_lines=1,
                scale=2,
            )
            adapt_btn = gr.Button("Adapt", elem_id="adapt", scale=1)
            finetune_in = gr.Checkbox(
                label="Fine-tune the network (PyTorch; about a minute)",
                info=finetune_note
                or "Adapt fine-tunes the last block and the classifier instead of the head",
                value=False,
                interactive=finetune_note is None,
                elem_id="finetune",
                scale=1,
            )
            suggest_btn = gr.Button("Suggest next", elem_id="suggest", scale=1)
        adapt_msg = gr.Markdown(elem_id="adapt-status")
        suggest_out = gr.Dataframe(
            headers=SUGGEST_COLUMNS,
            label="Buildings to correct next, most useful first (click one for its chips)",
            interactive=False,
            elem_id="suggestions",
            max_height=300,
        )
    return TileTab(
        pre_in,
        post_in,
        fp_in,
        assess_btn,
        overlay_out,
        summary_out,
        files_out,
        table_out,
        slider_out,
        map_out,
        row_in,
        chips_btn,
        chip_pre_out,
        chip_post_out,
        details_out,
        correct_in,
        correct_btn,
        correct_msg,
        correct_file,
        event_in,
        adapt_btn,
        suggest_btn,
        adapt_msg,
        suggest_out,
        finetune_in,
        cost_in,
    )


def chip_tab(examples: list[list[str]]) -> ChipTab:
    """The "Chip" tab, with the synthetic example chip pairs ``[[pre, post], ...]`` (if any)."""
    import gradio as gr

    with gr.Tab("Chip"):
        with gr.Row():
            cpre_in = gr.Image(label="Pre chip", type="filepath", elem_id="chip-pre")
            cpost_in = gr.Image(label="Post chip", type="filepath", elem_id="chip-post")
        if examples:
            gr.Examples(
                examples=examples,
                inputs=[cpre_in, cpost_in],
                label="Synthetic example chips (generated, not real imagery)",
            )
        chip_btn = gr.Button("Assess chip", variant="primary", elem_id="assess-chip")
        with gr.Row():
            probs_out = gr.Label(label="Class probabilities", num_top_classes=len(CLASS_NAMES))
            heat_out = gr.Image(label="Where the model saw change", interactive=False)
        chip_msg = gr.Markdown()
    return ChipTab(cpre_in, cpost_in, chip_btn, probs_out, heat_out, chip_msg)
