"""xBD tiles with label JSON to a chip store (``local-damage prepare xbd``).

The tiles are found and their labels read by :mod:`data_prep.xbd_tiles`. Each tile's pre and
post images are decoded once and every building is cut from the arrays
(:func:`data_prep.windows.cut_building`); tiles run as jobs on :mod:`data_prep.engine`, each
writing its own shard pair and sidecar (:mod:`data_prep.xbd_resume`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep import quality
from data_prep.engine import Bar, Engine, JobFailed, map_jobs, task_count, tune_malloc
from data_prep.imagery import ImageError, split_file_message
from data_prep.quality import blank_reasons
from data_prep.report import PrepareReport
from data_prep.spec import CLASS_NAMES, ChipSpec
from data_prep.store import SHARDS, safe_name, start_store, write_json, write_manifest, write_shard
from data_prep.windows import cut_building
from data_prep.xbd_resume import (
    SIDECAR,
    finished_tiles,
    sidecar_path,
    tile_inputs,
    tile_options,
)
from data_prep.xbd_tiles import (
    Building,
    XbdTile,
    find_tiles,
    parse_buildings,
    read_tile_pair,
)

_BUFFERS = threading.local()


def _chip_buffers(n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Two uint8 [n, size, size, 3] scratch arrays, reused from tile to tile in this thread.

    Fresh arrays of a few MB per tile would be page-faulted and zeroed by the kernel each time;
    reusing them saves that. The contents are only valid until the next call.
    """
    need = n * size * size * 3
    bufs = getattr(_BUFFERS, "arrays", None)
    if bufs is None or bufs[0].size < need:
        bufs = _BUFFERS.arrays = tuple(np.empty(max(need, 1 << 22), np.uint8) for _ in range(2))
    return tuple(b[:need].reshape(n, size, size, 3) for b in bufs)


def cut_tile(
    tile: XbdTile,
    out: str | os.PathLike,
    spec: ChipSpec,
    include_unclassified: bool = False,
    max_pixels: int | None = None,
) -> tuple[list[dict], PrepareReport]:
    """Cut every building of one tile into a shard pair under ``out``, then write the tile's
    sidecar ``shards/<tile>.rows.json`` (atomically, last): its options, input files, manifest
    rows and report, which ``prepare xbd --resume`` reads back instead of cutting the tile again.

    Args and returns: as :func:`cut_tile_rows`.
    """
    rows, report = cut_tile_rows(tile, out, spec, include_unclassified, max_pixels)
    write_json(
        sidecar_path(out, tile.name),
        {
            "tile": tile.name,
            "options": tile_options(spec, include_unclassified, max_pixels),
            "inputs": tile_inputs(tile),
            "rows": rows,
            "report": report.to_dict(),
        },
        indent=None,  # one line: indenting the rows took ~12% of a one-worker `prepare xbd`
    )
    return rows, report


def cut_tile_rows(
    tile: XbdTile,
    out: str | os.PathLike,
    spec: ChipSpec,
    include_unclassified: bool = False,
    max_pixels: int | None = None,
) -> tuple[list[dict], PrepareReport]:
    """Cut every building of one tile into a shard pair under ``out`` (no sidecar).

    Args:
        tile: the tile's files.
        out: chip store root (``start_store`` already called).
        spec: the chip specification.
        include_unclassified: keep un-classified buildings as unlabelled (label -1).
        max_pixels: pixel limit per image (:func:`data_prep.quality.max_pixels`).

    Returns:
        ``(rows, report)``: manifest rows in label-file order and this tile's report. Problems
        with the tile are recorded in the report, never raised.
    """
    report = PrepareReport()
    if tile.pre is None or tile.post is None:
        have, missing = ("pre", "post") if tile.post is None else ("post", "pre")
        if tile.pre is None and tile.post is None:
            report.skip(
                str(tile.label),
                f"no pre or post image {tile.name}_{{pre,post}}_disaster.png/.tif "
                f"in {tile.images_dir}; tile skipped",
            )
        else:
            existing = tile.pre if tile.post is None else tile.post
            report.skip(
                str(existing),
                f"{missing}-disaster partner image {tile.name}_{missing}_disaster.png/.tif not "
                f"found in {tile.images_dir}; tile skipped (only the {have} image is present)",
            )
        return [], report
    if not tile.label_exists:
        report.skip(
            str(tile.label), f"label file not found (needed for tile {tile.name}); tile skipped"
        )
        return [], report
    try:
        event, buildings = parse_buildings(tile.label, report, include_unclassified)
    except (OSError, ValueError) as exc:
        report.skip(str(tile.label), f"{exc}; tile skipped")
        return [], report
    event = event or tile.event
    if not buildings:
        return [], report

    try:
        pre, post = read_tile_pair(tile.pre, tile.post, max_pixels)
    except Exception as exc:  # ImageError, or a decoder error of another kind
        path, reason = split_file_message(str(exc), (tile.pre, tile.post))
        if path is None and not isinstance(exc, ImageError):
            reason = f"cannot be read as an image ({type(exc).__name__}: {reason})"
        report.skip(str(path or tile.pre), f"{reason}; tile skipped")
        return [], report
    if pre.shape != post.shape:
        report.skip(
            str(tile.post),
            f"is {post.shape[1]}x{post.shape[0]} px but the pre image {tile.pre} is "
            f"{pre.shape[1]}x{pre.shape[0]} px; tile skipped",
        )
        return [], report

    height, width = pre.shape[:2]
    size = spec.chip_size
    pre_chips, post_chips = _chip_buffers(len(buildings), size)
    # every building cut first, then the blank check over the tile's chips at once; the report
    # keeps label-file order (``cut`` holds a chip slot, or None for a skipped building)
    cut: list[tuple[Building, int | None, tuple[int, int, int] | str]] = []
    n = 0
    for b in buildings:
        chips = cut_building(pre, post, b, spec, out=(pre_chips[n], post_chips[n]))
        if chips is None:
            minx, miny, maxx, maxy = b.bbox
            cut.append(
                (
                    b,
                    None,
                    f"polygon bounds ({minx:.1f}, {miny:.1f}, {maxx:.1f}, {maxy:.1f}) lie "
                    f"entirely outside the {width}x{height} px tile",
                )
            )
            continue
        window = chips.window
        cut.append((b, n, (window.col_off, window.row_off, window.size)))
        n += 1
    blanks = blank_reasons(pre_chips[:n], post_chips[:n])
    kept: list[tuple[Building, tuple[int, int, int]]] = []
    slots: list[int] = []
    for b, slot, what in cut:
        reason = what if slot is None else blanks[slot]
        if reason:
            report.skip(f"{tile.label} building {b.uid}", reason)
            continue
        kept.append((b, what))
        slots.append(slot)
    if len(slots) < n:  # blank chips dropped: close the gaps, in order
        pre_chips[: len(slots)] = pre_chips[slots]
        post_chips[: len(slots)] = post_chips[slots]
    if not kept:
        return [], report

    pre_file, post_file = write_shard(
        out, tile.name, pre_chips[: len(kept)], post_chips[: len(kept)]
    )
    rows = []
    for index, (b, (col, row, win)) in enumerate(kept):
        minx, miny, maxx, maxy = b.bbox
        lon, lat = (round(b.lonlat[0], 8), round(b.lonlat[1], 8)) if b.lonlat else (None, None)
        rows.append(
            {
                "chip_id": f"{tile.name}:{b.uid}",
                "event": event,
                "tile": tile.name,
                "uid": b.uid,
                "label": b.label,
                "label_name": CLASS_NAMES[b.label] if b.label >= 0 else "",
                "bbox_minx": round(minx, 3),
                "bbox_miny": round(miny, 3),
                "bbox_maxx": round(maxx, 3),
                "bbox_maxy": round(maxy, 3),
                "win_col": col,
                "win_row": row,
                "win_size": win,
                "lon": lon,
                "lat": lat,
                "pre_file": pre_file,
                "post_file": post_file,
                "index": index,
            }
        )
        report.add_chip(event, b.label)
    return rows, report


def _cut_tile_task(args: tuple) -> tuple[list[dict], PrepareReport]:
    worker_setup()
    return cut_tile(*args)


def worker_setup() -> None:
    """Set up the process a tile job runs in: one OpenCV thread (tiles are the unit of
    parallelism) and the allocator keeping decoded tiles' memory for the next
    (:func:`data_prep.engine.tune_malloc`)."""
    import cv2

    cv2.setNumThreads(1)
    tune_malloc()


def run_tiles(
    func,
    args: Iterable,
    engine: Engine | None = None,
    progress: bool | None = None,
    desc: str = "tiles",
    costs: Sequence[float] | None = None,
) -> list:
    """Apply ``func`` to each argument, one job per tile (:mod:`data_prep.engine`; on a cluster
    the tiles go in groups of similar cost, :func:`data_prep.engine.task_count` tasks); results
    in input order.

    Args:
        func: a picklable function of one argument, that records its own problems rather than
            raising (a job that raises, or whose worker keeps dying, gives a
            :class:`data_prep.engine.JobFailed`).
        args: one argument per tile.
        engine: where the jobs run (default ``Engine()``: in this process, with one OpenCV
            thread); an embedded cluster never starts more workers than there are tiles, and
            a given ``client`` (e.g. kept open across runs) is used as it is.
        progress: show a tqdm bar over tiles (None: only when stderr is a terminal).
        desc: the progress bar's label.
        costs: expected work per argument; the costliest start first, so that no large tile is
            left running alone at the end.
    """
    args = list(args)
    options = dict(bar=Bar(desc, "tile", progress), costs=costs)
    with (engine or Engine()).open(len(args)) as cluster:
        if cluster is not None:
            tasks = task_count(cluster, len(args))
            return map_jobs(func, args, client=cluster, tasks=tasks, **options)
        import cv2

        threads = cv2.getNumThreads()
        cv2.setNumThreads(1)  # one worker means one core, as on the cluster's workers
        try:
            return map_jobs(func, args, **options)
        finally:
            cv2.setNumThreads(threads)


#: A tile's decoding costs about as much as cutting the buildings of this many bytes of label
#: file (a least-squares fit of per-tile times against label size on the xBD sample: about
#: 18 ms a tile plus 0.19 us a byte; label bytes alone misjudged a tile by 32% on average, this
#: by 9%).
DECODE_COST_BYTES = 100_000


def _tile_cost(tile: XbdTile) -> int:
    """Expected work of cutting a tile, in label bytes: decoding both images plus the label
    file's size, a cheap proxy for its number of buildings (used to balance the workers)."""
    try:
        size = tile.label.stat().st_size if tile.label_exists else 0
    except OSError:
        return 0
    return size + DECODE_COST_BYTES if tile.pre is not None and tile.post is not None else size


@dataclass(frozen=True)
class XbdOptions:
    """Which tiles and buildings `prepare xbd` cuts, and what it makes of an earlier run; the
    roots, the store, the chip specification and where the jobs run are :func:`prepare_xbd`'s
    arguments.

    Attributes:
        include_unclassified: keep un-classified buildings as unlabelled chips (label -1).
        limit: use only the first ``limit`` tiles (sorted by name; None: all).
        max_pixels: pixel limit per image, checked from the header before decoding (None:
            :func:`data_prep.quality.max_pixels`).
        resume: reuse the tiles an earlier run into the store finished (their sidecar and both
            shards exist, and their files are unchanged) instead of cutting them again; the
            store is the same as after an uninterrupted run. Without it every tile is cut and
            the sidecars of earlier runs are removed first.
    """

    include_unclassified: bool = False
    limit: int | None = None
    max_pixels: int | None = None
    resume: bool = False


def prepare_xbd(
    roots: Sequence[str | os.PathLike] | str | os.PathLike,
    out: str | os.PathLike,
    spec: ChipSpec | None = None,
    options: XbdOptions | None = None,
    *,
    engine: Engine | None = None,
    progress: bool | None = None,
) -> PrepareReport:
    """Cut per-building pre/post chip pairs from xBD tiles into a chip store.

    Every tile's pre and post image is decoded once; each building's window
    (``chip_window`` of its polygon centroid and bbox) is cut boundless from both and resampled
    to ``spec.chip_size``. One shard pair per tile; ``manifest.csv`` rows are sorted by tile and
    then by building order in the label file, whatever the number of workers. Bad tiles and
    buildings are skipped and listed in the report.

    Args:
        roots: xBD root folder(s).
        out: output chip store folder.
        spec: chip specification (default ``ChipSpec()``).
        options: the tiles and buildings cut, the pixel limit, resuming (default
            ``XbdOptions()``).
        engine: where the jobs run, one job per tile (default ``Engine()``: in this process;
            :mod:`data_prep.engine`). The workers of an existing scheduler must see ``roots``
            and ``out`` at the same paths.
        progress: show a progress bar (None: only when stderr is a terminal).

    Returns:
        The run's report (chips per class and event, skipped items).

    Raises:
        XbdRootError: a root does not exist or holds no xBD tiles.
        data_prep.xbd_resume.ResumeError: ``resume`` into a store prepared with other options.
    """
    spec = spec or ChipSpec()
    options = options or XbdOptions()
    include_unclassified, limit = options.include_unclassified, options.limit
    max_pixels = quality.max_pixels(options.max_pixels)
    # absolute paths: the jobs may run in worker processes with another working directory
    roots = [roots] if isinstance(roots, (str, os.PathLike)) else list(roots)
    roots = [Path(r).absolute() for r in roots]
    tiles, duplicates = find_tiles(roots)
    if limit is not None:
        tiles = tiles[: max(int(limit), 0)]
    out = Path(out).absolute()
    recorded = tile_options(spec, include_unclassified, max_pixels)
    # checked before anything in the store changes
    done = finished_tiles(out, tiles, recorded) if options.resume else {}
    out = start_store(out)
    if not options.resume:
        for path in (out / SHARDS).glob(f"*{SIDECAR}"):
            path.unlink(missing_ok=True)
    report = PrepareReport()
    for item, reason in duplicates:
        report.skip(item, reason)
    todo = [t for t in tiles if t.name not in done]
    cut = run_tiles(
        _cut_tile_task,
        [(t, out, spec, include_unclassified, max_pixels) for t in todo],
        engine,
        progress=progress,
        desc="prepare xbd",
        costs=[_tile_cost(t) for t in todo],
    )
    _BUFFERS.arrays = None
    by_name = dict(done)
    by_name.update((t.name, r) for t, r in zip(todo, cut, strict=True))
    results = [by_name[t.name] for t in tiles]
    report.reused = len(done)
    rows: list[dict] = []
    for tile, result in zip(tiles, results, strict=True):
        if isinstance(result, JobFailed):
            report.skip(str(tile.label), f"tile {tile.name} not prepared: {result.error}")
            continue
        tile_rows, tile_report = result
        rows.extend(tile_rows)
        report.merge(tile_report)
    meta = {
        "source": "xbd",
        "spec": spec.to_dict(),
        "roots": [str(Path(r).resolve()) for r in roots],
        "include_unclassified": include_unclassified,
        "tiles": len(tiles),
        "report": report.to_dict(),
    }
    write_manifest(out, rows, meta)
    current = {f"{safe_name(t.name)}{SIDECAR}" for t in tiles}
    for path in (out / SHARDS).glob(f"*{SIDECAR}"):  # tiles no longer in the run
        if path.name not in current:
            path.unlink(missing_ok=True)
    # a sidecar's temporary left by a worker killed while writing it (the tile was cut again)
    for path in (out / SHARDS).glob(f".*{SIDECAR}.*"):
        path.unlink(missing_ok=True)
    return report
