"""The analysts' label store: every correction of a work folder as a row of one GeoPackage.

A labelling campaign saves its corrections into ``WORK/labels.gpkg``: a GeoPackage (SQLite) whose
``corrections`` layer QGIS and GeoPandas open as a polygon layer (EPSG:4326). Each row is one
correction: the event, the tile or scene, the building's uid and its table row, its footprint
(lon/lat where known; ``pixel_wkt`` holds the polygon in image pixels for xBD tiles), the grade set,
the grade and probabilities the model gave, the model's sha256, the analyst, the time (UTC), the
assessment folder and where the row came from. A correction of a correction is a new row: the
history is kept and the latest row of a building (by time, then by ``fid``) wins wherever labels
are read.

The layer is created by GDAL (pyogrio, without a spatial index, whose triggers need GDAL's SQL
functions); rows are appended with the standard library's :mod:`sqlite3` in WAL mode, one
transaction per save (``BEGIN IMMEDIATE``, ``synchronous=FULL``), so several threads and processes
save at once, and a save the caller was told of survives the process being killed. A building is
known by its tile's name and uid (``scene``, ``uid``): every assessment of the same tile sees its
corrections, whichever analyst or model made them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import struct
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import shapely

from data_prep.errors import LocalDamageError

#: The store's file in a work folder.
STORE_NAME = "labels.gpkg"
#: The GeoPackage layer holding the corrections.
LAYER = "corrections"
#: Seconds a save waits for another writer before it fails.
BUSY_TIMEOUT = 30.0
#: The layer's attribute columns, in order, with their OGR-facing types.
COLUMNS: dict[str, type] = {
    "event": str,
    "scene": str,
    "uid": str,
    "row": int,
    "grade": str,
    "predicted": str,
    "probabilities": str,
    "model_sha256": str,
    "model": str,
    "analyst": str,
    "time": str,
    "session": str,
    "pixel_wkt": str,
    "source": str,
}
_SRS = 4326
#: The ``source`` of the rows imported from a file starts with this, then the file's path.
IMPORTED = "imported from "


class StoreError(LocalDamageError):
    """The label store cannot be read or written; the message names the file and the problem."""


@dataclass
class Correction:
    """One correction of one building (a row of the store).

    Attributes:
        event, scene, uid: the event, the tile or scene name and the building's uid.
        grade: the grade the analyst set.
        row: the building's row in its assessment's table.
        predicted: the grade the model gave; probabilities: class -> probability it gave.
        model_sha256, model: the model file's sha256 and name.
        analyst: who set the grade; time: when (ISO 8601, UTC; default: now).
        session: the assessment folder; source: where the row came from (``app``, an import).
        geometry: the footprint in lon/lat (shapely), where known; pixel_wkt: in image pixels.
        fid: the row's id in the store (None until saved).
    """

    event: str
    scene: str
    uid: str
    grade: str
    row: int | None = None
    predicted: str | None = None
    probabilities: dict[str, float] = field(default_factory=dict)
    model_sha256: str | None = None
    model: str | None = None
    analyst: str | None = None
    time: str | None = None
    session: str | None = None
    source: str = "app"
    pixel_wkt: str | None = None
    geometry: Any = None
    fid: int | None = None

    @property
    def key(self) -> tuple[str, str]:
        """The building: ``(scene, uid)``."""
        return self.scene, self.uid


def now() -> str:
    """The time now, as the store writes it (ISO 8601, UTC, seconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def store_for(session: str | os.PathLike) -> Path:
    """The store of an assessment folder: ``WORK/labels.gpkg`` for ``WORK/sessions/<name>``
    (the app's layout), else ``labels.gpkg`` inside the folder itself."""
    session = Path(session).absolute()
    if session.parent.name == "sessions":
        return session.parent.parent / STORE_NAME
    return session / STORE_NAME


def _blob(geometry) -> bytes | None:
    """A GeoPackage geometry blob (header without envelope + little-endian WKB)."""
    if geometry is None:
        return None
    if geometry.geom_type == "Polygon":
        geometry = shapely.MultiPolygon([geometry])
    flags = 0x01 | (0x10 if geometry.is_empty else 0)
    return (
        b"GP\x00"
        + bytes([flags])
        + struct.pack("<i", _SRS)
        + shapely.to_wkb(geometry, byte_order=1)
    )


def _geometry(blob: bytes | None):
    if not blob or blob[:2] != b"GP":
        return None
    envelope = {0: 0, 1: 32, 2: 48, 3: 48, 4: 64}.get((blob[3] >> 1) & 0x07, 0)
    return shapely.from_wkb(blob[8 + envelope :])


def _quoted(names: Iterable[str]) -> str:
    return ", ".join(f'"{n}"' for n in names)


def _failure(path: Path, exc: BaseException) -> StoreError:
    text = str(exc)
    if "full" in text:
        why = "the disk is full; free space, then save the correction again"
    elif "disk I/O" in text or isinstance(exc, OSError):
        why = "could not write to the disk (full, over a size limit, or failing)"
    elif "readonly" in text or "read-only" in text or "unable to open" in text:
        why = (
            "cannot write there (a read-only folder or file, or a missing folder); give the app a "
            "writable --work folder"
        )
    elif "locked" in text or "busy" in text:
        why = f"another writer held it for more than {BUSY_TIMEOUT:.0f} s; save again"
    elif "not a database" in text or "no such table" in text or "malformed" in text:
        why = f"not a label store (a GeoPackage with a {LAYER!r} layer)"
    else:
        return StoreError(f"label store {path}: {text}")
    return StoreError(f"label store {path}: {why} ({text})")


class LabelStore:
    """One GeoPackage of corrections; created on the first save.

    Args:
        path: the ``.gpkg`` file (:func:`store_for` gives a work folder's).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    # -- opening -----------------------------------------------------------------------------

    def exists(self) -> bool:
        return self.path.is_file()

    def create(self) -> None:
        """Create the store if it does not exist (safe when several processes race to)."""
        if self.path.exists():
            return
        from pyogrio.raw import write

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".gpkg", prefix=".labels-", dir=self.path.parent)
        except OSError as exc:
            raise _failure(self.path, exc) from exc
        os.close(fd)
        os.unlink(tmp)
        try:
            fields = list(COLUMNS)
            values = [np.array([], np.int64 if t is int else object) for t in COLUMNS.values()]
            write(
                tmp, np.array([], dtype=object), values, fields, layer=LAYER, driver="GPKG",
                geometry_type="MultiPolygon", crs=f"EPSG:{_SRS}",
                layer_options={"SPATIAL_INDEX": "NO", "FID": "fid"},
            )  # fmt: skip
            con = sqlite3.connect(tmp)
            try:
                con.execute("PRAGMA journal_mode=WAL")
            finally:
                con.close()
            with contextlib.suppress(FileExistsError):  # another process created it first
                os.link(tmp, self.path)
        except Exception as exc:  # GDAL's and SQLite's errors alike: the file named, the why said
            raise _failure(self.path, exc) from exc
        finally:
            Path(tmp).unlink(missing_ok=True)

    def _connect(self) -> sqlite3.Connection:
        con = None
        try:
            con = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None)
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=FULL")
            return con
        except sqlite3.Error as exc:
            if con is not None:
                con.close()  # a connection left open would hold the file (and its folder)
            raise _failure(self.path, exc) from exc

    # -- writing -----------------------------------------------------------------------------

    def add(self, corrections: Sequence[Correction]) -> list[int]:
        """Save ``corrections`` in one transaction; returns their ``fid``s (set on each too).

        Raises:
            StoreError: the store cannot be written (read-only, full disk, not a store).
        """
        self.create()
        con = self._connect()
        try:
            con.execute("BEGIN IMMEDIATE")
            fids = []
            names = list(COLUMNS)
            sql = f"INSERT INTO {LAYER} (geom, {_quoted(names)}) VALUES (?{', ?' * len(names)})"
            for c in corrections:
                values = {n: getattr(c, n) for n in names}
                values["probabilities"] = json.dumps(c.probabilities or {}, sort_keys=True)
                values["time"] = c.time or now()
                cur = con.execute(sql, [_blob(c.geometry), *values.values()])
                c.fid, c.time = int(cur.lastrowid), values["time"]
                fids.append(c.fid)
            con.execute("COMMIT")
            return fids
        except sqlite3.Error as exc:
            if con.in_transaction:
                con.execute("ROLLBACK")
            raise _failure(self.path, exc) from exc
        finally:
            con.close()

    def imported(self, file: str | os.PathLike) -> bool:
        """Whether rows were imported from ``file`` (their ``source`` names it)."""
        if not self.exists():
            return False
        sql = f"SELECT 1 FROM {LAYER} WHERE source = ? LIMIT 1"
        return bool(self._query(sql, (IMPORTED + str(file),)))

    # -- reading -----------------------------------------------------------------------------

    def _query(self, sql: str, params: Iterable = ()) -> list[tuple]:
        con = self._connect()
        try:
            return con.execute(sql, tuple(params)).fetchall()
        except sqlite3.Error as exc:
            raise _failure(self.path, exc) from exc
        finally:
            con.close()

    def rows(self, **where: Any) -> list[Correction]:
        """Every correction whose columns equal ``where`` (e.g. ``event=...``, ``scene=...``),
        oldest first (by time, then by order of saving): the whole history."""
        if not self.exists():
            return []
        bad = [k for k in where if k not in COLUMNS]
        if bad:
            raise ValueError(f"unknown column(s) {bad}; the store has {list(COLUMNS)}")
        names = list(COLUMNS)
        sql = f"SELECT fid, geom, {_quoted(names)} FROM {LAYER}"
        if where:
            sql += " WHERE " + " AND ".join(f'"{k}" = ?' for k in where)
        out = []
        order = ' ORDER BY "time", fid'
        for fid, geom, *values in self._query(sql + order, where.values()):
            data = dict(zip(names, values, strict=True))
            data["probabilities"] = json.loads(data["probabilities"] or "{}")
            out.append(Correction(**data, geometry=_geometry(geom), fid=fid))
        return out

    def latest(self, **where: Any) -> dict[tuple[str, str], Correction]:
        """``(scene, uid)`` -> the latest correction of each building matching ``where``."""
        return {c.key: c for c in self.rows(**where)}

    def history(self, scene: str, uid: str) -> list[Correction]:
        """Every correction of one building, oldest first."""
        return self.rows(scene=scene, uid=uid)

    def check(self) -> str:
        """SQLite's integrity check of the store (``ok`` when sound)."""
        return str(self._query("PRAGMA integrity_check")[0][0])
