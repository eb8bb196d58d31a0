"""The chip store: per-tile shards of uint8 chips plus one manifest.csv.

Layout of a store ``CHIPS/``::

    CHIPS/manifest.csv            one row per building (see MANIFEST_COLUMNS)
    CHIPS/store.json              chip spec, source and per-class/per-event counts
    CHIPS/shards/<tile>_pre.npy   uint8 [n, chip_size, chip_size, 3], row i = manifest index i
    CHIPS/shards/<tile>_post.npy  the same buildings cut from the post image
    CHIPS/shards/<tile>.rows.json `prepare xbd` only: the tile's rows and report, for --resume

Shards are plain NumPy arrays: lossless, no decode on read, and each chip at a known offset, so
a training loader reads only the chips it draws (:class:`ChipReader`, one ``pread`` per chip). Every file is written under a temporary name and renamed
into place; the manifest is written last, so an interrupted run never leaves a manifest that points
at missing or partial shards.
"""

from __future__ import annotations

import csv
import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np

from data_prep.errors import LocalDamageError

MANIFEST = "manifest.csv"
STORE_META = "store.json"
SHARDS = "shards"


class StoreError(LocalDamageError, ValueError):
    """A chip store that cannot serve what was asked of it (no chips in a fold, stale splits, an
    unknown fold); the message names the store file and what to do."""


class StoreNotFoundError(LocalDamageError, FileNotFoundError):
    """A chip store file that does not exist yet (``manifest.csv``, ``splits.csv``); the message
    names the command that makes it."""


MANIFEST_COLUMNS: tuple[str, ...] = (
    "chip_id",  # unique: <tile>:<uid or running number>
    "event",  # disaster/event name
    "tile",  # source tile or scene name; the unit of grouped splits
    "uid",  # building id from the labels/footprints
    "label",  # class id 0-3, -1 when unlabelled
    "label_name",  # class name, empty when unlabelled
    "bbox_minx",  # footprint bounds in pixels of the source (pre) image
    "bbox_miny",
    "bbox_maxx",
    "bbox_maxy",
    "win_col",  # chip window in pixels of the source (pre) image
    "win_row",
    "win_size",
    "lon",  # geographic centroid (EPSG:4326), empty when unknown
    "lat",
    "pre_file",  # shard path relative to the store root
    "post_file",
    "index",  # row within the shards
)


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


@contextmanager
def _temporary_beside(path: str | os.PathLike, suffix: str):
    """Yield ``(fd, tmp)`` of a new temporary file next to ``path`` (mode 0600, open); on
    success set the usual permissions and rename it onto ``path``, on any failure remove it.
    The caller closes ``fd`` (or hands it to a file object that does)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:  # everything from creating the temporary onwards, so an interrupt never leaks it
        fd, tmp = tempfile.mkstemp(
            prefix=f".{path.name}.", suffix=suffix or ".tmp", dir=path.parent
        )
        yield fd, tmp
        # mkstemp makes 0600, and some writers (safetensors) replace the file with another 0600
        # one; set the usual permissions on whatever the writer left
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ""):
    """Yield a temporary path next to ``path``; rename it onto ``path`` only on success."""
    with _temporary_beside(path, suffix) as (fd, tmp):
        os.close(fd)
        yield Path(tmp)


@contextmanager
def atomic_file(path: str | os.PathLike, suffix: str = "", text: bool = False):
    """Yield a file open for writing under a temporary name next to ``path``; rename it onto
    ``path`` only on success. The same as :func:`atomic_path` with the writer opening the file,
    but writing through the temporary's own descriptor (two system calls fewer per file: a
    `prepare xbd` writes three files a tile)."""
    options = {"newline": "", "encoding": "utf-8"} if text else {}
    with (
        _temporary_beside(path, suffix) as (fd, _),
        open(fd, "w" if text else "wb", **options) as fh,
    ):
        yield fh


def safe_name(name: str) -> str:
    """A file-name-safe version of a tile or scene name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "tile"


def write_shard(
    root: str | os.PathLike, name: str, pre: np.ndarray, post: np.ndarray
) -> tuple[str, str]:
    """Write one tile's chips atomically; return the (pre, post) paths relative to ``root``."""
    if pre.shape != post.shape or pre.dtype != np.uint8 or post.dtype != np.uint8:
        raise ValueError(
            f"pre/post chips must be uint8 of equal shape, got {pre.shape} {pre.dtype} and {post.shape} {post.dtype}"
        )
    rel = []
    for kind, arr in (("pre", pre), ("post", post)):
        relpath = f"{SHARDS}/{safe_name(name)}_{kind}.npy"
        with atomic_file(Path(root) / relpath, suffix=".npy") as fh:
            np.save(fh, np.ascontiguousarray(arr))
        rel.append(relpath)
    return rel[0], rel[1]


def write_json(path: str | os.PathLike, obj: object, indent: int | None = 2) -> None:
    """Write JSON atomically (``indent=None``: one compact line, which the C encoder writes
    many times faster than the indented form: use it for machine files with many rows)."""
    with atomic_file(path, suffix=".json", text=True) as fh:
        fh.write(json.dumps(obj, indent=indent, sort_keys=True, default=str) + "\n")


def write_manifest(
    root: str | os.PathLike, rows: Iterable[Mapping], meta: Mapping | None = None
) -> Path:
    """Write ``manifest.csv`` (and ``store.json`` when ``meta`` is given) atomically."""
    root = Path(root)
    if meta is not None:
        write_json(root / STORE_META, dict(meta))
    out = root / MANIFEST
    named: set[str] = set()
    with atomic_file(out, suffix=".csv", text=True) as fh:
        writer = csv.writer(fh)
        writer.writerow(MANIFEST_COLUMNS)
        for row in rows:
            named.update(str(row[k]) for k in ("pre_file", "post_file") if row.get(k))
            writer.writerow(["" if (v := row.get(k)) is None else v for k in MANIFEST_COLUMNS])
    prune_shards(root, named)
    return out


def prune_shards(root: str | os.PathLike, named: set[str]) -> list[Path]:
    """Remove shard files of an earlier run that the new manifest no longer names (a rerun
    over fewer tiles would otherwise leave them behind); returns the removed paths."""
    root = Path(root)
    removed = []
    for path in sorted((root / SHARDS).glob("*.npy")):
        if f"{SHARDS}/{path.name}" not in named:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def start_store(root: str | os.PathLike) -> Path:
    """Prepare ``root`` for a new run: create it and remove a previous manifest, so that a run
    interrupted before its end leaves no manifest pointing at shards it may have replaced."""
    root = Path(root)
    (root / SHARDS).mkdir(parents=True, exist_ok=True)
    (root / MANIFEST).unlink(missing_ok=True)
    return root


def read_manifest(root: str | os.PathLike):
    """The manifest as a pandas DataFrame (label as int, lon/lat as float with NaN when unknown).

    Raises:
        StoreNotFoundError: the store has no manifest.
        StoreError: the manifest cannot be read as one (a damaged or foreign file).
    """
    import pandas as pd

    path = Path(root) / MANIFEST
    if not path.is_file():
        raise StoreNotFoundError(
            f"{path}: no manifest; run `local-damage prepare` to create a chip store"
        )
    try:
        df = pd.read_csv(
            path,
            dtype={"chip_id": str, "event": str, "tile": str, "uid": str, "label_name": str},
            keep_default_na=False,
            na_values={"lon": [""], "lat": [""]},
        )
        df["label"] = df["label"].astype(int)
    except (ValueError, KeyError, UnicodeDecodeError) as exc:  # pandas' parser errors included
        raise StoreError(
            f"{path}: not a readable chip-store manifest ({type(exc).__name__}: {exc}); "
            "run `local-damage prepare` again into a new folder"
        ) from exc
    return df


def read_meta(root: str | os.PathLike) -> dict:
    """``store.json`` of a chip store (its chip spec and options); empty when there is none.

    Raises:
        StoreError: the file is not JSON (a damaged or foreign file).
    """
    path = Path(root) / STORE_META
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise StoreError(
            f"{path}: not a readable chip-store description ({exc}); run `local-damage prepare` "
            "again into a new folder"
        ) from exc


class ChipReader:
    """Random access to the chips of a store: each chip read from its shard with one ``pread``.

    A shard's ``.npy`` header is read once (its layout is cached: a few numbers per shard) and
    at most :attr:`max_open` shard files are held open, least recently used closed first. Nothing
    is memory-mapped, so a reader's memory stays flat however many chips and shards it reads (a
    training loader worker reading every chip of a 200,000-chip store for an epoch holds no more
    than one reading a few), and the operating system's page cache does the caching.
    """

    #: Shard files held open at once.
    max_open = 64

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._layout: dict[str, tuple[int, tuple[int, ...], np.dtype, int]] = {}
        self._open: dict[str, int] = {}  # relative path -> file descriptor, oldest first

    def _fd(self, rel: str) -> int:
        fd = self._open.pop(rel, None)
        if fd is None:
            path = self.root / rel
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError as exc:
                raise StoreNotFoundError(f"{path}: shard file not found") from exc
            if rel not in self._layout:
                try:
                    self._layout[rel] = _npy_layout(fd)
                except ValueError as exc:
                    os.close(fd)
                    raise StoreError(f"{path}: not a readable chip shard ({exc})") from exc
            while len(self._open) >= self.max_open:
                os.close(self._open.pop(next(iter(self._open))))
        self._open[rel] = fd  # now the most recently used
        return fd

    def chip(self, rel: str, i: int) -> np.ndarray:
        """Chip ``i`` of the shard at ``rel`` (relative to the store), a fresh array."""
        fd = self._fd(rel)
        offset, shape, dtype, nbytes = self._layout[rel]
        if not 0 <= i < shape[0]:
            raise StoreError(f"{self.root / rel}: no chip {i} in a shard of {shape[0]}")
        out = np.empty(shape[1:], dtype=dtype)
        if hasattr(os, "preadv"):  # straight into the array
            got = os.preadv(fd, [memoryview(out).cast("B")], offset + i * nbytes)
        else:
            data = os.pread(fd, nbytes, offset + i * nbytes)
            got = len(data)
            out.reshape(-1).view(np.uint8)[:got] = np.frombuffer(data, np.uint8)
        if got != nbytes:
            raise StoreError(f"{self.root / rel}: truncated shard (chip {i} is cut short)")
        return out

    def pair(self, row: Mapping) -> tuple[np.ndarray, np.ndarray]:
        """The (pre, post) uint8 [S, S, 3] chips of one manifest row."""
        return self.read(row["pre_file"], row["post_file"], int(row["index"]))

    def read(self, pre_file: str, post_file: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The (pre, post) chips at ``index`` of two shards."""
        return self.chip(pre_file, index), self.chip(post_file, index)

    def close(self) -> None:
        """Close the shard files held open."""
        while self._open:
            os.close(self._open.popitem()[1])

    def __getstate__(self) -> dict:  # open files stay with the process that opened them
        return {"root": self.root, "_layout": dict(self._layout), "_open": {}}

    def __del__(self) -> None:
        with suppress(OSError, AttributeError):
            self.close()


def _npy_layout(fd: int) -> tuple[int, tuple[int, ...], np.dtype, int]:
    """``(data offset, shape, dtype, bytes per chip)`` of the C-ordered ``.npy`` file open as
    ``fd``; ValueError when it is not one."""
    from numpy.lib import format as npy

    with os.fdopen(os.dup(fd), "rb") as fh:
        version = npy.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = npy.read_array_header_1_0(fh)
        else:
            shape, fortran, dtype = npy.read_array_header_2_0(fh)
        offset = fh.tell()
    if fortran or not shape or dtype.hasobject:
        raise ValueError("a shard is a C-ordered array of chips")
    return offset, tuple(shape), dtype, int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
