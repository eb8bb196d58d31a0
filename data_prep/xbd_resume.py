"""`prepare xbd --resume`: what an earlier run into the same chip store finished (no torch).

Every tile job of `prepare xbd` writes, after its shard pair, a sidecar
``shards/<tile>.rows.json`` (atomically, last) with the options its chips depend on, its input
files (path, size, modification time), its manifest rows and its report. A resumed run reads
back the tiles whose sidecar and shards exist and whose inputs are unchanged, instead of cutting
them again, and refuses a store prepared with other options.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from data_prep.errors import LocalDamageError
from data_prep.report import PrepareReport
from data_prep.spec import ChipSpec
from data_prep.store import SHARDS, STORE_META, safe_name


class ResumeError(LocalDamageError, ValueError):
    """``--resume`` into a store prepared with other options; the message says which."""


#: Suffix of a tile's sidecar in ``shards/``: its manifest rows and report (:func:`cut_tile`).
SIDECAR = ".rows.json"


def sidecar_path(out: str | os.PathLike, tile_name: str) -> Path:
    """``out/shards/<tile>.rows.json``: what :func:`cut_tile` made of the tile."""
    return Path(out) / SHARDS / f"{safe_name(tile_name)}{SIDECAR}"


def tile_options(spec: ChipSpec, include_unclassified: bool, max_pixels: int | None) -> dict:
    """The options a tile's chips depend on, as recorded in its sidecar."""
    return {
        "spec": spec.to_dict(),
        "include_unclassified": bool(include_unclassified),
        "max_pixels": max_pixels,
    }


def tile_inputs(tile) -> dict:
    """Path, size and modification time of the files of a :class:`data_prep.xbd_tiles.XbdTile`
    (None when missing)."""
    out = {}
    for kind, path in (("pre", tile.pre), ("post", tile.post), ("label", tile.label)):
        try:
            st = path.stat() if path is not None else None
        except OSError:
            st = None
        out[kind] = None if st is None else [str(path), st.st_size, st.st_mtime_ns]
    return out


def finished_tiles(
    out: Path, tiles: Sequence, options: dict
) -> dict[str, tuple[list[dict], PrepareReport]]:
    """``(rows, report)`` by tile name of the tiles an earlier run into ``out`` finished: a
    sidecar naming the same input files (same size and time), and every shard its rows name.

    Raises:
        ResumeError: the store, or a tile's sidecar, was prepared with other options.
    """
    meta_path = out / STORE_META
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("source") != "xbd":
            raise ResumeError(
                f"{out} holds a chip store prepared from {meta.get('source')!r}, not xBD; "
                "choose another --out, or leave out --resume to replace it"
            )
        recorded = {k: meta.get(k) for k in ("spec", "include_unclassified")}
        _check_options(out, recorded, {k: options[k] for k in recorded})
    done = {}
    for tile in tiles:
        path = sidecar_path(out, tile.name)
        if not path.is_file():
            continue
        try:
            side = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # unreadable: cut the tile again
        _check_options(path, side.get("options"), options)
        rows = side.get("rows", [])
        files = {out / row[k] for row in rows for k in ("pre_file", "post_file")}
        if side.get("inputs") != tile_inputs(tile) or not all(f.is_file() for f in files):
            continue
        done[tile.name] = (rows, PrepareReport.from_dict(side["report"]))
    return done


def _check_options(where: Path, recorded: dict | None, options: dict) -> None:
    if recorded == options:
        return
    recorded = recorded or {}
    differ = [
        f"{k} {json.dumps(recorded.get(k), sort_keys=True)} (now {json.dumps(v, sort_keys=True)})"
        for k, v in options.items()
        if recorded.get(k) != v
    ]
    raise ResumeError(
        f"cannot resume: {where} was prepared with other options: {'; '.join(differ)}; run with "
        "the same options, or leave out --resume to prepare every tile again"
    )
