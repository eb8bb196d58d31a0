"""A labelling campaign's label store, read for other tools: exports and a summary.

:func:`export_store` writes the latest correction of every building (of one event, or all) as a
vector layer for GIS (GeoJSON or GeoPackage, lon/lat, a ``damage`` attribute plus who set it and
when), and the corrected xBD tiles in the xBD layout (``xbd/labels/<tile>_post_disaster.json``
with ``properties.subtype`` and ``xbd/images`` copies) that ``local-damage prepare xbd`` cuts;
:func:`summary` counts corrections per event, grade and analyst. Used by ``local-damage labels``
and ``prepare xbd --xbd STORE.gpkg``.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from app.scoring.outputs import write_vector
from app.web.sessions import AppError, read_corrections_json, read_session, write_xbd_corrections
from data_prep.label_store import Correction, LabelStore, StoreError


@dataclass
class Export:
    """What :func:`export_store` wrote: the vector layer, the xBD folder (None without xBD
    tiles), the number of buildings, and one line per tile that could not be exported."""

    vector: Path | None
    xbd: Path | None
    buildings: int
    xbd_tiles: int = 0
    left_out: list[str] = field(default_factory=list)


def latest(store: str | os.PathLike, event: str | None = None) -> list[Correction]:
    """The latest correction of each building of the store (of ``event`` when given).

    Raises:
        AppError: no store there, or it cannot be read.
    """
    labels = LabelStore(store)
    if not labels.exists():
        raise AppError(f"{store}: label store not found")
    try:
        rows = labels.latest(**({"event": event} if event else {}))
    except StoreError as exc:
        raise AppError(str(exc)) from exc
    return list(rows.values())


def export_store(store: str | os.PathLike, out: str | os.PathLike, event: str | None = None,
                 vector_name: str | None = "corrections.geojson", xbd: bool = True) -> Export:  # fmt: skip
    """Write the store's latest corrections to ``out``: ``out/<vector_name>`` (GeoJSON or
    GeoPackage by its suffix; buildings without a lon/lat footprint have no geometry; None: no
    vector file) and, with
    ``xbd``, the corrected xBD tiles under ``out/xbd`` (labels and image copies, from each tile's
    newest assessment that still has its files).

    Raises:
        AppError: no store, an unreadable store, or no correction (of ``event``).
    """
    rows = latest(store, event)
    if not rows:
        raise AppError(f"{store}: no corrections{f' of event {event}' if event else ''} yet")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vector = None
    if vector_name:
        names = ["event", "scene", "uid", "predicted", "model_sha256", "analyst", "time", "source"]
        columns = {"damage": np.array([c.grade for c in rows], dtype=object)}
        columns |= {n: np.array([getattr(c, n) for c in rows], dtype=object) for n in names}
        geoms = np.empty(len(rows), dtype=object)
        geoms[:] = [c.geometry for c in rows]
        vector = write_vector(out / vector_name, geoms, "EPSG:4326", columns, layer="corrections")
    result = Export(vector, None, len(rows))
    if xbd:
        _export_xbd(rows, out / "xbd", result)
    return result


def _export_xbd(rows: list[Correction], root: Path, result: Export) -> None:
    """The xBD tiles among ``rows``: each tile's label file from its newest assessment."""
    by_scene: dict[str, list[str]] = {}
    for c in sorted(rows, key=lambda c: (c.time or "", c.fid or 0), reverse=True):
        if c.pixel_wkt and c.session:
            by_scene.setdefault(c.scene, []).append(c.session)
    for scene, sessions in by_scene.items():
        problems = []
        for session in dict.fromkeys(sessions):
            try:
                info = read_session(session)
                missing = [k for k in ("pre", "post", "footprints") if not Path(info[k]).is_file()]
                if missing:
                    problems.append(f"{session}: its {', '.join(missing)} file(s) are gone")
                    continue
                label = root / "labels" / f"{scene}_post_disaster.json"
                write_xbd_corrections(info, read_corrections_json(session), label)
                result.xbd, result.xbd_tiles = root, result.xbd_tiles + 1
                break
            except (AppError, OSError, ValueError) as exc:
                problems.append(f"{session}: {exc}")
        else:
            result.left_out.append(f"tile {scene}: no assessment to export it from ({problems})")


def summary(store: str | os.PathLike) -> str:
    """Corrections per event, grade and analyst, as lines of text."""
    labels = LabelStore(store)
    try:
        rows = labels.rows() if labels.exists() else None
    except StoreError as exc:
        raise AppError(str(exc)) from exc
    if rows is None:
        raise AppError(f"{store}: label store not found")
    last = {c.key: c for c in rows}
    lines = [f"{store}: {len(rows)} corrections of {len(last)} buildings"]
    for title, key in (("event", "event"), ("grade", "grade"), ("analyst", "analyst")):
        counts = Counter(getattr(c, key) for c in last.values())
        text = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
        lines.append(f"  by {title} (latest grade of each building): {text}")
    return "\n".join(lines)
