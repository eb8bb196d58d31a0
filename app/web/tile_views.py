"""The web app's views of an assessed tile: the pre/post slider, the map and the chosen building.

- :func:`slider_images`: the tile's pre and post images, the same size (post warped onto the pre
  grid for georeferenced tiles), for a pre/post slider (``gr.ImageSlider``).
- :func:`map_frame`: the tile's web map (:mod:`app.scoring.webmap`, written with the assessment)
  as an ``<iframe>`` for the page: the same file as ``score --map``, with the same click for a
  building's details.
- :func:`building_details`: the chosen building's row of the table, as Markdown beside its chips,
  with its corrections (every analyst's, newest first).

The map and the page talk through ``message`` events: a click on a building posts its ``#``
(:data:`MAP_JS_ON_LOAD` turns it into a ``select`` event of the map component), and choosing a
building in the table, the suggestions or the ``#`` box shows it on the map and marks its row in
the table (:data:`SHOW_JS`). Plain functions and script text, no Gradio.
"""

from __future__ import annotations

import csv
import html
import logging
import os
from pathlib import Path

import numpy as np

from app.scoring.outputs import OVERLAY_MAX_SIDE, mosaic_preview, overlay_size
from app.scoring.webmap import with_corrections
from app.web.sessions import (
    AppError,
    building_history,
    check_row,
    read_corrections_json,
    read_session,
)
from data_prep.mosaic import open_scene
from data_prep.xbd_tiles import read_tile_pair

log = logging.getLogger(__name__)

#: Side in pixels of the chosen building's chips as the page shows them (nearest-neighbour).
CHIP_VIEW_SIZE = 384
#: Height in pixels of the map in the page.
MAP_HEIGHT = 600
#: Files of the slider's images in the assessment folder.
SLIDER_FILES = ("slider_pre.jpg", "slider_post.jpg")

#: The map component's script (``js_on_load`` of ``gr.HTML``): a building clicked in the map's
#: frame becomes the component's ``select`` event, ``index`` its ``#`` and ``value`` its uid.
MAP_JS_ON_LOAD = """
window.addEventListener("message", (event) => {
  const frame = element.querySelector("iframe");
  const d = event.data;
  if (!frame || event.source !== frame.contentWindow || !d || d.localDamage !== "select") return;
  trigger("select", { index: Number(d.row), value: String(d.uid) });
});
"""

#: Runs in the page when the ``#`` box changes (``js`` of its change event; its inputs pass
#: through): shows the building on the map and marks its row in the building table.
SHOW_JS = """
(session, model, row) => {
  const n = Number(row);
  const frame = document.querySelector("#map iframe");
  if (frame && frame.contentWindow && Number.isInteger(n)) {
    frame.contentWindow.postMessage({ localDamage: "show", row: n }, "*");
  }
  // the table's rows: Gradio's virtual rows (only those in view are drawn), or a plain table's
  const ROWS = "#buildings .virtual-row, #buildings tbody:not(.sizing-body) tr";
  const mark = () => {
    document.querySelectorAll("#buildings .ld-chosen").forEach((r) => r.classList.remove("ld-chosen"));
    for (const tr of document.querySelectorAll(ROWS)) {
      const cell = tr.querySelector(".body-cell, td");
      if (cell && cell.textContent.trim() === String(n)) {
        tr.classList.add("ld-chosen");
        tr.scrollIntoView({ block: "nearest" });
        return true;
      }
    }
    return false;
  };
  if (!mark()) {  // a long table draws the rows in view only: scroll to the row, then mark it
    const first = document.querySelector(ROWS);
    const box = document.querySelector("#buildings .virtual-table-viewport");
    if (first && box) {
      box.scrollTop = Math.max(0, (n - 1) * first.getBoundingClientRect().height - 40);
      setTimeout(mark, 200);
    }
  }
  return [session, model, row];
}
"""

#: Style of the marked row of the building table (the page's ``css``).
CHOSEN_CSS = (
    "#buildings .ld-chosen .body-cell, #buildings tr.ld-chosen td"
    " { background: rgba(0, 229, 255, 0.28) !important; }"
)


def slider_images(session: str | os.PathLike) -> tuple[str, str]:
    """The pre and post images of an assessed tile for the slider, written once as JPEG in the
    assessment folder: the same size, at most :data:`OVERLAY_MAX_SIDE` pixels on the long side.
    A georeferenced tile's post image is warped onto the pre image's grid.

    Raises:
        AppError: no assessment in ``session``.
    """
    import cv2

    info = read_session(session)
    paths = [Path(session) / name for name in SLIDER_FILES]
    if all(p.is_file() for p in paths):
        return str(paths[0]), str(paths[1])
    if info["mode"] == "xbd":
        images = list(read_tile_pair(info["pre"], info["post"]))
        h, w = images[0].shape[:2]
        size = overlay_size(w, h, OVERLAY_MAX_SIDE)
        if size != (w, h):
            images = [cv2.resize(i, size, interpolation=cv2.INTER_AREA) for i in images]
    else:
        with open_scene([info["pre"]], [info["post"]]) as scene:
            grid = scene.grid
            w, h = overlay_size(grid.width, grid.height, OVERLAY_MAX_SIDE)
            images = [mosaic_preview(m, grid, w, h) for m in (scene.pre, scene.post)]
    for path, image in zip(paths, images, strict=True):
        ok, data = cv2.imencode(".jpg", cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
        if not ok:
            raise AppError(f"{path.name}: JPEG encoding failed")
        path.write_bytes(data.tobytes())
    return str(paths[0]), str(paths[1])


#: Runs in the page after a correction is saved (its inputs: the ``#`` box and the class): the
#: map shows the building in the corrected grade's colour with a dashed outline at once.
CORRECTED_JS = """
(row, grade) => {
  const frame = document.querySelector("#map iframe");
  if (frame && frame.contentWindow && Number.isInteger(Number(row))) {
    frame.contentWindow.postMessage(
      { localDamage: "corrected", row: Number(row), grade: grade, by: "you" }, "*");
  }
  return [row, grade];
}
"""


def map_frame(session: str | os.PathLike, height: int = MAP_HEIGHT) -> str:
    """The assessed tile's map file as an ``<iframe>`` (its whole document in ``srcdoc``, as the
    app serves HTML files only as downloads), with the corrections the label store holds for the
    tile's buildings (any analyst's, :func:`app.scoring.webmap.with_corrections`); a note when
    the assessment has no map."""
    info = read_session(session)
    path = Path(info.get("map") or "")
    if not info.get("map") or not path.is_file():
        return "<p>No map for this assessment.</p>"
    document = path.read_text(encoding="utf-8")
    try:
        done = read_corrections_json(session)
    except AppError as exc:  # the grades stand; the store's problem shows when saving
        log.warning("corrections not shown on the map of %s: %s", session, exc)
        done = {}
    if done:
        marks = {int(r): (e["damage"], e["analyst"]) for r, e in done.items()}
        document = with_corrections(document, marks)
    document = html.escape(document, quote=True)
    return (
        f'<iframe title="Map of the assessed tile" srcdoc="{document}" '
        f'style="width: 100%; height: {int(height)}px; border: 0;"></iframe>'
    )


def building_details(session: str | os.PathLike, row: int) -> str:
    """The chosen building's row of the table (``<scene>.csv``) as Markdown: its grade,
    confidence, probabilities, flags, status and source.

    Raises:
        AppError: no assessment in ``session`` or no such building.
    """
    info = read_session(session)
    row = check_row(info, row)
    path = Path(info.get("csv") or "")
    if not path.is_file():
        return f"**Building #{row}**"
    with open(path, newline="") as fh:
        record = next(r for k, r in enumerate(csv.DictReader(fh)) if k == row)
    grade = record.get("damage") or "not scored"
    lines = [f"**Building #{row}** (uid `{record.get('uid', '')}`): **{grade}**", ""]
    for key, value in record.items():
        if key not in ("#", "uid", "damage") and value not in ("", None):
            lines.append(f"- {key}: {_number(value)}")
    history = building_history(session, row)
    if history:
        lines += ["", f"**Corrected: {history[-1].grade}** by {history[-1].analyst}", ""]
        lines += ["| time (UTC) | analyst | grade |", "|---|---|---|"]
        lines += [f"| {c.time} | {c.analyst} | {c.grade} |" for c in reversed(history)]
    return "\n".join(lines)


def _number(value: str) -> str:
    try:
        return f"{float(value):.3f}" if "." in value else value
    except ValueError:
        return value


def enlarge(chip: np.ndarray, size: int = CHIP_VIEW_SIZE) -> np.ndarray:
    """A chip at ``size`` x ``size`` pixels, each of its pixels a square (nearest-neighbour)."""
    import cv2

    return cv2.resize(chip, (size, size), interpolation=cv2.INTER_NEAREST)
