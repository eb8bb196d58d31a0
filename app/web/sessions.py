"""The web app's assessment folders: ``session.json``, the analysts' corrections, the event.

Each assessment of a tile gets a folder (``WORK/sessions/<time>-<n>`` in the app) holding its
outputs and ``session.json`` (the inputs, the model and its sha256, the table's uids, predicted
classes and probabilities, the event). :func:`save_correction` records the class an analyst sets
for a building as a row of the work folder's label store (:mod:`data_prep.label_store`,
``WORK/labels.gpkg``; one transaction per save, the history kept) and in a label file that
``local-damage prepare`` reads; :func:`read_corrections_json` reads the latest correction of each
building back, and :func:`app.adapt.labelled.from_corrections` the labelled buildings for
``adapt``. An assessment's ``corrections.json`` (kept before the store) is imported once,
losing nothing (:func:`import_corrections`). Every file write is atomic.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np

from app.scoring.outputs import write_vector
from data_prep.errors import LocalDamageError
from data_prep.label_store import IMPORTED, Correction, LabelStore, StoreError, store_for
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
    """Where an assessment's corrections are also written as a label file (for ``prepare``):
    ``corrections/labels/<scene>_post_disaster.json`` (xBD label format, images copied to
    ``corrections/images``) for pixel tiles, or ``corrections/<scene>_corrections.geojson``
    (``damage`` attribute) for georeferenced ones."""
    info = read_session(session)
    root = Path(session) / "corrections"
    if info["mode"] == "xbd":
        return root / "labels" / f"{info['scene']}_post_disaster.json"
    return root / f"{info['scene']}_corrections.geojson"


def save_correction(
    session: str | os.PathLike, row: int, damage: str, analyst: str | None = None
) -> Path:
    """Record the class an analyst sets for one building in the work folder's label store.

    The correction is one row of the store (:mod:`data_prep.label_store`, ``WORK/labels.gpkg``
    for the app's ``WORK/sessions/<name>``), saved in one transaction with the building's
    footprint, the grade and probabilities the model gave, the model's sha256, the analyst and
    the time; a later correction of the same building is a new row and wins. The assessment's
    corrections are then also written as a label file for retraining (the latest of each
    building): pixel tiles, an xBD label file with the building's ``features.xy`` (and
    ``lng_lat`` when known) polygon and ``properties.subtype`` = the class, beside copies of the
    pre/post images named as xBD names them, so ``local-damage prepare xbd --root
    SESSION/corrections`` cuts their chips; georeferenced tiles, a GeoJSON of the corrected
    footprints (longitude/latitude) with a ``damage`` attribute, for ``local-damage prepare scene
    --label-field damage``. Written atomically.

    Args:
        session: the :attr:`app.web.assess.TileResult.session` folder.
        row: the building's ``#`` in the table.
        damage: the right class name (one of the model's classes).
        analyst: who sets it (the app passes the logged-in analyst; None: ``unknown``).

    Returns:
        The assessment's label file (as before the store; the store is :func:`store_for`).

    Raises:
        AppError: no assessment, no such building, an unknown class, or a store that cannot be
            written (a read-only folder, a full disk: the message says which).
    """
    info = read_session(session)
    row = check_row(info, row)
    if damage not in info["class_names"]:
        raise AppError(f"unknown class {damage!r}; choose one of {', '.join(info['class_names'])}")
    store = LabelStore(store_for(session))
    import_corrections(session)
    correction = _correction(session, info, row, damage, analyst or "unknown", "app")
    try:
        store.add([correction])
    except StoreError as exc:
        raise AppError(f"the correction of building #{row} was NOT saved: {exc}") from exc
    try:
        _write_label_file(session, info)
    except OSError as exc:
        raise AppError(
            f"the correction of building #{row} is saved in {store.path}, but the label file "
            f"{corrections_path(session)} could not be written ({exc}); `local-damage labels "
            "export` writes it from the store"
        ) from exc
    return corrections_path(session)


def _correction(session, info: dict, row: int, damage: str, analyst: str, source: str, when=None):
    """The store row of one correction of building ``row`` of an assessment, made at ``when``
    (ISO 8601 UTC; None: when it is saved)."""
    probs = (info.get("probabilities") or [None] * (row + 1))[row]
    geometry, pixel_wkt = _footprint(info, row)
    return Correction(
        event=session_event(session),
        scene=str(info["scene"]),
        uid=str(info["uids"][row]),
        grade=damage,
        row=row,
        predicted=info["predicted"][row] or None,
        probabilities=dict(zip(info["class_names"], probs, strict=True)) if probs else {},
        model_sha256=info.get("model_sha256"),
        model=Path(info.get("model") or "").name or None,
        analyst=analyst,
        time=when,
        session=str(Path(session).absolute()),
        source=source,
        pixel_wkt=pixel_wkt,
        geometry=geometry,
    )


def _footprint(info: dict, row: int):
    """The building's footprint: ``(lon/lat geometry or None, pixel WKT or None)``."""
    import shapely
    import shapely.errors
    import shapely.ops

    uid = info["uids"][row]
    try:
        if info["mode"] == "xbd":
            features = json.loads(Path(info["footprints"]).read_bytes()).get("features") or {}
            found = {}
            for kind in ("lng_lat", "xy"):
                for i, f in enumerate(features.get(kind) or []):
                    props = (f.get("properties") if isinstance(f, dict) else None) or {}
                    if str(props.get("uid") or f"#{i}") == uid and isinstance(f.get("wkt"), str):
                        found[kind] = f["wkt"]
                        break
            lnglat = found.get("lng_lat")
            return (shapely.from_wkt(lnglat) if lnglat else None), found.get("xy")
        from pyogrio.raw import read

        meta, _, wkb, _ = read(info["vector"], skip_features=row, max_features=1, columns=[])
        if not len(wkb) or wkb[0] is None:
            return None, None
        geometry = shapely.from_wkb(wkb[0])
        crs = str(meta.get("crs") or "")
        if crs and crs not in ("OGC:CRS84", "EPSG:4326"):
            from pyproj import Transformer

            to_lonlat = Transformer.from_crs(crs, "OGC:CRS84", always_xy=True).transform
            geometry = shapely.ops.transform(to_lonlat, geometry)
        return geometry, None
    except (OSError, ValueError, KeyError, shapely.errors.ShapelyError):
        return None, None  # the footprint is a convenience of the row; the grade is what counts


_write_locks: dict[str, threading.Lock] = {}


def _write_label_file(session: str | os.PathLike, info: dict) -> None:
    """Write the assessment's label file from the store, after the save was committed. Saves of
    one assessment write it one after another (a lock in this process, and a file lock between
    processes), each from the store as it is then, so the last file holds every correction."""
    import fcntl

    lock_file = Path(session) / ".corrections.lock"
    with _write_locks.setdefault(str(lock_file), threading.Lock()), open(lock_file, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        corrections = read_corrections_json(session)
        if corrections:
            _write_corrections(info, corrections, corrections_path(session))


def _write_corrections(info: dict, corrections: dict, path: Path) -> None:
    if info["mode"] == "xbd":
        write_xbd_corrections(info, corrections, path)
    else:
        _write_vector_corrections(info, corrections, path)


def write_xbd_corrections(info: dict, corrections: dict, path: Path) -> None:
    """Write ``corrections`` (row -> ``uid``, ``damage``, ``predicted``) of the xBD assessment
    ``info`` as an xBD label file at ``path``, beside copies of its pre/post images in
    ``path.parent.parent / "images"``."""
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
    """Table row (as text) -> the latest correction of that building of an assessment (``uid``,
    ``damage``, ``predicted``, ``time``, ``analyst``, ``fid``), read from the label store; empty
    when none was saved. A correction of the same building (tile and uid) saved in another
    assessment of the tile counts too. An old assessment's ``corrections.json`` is imported into
    the store first (:func:`import_corrections`).

    Raises:
        AppError: no assessment in ``session``.
    """
    info = read_session(session)
    import_corrections(session)
    try:
        latest = LabelStore(store_for(session)).latest(scene=str(info["scene"]))
    except StoreError as exc:
        raise AppError(str(exc)) from exc
    out = {}
    for row, uid in enumerate(info["uids"]):
        c = latest.get((str(info["scene"]), str(uid)))
        if c is not None and c.grade in info["class_names"]:
            out[str(row)] = {
                "uid": c.uid,
                "damage": c.grade,
                "predicted": info["predicted"][row],
                "time": c.time,
                "analyst": c.analyst,
                "fid": c.fid,
            }
    return out


def building_history(session: str | os.PathLike, row: int) -> list[Correction]:
    """Every correction of building ``row`` of an assessment (any analyst, any assessment of
    the tile), oldest first."""
    info = read_session(session)
    row = check_row(info, row)
    import_corrections(session)
    return LabelStore(store_for(session)).history(str(info["scene"]), str(info["uids"][row]))


_import_lock = threading.Lock()


def import_corrections(session: str | os.PathLike) -> int:
    """Import an assessment's ``corrections.json`` (kept by the app before the label store) into
    the store, once: every entry becomes a row (its analyst ``unknown``, its time kept, its
    ``source`` naming the file), in one transaction. Returns how many rows were imported (0 when
    there is no file or it was imported before); the file is left as it is.

    Raises:
        AppError: the file is not the corrections of the assessment, or the store cannot be
            written.
    """
    path = (Path(session) / CORRECTIONS_FILE).absolute()
    if not path.is_file():
        return 0
    store = LabelStore(store_for(session))
    with _import_lock:
        try:
            if store.imported(path):
                return 0
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError(f"expected an object of row -> correction, got {type(data)}")
            info = read_session(session)
            rows = []
            names = info.get("class_names") or []
            for key, entry in sorted(data.items(), key=lambda kv: int(kv[0])):
                if not isinstance(entry, dict) or entry.get("damage") not in names:
                    damage = entry.get("damage") if isinstance(entry, dict) else entry
                    raise ValueError(f"row {key}: unknown class {damage!r}")
                row = check_row(info, int(key))
                if entry.get("uid") not in (None, info["uids"][row]):
                    raise ValueError(f"row {key} is uid {entry['uid']}, the table's is another")
                who = str(entry.get("analyst") or "unknown")
                source = IMPORTED + str(path)
                when = entry.get("time") or None
                rows.append(_correction(session, info, row, entry["damage"], who, source, when))
            store.add(rows)
        except StoreError as exc:
            raise AppError(str(exc)) from exc
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise AppError(f"{path}: cannot import these corrections ({exc})") from exc
    return len(rows)


def import_work(work: str | os.PathLike) -> tuple[int, list[str]]:
    """Import the ``corrections.json`` of every assessment under ``work/sessions`` not imported
    yet (oldest first); returns the rows imported and one line per file that could not be."""
    total, problems = 0, []
    for session in list_sessions(work):
        try:
            total += import_corrections(session)
        except AppError as exc:
            problems.append(str(exc))
    return total, problems


def carry_corrections(old: str | os.PathLike, new: str | os.PathLike) -> int:
    """The corrections of assessment ``old`` that ``new``, an assessment of the same tile (e.g.
    the tile graded again by another model), shows: the store keeps them by building, so they
    carry over by themselves; this writes ``new``'s label file and returns how many there are.
    A building is matched by its uid; corrections of buildings ``new`` does not have are left out.

    Raises:
        AppError: no assessment in ``old`` or ``new``.
    """
    uids = {entry["uid"] for entry in read_corrections_json(old).values()}
    info = read_session(new)
    carried = {r: e for r, e in read_corrections_json(new).items() if e["uid"] in uids}
    if carried:
        _write_label_file(new, info)
    return len(carried)
