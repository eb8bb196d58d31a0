"""Labelled buildings from the analysts' corrections (the web app's label store).

- :func:`from_corrections`: the buildings corrected in one assessment of the app (its
  ``session.json`` folder), with their latest grades from the work folder's label store
  (:mod:`data_prep.label_store`; see :func:`app.web.sessions.save_correction`).
- :func:`from_session`: every building of an assessed tile, the corrected ones labelled.
- :func:`from_store`: every corrected building of a label store (``WORK/labels.gpkg``), or of
  one event of it, each once with its latest grade.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from app.adapt.labelled import (
    Buildings,
    LabelError,
    ReadOptions,
    class_id,
    concat,
    from_scene,
    from_xbd,
)
from data_prep.label_store import LabelStore, StoreError, store_for
from data_prep.spec import ChipSpec


def session_folder(path: str | os.PathLike) -> Path:
    """The assessment folder (holding ``session.json``) of a corrections path: the folder
    itself, its ``corrections.json``, or any file under its ``corrections/`` folder.

    Raises:
        LabelError: the path does not exist or belongs to no assessment.
    """
    path = Path(path)
    if path.name == "corrections.json" and (path.parent / "session.json").is_file():
        return path.parent  # the file kept before the label store, imported or not
    if not path.exists():
        raise LabelError(f"{path}: corrections not found")
    for folder in [path, *path.parents][:4]:
        if folder.is_dir() and (folder / "session.json").is_file():
            return folder
    raise LabelError(
        f"{path}: not the corrections of an app assessment (no session.json beside it or above "
        "it); give the assessment folder the app saved them in"
    )


def read_corrections(session: Path, class_names: Sequence[str]) -> dict[int, int]:
    """Table row -> class id of the latest correction of each building of an assessment, from
    the work folder's label store (:func:`data_prep.label_store.store_for`); empty when none.

    Raises:
        LabelError: an unknown class, an unreadable store.
    """
    info = json.loads((session / "session.json").read_text())
    store = LabelStore(store_for(session))
    try:
        latest = store.latest(scene=str(info.get("scene")))
    except StoreError as exc:
        raise LabelError(str(exc)) from exc
    out: dict[int, int] = {}
    for row, uid in enumerate(info.get("uids") or []):
        c = latest.get((str(info.get("scene")), str(uid)))
        if c is not None:
            cid = class_id(c.grade, class_names, f"{store.path} row {c.fid}")
            if cid is not None:
                out[row] = cid
    return out


def from_corrections(
    path: str | os.PathLike,
    spec: ChipSpec,
    class_names: Sequence[str],
    event: str | None = None,
    align: str = "auto",
    max_pixels: int | None = None,
) -> Buildings:
    """The buildings an analyst corrected in the app, with the corrected classes.

    Pixel tiles: the xBD label file and image copies the app writes under ``corrections/``.
    Georeferenced tiles: the tile's footprints and imagery named in ``session.json``, only the
    corrected rows. Event: ``event``, else the tile's scene name.

    Raises:
        LabelError: naming the file at fault.
    """
    session = session_folder(path)
    info = json.loads((session / "session.json").read_text())
    corrections = read_corrections(session, class_names)
    if not corrections:
        raise LabelError(
            f"{session}: no corrections saved for this assessment yet ({store_for(session)})"
        )
    scene = str(info.get("scene", session.name))
    options = ReadOptions(event or scene, align, max_pixels)
    if info.get("mode") == "xbd":
        label = session / "corrections" / "labels" / f"{scene}_post_disaster.json"
        images = sorted((session / "corrections" / "images").glob(f"{scene}_*_disaster.*"))
        pre = [p for p in images if p.stem.endswith("_pre_disaster")]
        post = [p for p in images if p.stem.endswith("_post_disaster")]
        if not label.is_file() or not pre or not post:
            raise LabelError(f"{label}: the corrections' label file or image copies are missing")
        out = from_xbd(pre[0], post[0], label, spec, class_names, True, options)
    else:
        for key in ("pre", "post", "footprints"):
            if not Path(info[key]).exists():
                raise LabelError(
                    f"{session / 'session.json'}: the tile's {key} file {info[key]} no longer "
                    "exists; give the corrections' footprints with --buildings, --label-field "
                    "damage and the tile's --pre/--post instead"
                )
        out = from_scene(
            [info["pre"]],
            [info["post"]],
            info["footprints"],
            spec,
            class_names,
            None,
            corrections,
            options,
        )
    out.sources = [f"app corrections {session}: {len(out)} buildings"]
    return out


def from_session(
    path: str | os.PathLike,
    spec: ChipSpec,
    class_names: Sequence[str],
    event: str | None = None,
    align: str = "auto",
    max_pixels: int | None = None,
) -> Buildings:
    """Every building of an assessed tile, the corrected ones labelled, the others unlabelled
    (the pool :func:`app.adapt.suggest.suggest` ranks). Reads the tile's own imagery and footprints
    named in ``session.json``, so they must still exist.

    Raises:
        LabelError: naming the file at fault.
    """
    session = session_folder(path)
    info = json.loads((session / "session.json").read_text())
    corrections = read_corrections(session, class_names)
    for key in ("pre", "post", "footprints"):
        if not Path(info.get(key, "")).is_file():
            raise LabelError(
                f"{session / 'session.json'}: the tile's {key} file {info.get(key)} no longer "
                "exists; assess the tile again"
            )
    scene = str(info.get("scene", session.name))
    options = ReadOptions(event or scene, align, max_pixels)
    if info.get("mode") == "xbd":
        out = from_xbd(
            info["pre"],
            info["post"],
            info["footprints"],
            spec,
            class_names,
            False,
            options,
        )
        prefix = Path(info["footprints"]).stem.replace("_post_disaster", "")
    else:
        out = from_scene(
            [info["pre"]],
            [info["post"]],
            info["footprints"],
            spec,
            class_names,
            options=options,
        )
        prefix = event or scene
    uids = info.get("uids") or []
    by_id = {f"{prefix}:{uids[row]}": cid for row, cid in corrections.items() if row < len(uids)}
    out.labels = np.array([by_id.get(i, -1) for i in out.ids], np.int64)
    out.sources = [
        f"app assessment {session}: {len(out)} buildings, {int((out.labels >= 0).sum())} corrected"
    ]
    return out


def from_store(
    path: str | os.PathLike,
    spec: ChipSpec,
    class_names: Sequence[str],
    event: str | None = None,
    align: str = "auto",
    max_pixels: int | None = None,
) -> tuple[Buildings, list[Path], list[str]]:
    """Every building corrected in a label store (of ``event`` only, when given: the event an
    assessment has now, else the one its rows were saved with), each once with its latest grade,
    cut from the assessments that hold it (newest first wins).

    Returns:
        ``(buildings, assessments read, one line per assessment that could not be read)``.

    Raises:
        LabelError: not a store, or no correction of ``event`` can be read.
    """
    store = LabelStore(path)
    if not store.exists():
        raise LabelError(f"{path}: label store not found")
    try:
        rows = store.rows()
    except StoreError as exc:
        raise LabelError(str(exc)) from exc
    sessions = {c.session: c.event for c in reversed(rows) if c.session}  # newest first
    parts, read, left_out, seen = [], [], [], set()
    for session, saved_event in sessions.items():
        try:
            file = Path(session) / "session.json"
            info = json.loads(file.read_text()) if file.is_file() else {"event": saved_event}
            name = info.get("event") or saved_event
            if event and name != event:
                continue
            buildings = from_corrections(session, spec, class_names, name, align, max_pixels)
        except (LabelError, OSError, ValueError) as exc:
            left_out.append(str(exc) if isinstance(exc, LabelError) else f"{session}: {exc}")
            continue
        scene = str(info.get("scene"))
        keys = [(scene, i.split(":", 1)[-1]) for i in buildings.ids]
        keep = np.array([k not in seen for k in keys], dtype=bool)
        seen.update(keys)
        if keep.any():
            parts.append(buildings.subset(keep))
            read.append(Path(session))
    if not parts:
        what = f"of event {event} " if event else ""
        problem = f": {'; '.join(left_out)}" if left_out else ""
        raise LabelError(f"{path}: no correction {what}can be read{problem}")
    out = concat(parts[::-1], spec.chip_size)
    out.sources = [f"label store {path}: {len(out)} buildings", *out.sources]
    return out, read[::-1], left_out
