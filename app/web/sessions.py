"""The web app's assessment folders: ``session.json``, the analyst's corrections, the event.

Each assessment of a tile gets a folder (``WORK/sessions/<time>-<n>`` in the app) holding its
outputs and ``session.json`` (the inputs, the model, the table's uids and predicted classes, the
event). :func:`save_correction` records the class an analyst sets for a building in
``corrections.json`` and in a label file that ``local-damage prepare`` reads;
:func:`app.adapt.labelled.from_corrections` reads them back for ``adapt``. Every write is atomic.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from app.scoring.outputs import write_vector
from data_prep.errors import LocalDamageError
from data_prep.store import atomic_path, safe_name

#: File of an assessment folder that records its inputs.
SESSION_FILE = "session.json"
#: File of an assessment folder that records the analyst's corrections by table row.
CORRECTIONS_FILE = "corrections.json"


class AppError(LocalDamageError, ValueError):
    """Input the app cannot use; the message names the file and the problem."""


# --------------------------------------------------------------------------------------------
# Assessment folders


def write_json(path: Path, data: Any) -> Path:
    """Write ``data`` as JSON to ``path``, atomically."""
    with atomic_path(path, suffix=".json") as tmp:
        tmp.write_text(json.dumps(data, indent=1))
    return path


def read_session(session: str | os.PathLike) -> dict[str, Any]:
    """The ``session.json`` of an assessment folder.

    Raises:
        AppError: no assessment in ``session``.
    """
    path = Path(session) / SESSION_FILE
    if not path.is_file():
        raise AppError("no assessment yet: assess a tile first")
    return json.loads(path.read_text())


def check_row(info: dict[str, Any], row: int) -> int:
    """``row`` as an int when it is a building of the assessment ``info``.

    Raises:
        AppError: no such building.
    """
    n = len(info["uids"])
    if not isinstance(row, (int, np.integer)) or isinstance(row, bool) or not 0 <= row < n:
        raise AppError(f"building #{row} does not exist; the table has #0 to #{n - 1}")
    return int(row)


def corrections_path(session: str | os.PathLike) -> Path:
    """Where the corrections of an assessment go: ``corrections/labels/<scene>_post_disaster
    .json`` (xBD label format, images copied to ``corrections/images``) for pixel tiles, or
    ``corrections/<scene>_corrections.geojson`` (``damage`` attribute) for georeferenced ones."""
    info = read_session(session)
    root = Path(session) / "corrections"
    if info["mode"] == "xbd":
        return root / "labels" / f"{info['scene']}_post_disaster.json"
    return root / f"{info['scene']}_corrections.geojson"


def save_correction(session: str | os.PathLike, row: int, damage: str) -> Path:
    """Record the class an analyst sets for one building, in a label file for retraining.

    Only corrected buildings are written (a later correction of the same building replaces the
    earlier one). Pixel tiles (xBD label JSON): an xBD label file with the building's
    ``features.xy`` (and ``lng_lat`` when known) polygon and ``properties.subtype`` = the class,
    beside copies of the pre/post images named as xBD names them, so
    ``local-damage prepare xbd --root SESSION/corrections`` cuts their chips. Georeferenced tiles:
    a GeoJSON of the corrected footprints (longitude/latitude) with a ``damage`` attribute, for
    ``local-damage prepare scene --label-field damage``. Written atomically.

    Args:
        session: the :attr:`app.web.assess.TileResult.session` folder.
        row: the building's ``#`` in the table.
        damage: the right class name (one of the model's classes).

    Returns:
        The corrections file.

    Raises:
        AppError: no assessment, no such building or an unknown class.
    """
    info = read_session(session)
    row = check_row(info, row)
    if damage not in info["class_names"]:
        raise AppError(f"unknown class {damage!r}; choose one of {', '.join(info['class_names'])}")
    path = corrections_path(session)
    uid = info["uids"][row]
    corrections = read_corrections_json(session)
    corrections[str(row)] = {
        "uid": uid,
        "damage": damage,
        "predicted": info["predicted"][row],
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_json(Path(session) / CORRECTIONS_FILE, corrections)
    _write_corrections(info, corrections, path)
    return path


def _write_corrections(info: dict, corrections: dict, path: Path) -> None:
    if info["mode"] == "xbd":
        _write_xbd_corrections(info, corrections, path)
    else:
        _write_vector_corrections(info, corrections, path)


def _write_xbd_corrections(info: dict, corrections: dict, path: Path) -> None:
    data = json.loads(Path(info["footprints"]).read_bytes())
    features = data.get("features") or {}
    by_uid = {c["uid"]: c for c in corrections.values()}

    def pick(items: list) -> list:
        out = []
        for i, f in enumerate(items or []):
            props = dict((f.get("properties") or {}) if isinstance(f, dict) else {})
            uid = str(props.get("uid") or f"#{i}")
            if uid in by_uid and isinstance(f.get("wkt"), str):
                props.update(
                    uid=uid,
                    feature_type="building",
                    subtype=by_uid[uid]["damage"],
                    predicted=by_uid[uid]["predicted"],
                    source="analyst correction",
                )
                out.append({"properties": props, "wkt": f["wkt"]})
        return out

    scene = info["scene"]
    metadata = dict(data.get("metadata") or {})
    images = path.parent.parent / "images"
    images.mkdir(parents=True, exist_ok=True)
    for phase in ("pre", "post"):
        src = Path(info[phase])
        dst = images / f"{scene}_{phase}_disaster{src.suffix.lower()}"
        if not dst.exists():
            shutil.copyfile(src, dst)
        if phase == "post":
            metadata["img_name"] = dst.name
    label = {
        "features": {"lng_lat": pick(features.get("lng_lat")), "xy": pick(features.get("xy"))},
        "metadata": metadata,
    }
    write_json(path, label)


def _write_vector_corrections(info: dict, corrections: dict, path: Path) -> None:
    from pyogrio.raw import read

    vector = Path(info["vector"])
    meta, _, wkb, values = read(str(vector))
    import shapely

    rows = sorted(int(r) for r in corrections)
    geoms = np.empty(len(rows), dtype=object)
    geoms[:] = [None if wkb[r] is None else shapely.from_wkb(wkb[r]) for r in rows]
    columns = {
        "uid": np.array([corrections[str(r)]["uid"] for r in rows], dtype=object),
        "damage": np.array([corrections[str(r)]["damage"] for r in rows], dtype=object),
        "predicted": np.array([corrections[str(r)]["predicted"] for r in rows], dtype=object),
        "source": np.array(["analyst correction"] * len(rows), dtype=object),
    }
    crs = meta.get("crs") if vector.suffix.lower() == ".gpkg" else "OGC:CRS84"
    target = path if vector.suffix.lower() != ".gpkg" else path.with_suffix(".gpkg")
    write_vector(target, geoms, crs, columns)


# --------------------------------------------------------------------------------------------
# Events and the assessments of a work folder


def tile_event(mode: str, footprints: str | os.PathLike, scene: str) -> str:
    """The event a tile belongs to, by default: an xBD label's ``metadata.disaster``, else the
    xBD tile name without its number (``<event>_<id>``), else the scene name."""
    if mode == "xbd":
        try:
            disaster = json.loads(Path(footprints).read_text()).get("metadata", {}).get("disaster")
        except (OSError, ValueError, AttributeError):
            disaster = None
        if isinstance(disaster, str) and disaster.strip():
            return safe_name(disaster.strip())
        return re.sub(r"_\d+$", "", scene) or scene
    return scene


def session_event(session: str | os.PathLike) -> str:
    """The event recorded for an assessment (:func:`tile_event` for folders without one)."""
    info = read_session(session)
    event = info.get("event")
    if isinstance(event, str) and event:
        return event
    return tile_event(info.get("mode", ""), info.get("footprints", ""), info.get("scene", ""))


def set_event(session: str | os.PathLike, event: str) -> str:
    """Record ``event`` (file-name safe) as the event of an assessment; returns it.

    Raises:
        AppError: no assessment in ``session`` or an empty event name.
    """
    if not event or not event.strip():
        raise AppError("the event name is empty; type the event these tiles belong to")
    info = read_session(session)
    event = safe_name(event.strip())
    if info.get("event") != event:
        info["event"] = event
        write_json(Path(session) / SESSION_FILE, info)
    return event


def list_sessions(work: str | os.PathLike) -> list[Path]:
    """The assessment folders under ``work/sessions``, oldest first (their names start with the
    time)."""
    root = Path(work) / "sessions"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / SESSION_FILE).is_file())


def read_corrections_json(session: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Table row (as text) -> correction of an assessment; empty when none was saved."""
    path = Path(session) / CORRECTIONS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def carry_corrections(old: str | os.PathLike, new: str | os.PathLike) -> int:
    """Copy the corrections of assessment ``old`` to ``new``, an assessment of the same tile
    (e.g. the tile graded again by another model); returns how many were carried. A building
    is matched by its uid; corrections of buildings ``new`` does not have are left out.

    Raises:
        AppError: no assessment in ``old`` or ``new``.
    """
    read_session(old)
    info = read_session(new)
    rows = {uid: i for i, uid in reversed(list(enumerate(info["uids"])))}
    carried = {}
    for entry in read_corrections_json(old).values():
        row = rows.get(entry.get("uid"))
        if row is not None and entry.get("damage") in info["class_names"]:
            carried[str(row)] = dict(entry)
    if not carried:
        return 0
    write_json(Path(new) / CORRECTIONS_FILE, carried)
    _write_corrections(info, carried, corrections_path(new))
    return len(carried)
