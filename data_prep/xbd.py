"""xBD tiles with label JSON to a chip store (``local-damage prepare xbd``).

xBD as distributed holds ``ROOT/images/<event>_<id>_{pre,post}_disaster.{png,tif}`` with
``ROOT/labels/<same>.json``, or the same under the split folders
``ROOT/{train,tier3,test,hold}/``. Building polygons come from the post label's ``features.xy``
(pixel WKT) and their damage class from ``properties.subtype``; ``features.lng_lat`` gives the
geographic centroid. Each tile's pre and post images are decoded once and every building is cut
from the arrays; tiles run in parallel worker processes, each writing its own shard pair.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep import quality
from data_prep.engine import JobFailed
from data_prep.errors import LocalDamageError
from data_prep.imagery import ImageError, read_rgb, read_rgb_pair, split_file_message
from data_prep.quality import BLANK, blank_reasons
from data_prep.report import PrepareReport
from data_prep.spec import CLASS_NAMES, UNCLASSIFIED, UNLABELLED, ChipSpec, parse_label
from data_prep.store import SHARDS, safe_name, start_store, write_json, write_manifest, write_shard
from data_prep.windows import chip_window, cut_chip
from data_prep.xbd_resume import (
    SIDECAR,
    finished_tiles,
    sidecar_path,
    tile_inputs,
    tile_options,
)

#: Split folders of the distributed xBD release, searched below each root.
SPLITS: tuple[str, ...] = ("train", "tier3", "test", "hold")
_IMAGE_NAME = re.compile(
    r"^(?P<tile>.+)_(?P<phase>pre|post)_disaster\.(?P<ext>png|tiff?)$", re.IGNORECASE
)
_LABEL_NAME = re.compile(r"^(?P<tile>.+)_post_disaster\.json$", re.IGNORECASE)


class XbdRootError(LocalDamageError, ValueError):
    """An xBD root that does not exist or holds no xBD tiles; the message names the folder."""


@dataclass(frozen=True)
class XbdTile:
    """The files of one xBD tile; a path is None when the file is missing.

    Attributes:
        name: file stem without ``_post_disaster`` (e.g. ``guatemala-volcano_00000003``).
        pre: pre-disaster image.
        post: post-disaster image.
        label: post-disaster label JSON (the expected path when it is missing).
        label_exists: whether ``label`` was found.
        images_dir: the folder the images are (or would be) in.
    """

    name: str
    pre: Path | None
    post: Path | None
    label: Path
    label_exists: bool
    images_dir: Path

    @property
    def event(self) -> str:
        """Event from the file-name prefix (the label's ``metadata.disaster`` takes precedence)."""
        return self.name.rsplit("_", 1)[0] if "_" in self.name else self.name


@dataclass
class Building:
    """One building of a post label: pixel geometry summary, class and geographic centroid."""

    uid: str
    label: int
    centroid: tuple[float, float]  # (x, y) pixels
    bbox: tuple[float, float, float, float]  # (minx, miny, maxx, maxy) pixels
    lonlat: tuple[float, float] | None


def _image_dirs(root: Path) -> list[Path]:
    dirs = [root / "images"] + [root / split / "images" for split in SPLITS]
    extra = sorted(p for p in root.glob("*/images") if p.parent.name not in SPLITS)
    return [d for d in dirs + extra if d.is_dir()]


def find_tiles(
    roots: Sequence[str | os.PathLike] | str | os.PathLike,
) -> tuple[list[XbdTile], list[tuple[str, str]]]:
    """Find the xBD tiles below one or more roots.

    Looks in ``ROOT/images`` + ``ROOT/labels`` and in ``ROOT/<split>/images`` + ``labels`` for
    every split folder (``train``, ``tier3``, ``test``, ``hold`` or any other folder holding an
    ``images`` folder). A tile is known from any of its pre image, post image or post label.

    Args:
        roots: one root folder or several.

    Returns:
        ``(tiles, duplicates)``: tiles sorted by name, and ``(file, reason)`` for tiles whose name
        was already found under an earlier root (they are left out).

    Raises:
        XbdRootError: a root does not exist, is not a folder or holds no xBD tiles.
    """
    if isinstance(roots, (str, os.PathLike)):
        roots = [roots]
    found: dict[str, XbdTile] = {}
    duplicates: list[tuple[str, str]] = []
    for root in map(Path, roots):
        if not root.exists():
            raise XbdRootError(f"{root}: xBD root folder does not exist")
        if not root.is_dir():
            raise XbdRootError(f"{root}: xBD root is not a folder")
        here: dict[str, dict] = {}
        seen_any = False
        for images_dir in _image_dirs(root):
            labels_dir = images_dir.parent / "labels"
            entries: dict[str, dict] = {}
            for path in sorted(images_dir.iterdir()):
                m = _IMAGE_NAME.match(path.name)
                if m and path.is_file():
                    slot = entries.setdefault(m["tile"], {})
                    phase = m["phase"].lower()
                    # prefer PNG over TIFF when both are present (sorted: .png before .tif)
                    slot.setdefault(phase, path)
            if labels_dir.is_dir():
                for path in sorted(labels_dir.iterdir()):
                    m = _LABEL_NAME.match(path.name)
                    if m:
                        entries.setdefault(m["tile"], {})["label"] = path
            seen_any = seen_any or bool(entries)
            for name, slot in entries.items():
                if name in here or name in found:
                    first = here.get(name, {}).get("dir") or found[name].images_dir
                    duplicates.append(
                        (
                            str(images_dir / name),
                            f"tile name already found in {first}; this copy is left out",
                        )
                    )
                    continue
                slot["dir"] = images_dir
                slot["labels_dir"] = labels_dir
                here[name] = slot
        if not seen_any:
            raise XbdRootError(
                f"{root}: no xBD tiles found; expected images/<event>_<id>_pre_disaster.png (or .tif) "
                f"with labels/<event>_<id>_post_disaster.json, directly or under {'/, '.join(SPLITS)}/"
            )
        for name, slot in here.items():
            label = slot.get("label") or slot["labels_dir"] / f"{name}_post_disaster.json"
            found[name] = XbdTile(
                name, slot.get("pre"), slot.get("post"), label, "label" in slot, slot["dir"]
            )
    return sorted(found.values(), key=lambda t: t.name), duplicates


def _load_json(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            data = json.loads(fh.read())
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"not valid JSON (not UTF-8 text: {exc.reason})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("features"), dict):
        raise ValueError("not an xBD label file (no 'features' object)")
    return data


def _point_xy(points: np.ndarray) -> np.ndarray:
    """[N, 2] (x, y) of an array of shapely points, NaN where a point is missing or empty."""
    import shapely

    out = np.full((len(points), 2), np.nan)
    coords, index = shapely.get_coordinates(points, return_index=True)
    out[index] = coords
    return out


def parse_buildings(
    path: Path,
    report: PrepareReport,
    include_unclassified: bool = False,
    ignore_labels: bool = False,
) -> tuple[str | None, list[Building]]:
    """Read the buildings of one post-disaster label file.

    Buildings with invalid WKT, an empty polygon, an unknown subtype or a repeated uid are
    skipped into ``report``; un-classified ones are counted as excluded unless
    ``include_unclassified`` (then they get label -1).

    Args:
        path: the ``*_post_disaster.json`` label file.
        report: where skipped and excluded buildings are recorded.
        include_unclassified: keep un-classified buildings as unlabelled.
        ignore_labels: read footprints only: every building gets label -1 whatever its subtype
            (also when it has none, as in pre-disaster label files), and none is excluded or
            skipped for its subtype (used when scoring).

    Returns:
        ``(event, buildings)``: the label's ``metadata.disaster`` (None when absent) and the
        buildings in file order.

    Raises:
        ValueError: the file is not JSON or not an xBD label file (message without the path).
    """
    import shapely
    from shapely.errors import ShapelyError

    data = _load_json(path)
    features = data["features"]
    xy = features.get("xy")
    if not isinstance(xy, list):
        raise ValueError("not an xBD label file (no 'features.xy' list)")
    meta = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    event = meta.get("disaster") or None

    lonlat_wkt: dict[str, str] = {}
    for f in features.get("lng_lat") or []:
        props = (f.get("properties") or {}) if isinstance(f, dict) else {}
        if "uid" in props and isinstance(f.get("wkt"), str):
            lonlat_wkt[str(props["uid"])] = f["wkt"]

    # validate properties first, then parse all WKT of the file in one vectorised call
    candidates: list[tuple[str, int, object]] = []
    seen: set[str] = set()
    for i, feature in enumerate(xy):
        props = (feature.get("properties") if isinstance(feature, dict) else None) or {}
        uid = str(props.get("uid") or f"#{i}")
        if props.get("feature_type", "building") != "building":
            continue
        subtype = props.get("subtype")
        if ignore_labels:
            label = UNLABELLED
        elif str(subtype).strip().lower() == UNCLASSIFIED:
            if not include_unclassified:
                report.excluded_unclassified += 1
                continue
            label = UNLABELLED
        else:
            try:
                label = parse_label(subtype)
            except ValueError as exc:
                report.skip(f"{path} building {uid}", str(exc))
                continue
            if label is None:
                report.skip(f"{path} building {uid}", "no damage subtype in the post label")
                continue
        if uid in seen:
            report.skip(
                f"{path} building {uid}",
                "uid repeated within the label file; only the first is used",
            )
            continue
        seen.add(uid)
        wkt = feature.get("wkt") if isinstance(feature, dict) else None
        candidates.append((uid, label, wkt if isinstance(wkt, str) else None))
    if not candidates:
        return event, []

    wkts = np.array([c[2] for c in candidates], dtype=object)
    geoms = shapely.from_wkt(wkts, on_invalid="ignore")
    bounds = shapely.bounds(geoms)
    centroids = shapely.centroid(geoms)
    cxy = _point_xy(centroids)
    geo_wkts = np.array([lonlat_wkt.get(c[0]) for c in candidates], dtype=object)
    geo_centroids = shapely.centroid(shapely.from_wkt(geo_wkts, on_invalid="ignore"))
    lonlats = _point_xy(geo_centroids)

    has_geom = (~shapely.is_missing(geoms)).tolist()
    has_bounds = np.isfinite(bounds).all(axis=1).tolist()
    has_centroid = np.isfinite(cxy).all(axis=1).tolist()
    has_lonlat = np.isfinite(lonlats).all(axis=1).tolist()
    bounds_l, cxy_l, lonlats_l = bounds.tolist(), cxy.tolist(), lonlats.tolist()
    buildings: list[Building] = []
    for k, (uid, label, wkt) in enumerate(candidates):
        if not has_geom[k] and wkt is not None:
            try:
                shapely.from_wkt(wkt)
                reason = "invalid WKT"
            except ShapelyError as exc:
                reason = f"invalid WKT ({exc})"
            report.skip(f"{path} building {uid}", reason)
            continue
        if not has_geom[k] or not has_bounds[k]:
            report.skip(f"{path} building {uid}", "empty or missing polygon WKT")
            continue
        minx, miny, maxx, maxy = bounds_l[k]
        if has_centroid[k]:
            centroid = (cxy_l[k][0], cxy_l[k][1])
        else:  # degenerate polygon without a centroid: use the bbox centre
            centroid = ((minx + maxx) / 2, (miny + maxy) / 2)
        lonlat = (lonlats_l[k][0], lonlats_l[k][1]) if has_lonlat[k] else None
        buildings.append(Building(uid, label, centroid, (minx, miny, maxx, maxy), lonlat))
    return event, buildings


def read_tile_image(path: str | os.PathLike, max_pixels: int | None = None) -> np.ndarray:
    """Decode one tile image into uint8 [H, W, 3] (the reader used by `prepare xbd` and its bench).

    rasterio/GDAL decodes xBD PNGs faster than OpenCV or PIL (see docs/benchmarks.md) and also
    reads GeoTIFFs, so it is used for every format.
    """
    return read_rgb(path, max_pixels)


def read_tile_pair(
    pre: str | os.PathLike, post: str | os.PathLike, max_pixels: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Decode a tile's pre and post images into uint8 [H, W, 3] under one radiometric rule
    (:func:`data_prep.imagery.read_rgb_pair`), refusing a blank image (every pixel one value).

    Raises:
        ImageError: naming the file at fault.
    """
    pre_rgb, post_rgb, _ = read_rgb_pair(pre, post, max_pixels)
    for path, image in ((pre, pre_rgb), (post, post_rgb)):
        if image.size and quality.is_constant(image):
            raise ImageError(
                f"{path}: {BLANK}: every pixel is {int(image.flat[0])} (an all-zero, nodata or "
                "constant-fill image holds nothing to grade)"
            )
    return pre_rgb, post_rgb


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
        minx, miny, maxx, maxy = b.bbox
        if maxx <= 0 or maxy <= 0 or minx >= width or miny >= height:
            cut.append(
                (
                    b,
                    None,
                    f"polygon bounds ({minx:.1f}, {miny:.1f}, {maxx:.1f}, {maxy:.1f}) lie "
                    f"entirely outside the {width}x{height} px tile",
                )
            )
            continue
        window = chip_window(b.centroid, b.bbox, spec)
        cut_chip(pre, window, size, out=pre_chips[n])
        cut_chip(post, window, size, out=post_chips[n])
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

    from data_prep.engine import tune_malloc

    cv2.setNumThreads(1)
    tune_malloc()


def run_tiles(
    func,
    args: Iterable,
    workers: int | None = 1,
    progress: bool | None = None,
    desc: str = "tiles",
    costs: Sequence[float] | None = None,
    scheduler: str | None = None,
    client=None,
) -> list:
    """Apply ``func`` to each argument, one job per tile (:mod:`data_prep.engine`; on a cluster
    the tiles go in groups of similar cost, :func:`data_prep.engine.task_count` tasks); results
    in input order.

    Args:
        func: a picklable function of one argument, that records its own problems rather than
            raising (a job that raises, or whose worker keeps dying, gives a
            :class:`data_prep.engine.JobFailed`).
        args: one argument per tile.
        workers: worker processes of the embedded cluster (None: one per core; never more
            than there are tiles); 1 (and no scheduler) runs in this process with one OpenCV
            thread.
        progress: show a tqdm bar over tiles (None: only when stderr is a terminal).
        desc: the progress bar's label.
        costs: expected work per argument; the costliest start first, so that no large tile is
            left running alone at the end.
        scheduler: address of an existing Dask scheduler (else ``$DASK_SCHEDULER_ADDRESS``).
        client: a ``distributed.Client`` to use as it is (e.g. kept open across runs).
    """
    from data_prep.engine import default_workers, map_jobs, open_client, task_count

    args = list(args)
    options = dict(progress=progress, desc=desc, unit="tile", costs=costs)
    if client is not None:
        return map_jobs(func, args, client=client, tasks=task_count(client, len(args)), **options)
    if workers is None:
        workers = default_workers()
    workers = max(min(int(workers), len(args)), 1)  # no idle workers to start
    with open_client(workers, scheduler) as cluster:
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


def prepare_xbd(
    roots: Sequence[str | os.PathLike] | str | os.PathLike,
    out: str | os.PathLike,
    spec: ChipSpec | None = None,
    workers: int | None = 1,
    include_unclassified: bool = False,
    limit: int | None = None,
    progress: bool | None = None,
    max_pixels: int | None = None,
    scheduler: str | None = None,
    client=None,
    resume: bool = False,
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
        workers: worker processes of the embedded Dask cluster, one job per tile (None: one
            per core); 1 runs in this process (:mod:`data_prep.engine`).
        include_unclassified: keep un-classified buildings as unlabelled chips (label -1).
        limit: use only the first ``limit`` tiles (sorted by name).
        progress: show a progress bar (None: only when stderr is a terminal).
        max_pixels: pixel limit per image, checked from the header before decoding (default
            :func:`data_prep.quality.max_pixels`).
        scheduler: address of an existing Dask scheduler whose workers see ``roots`` and
            ``out`` at the same paths (else ``$DASK_SCHEDULER_ADDRESS``; else embedded).
        client: a ``distributed.Client`` to run on as it is (``workers`` and ``scheduler`` are
            then not used).
        resume: reuse the tiles an earlier run into ``out`` finished (their sidecar and both
            shards exist, and their files are unchanged) instead of cutting them again; the
            store is the same as after an uninterrupted run. Without it every tile is cut and
            the sidecars of earlier runs are removed first.

    Returns:
        The run's report (chips per class and event, skipped items).

    Raises:
        XbdRootError: a root does not exist or holds no xBD tiles.
        data_prep.xbd_resume.ResumeError: ``resume`` into a store prepared with other options.
    """
    spec = spec or ChipSpec()
    workers = None if workers is None else max(int(workers), 1)
    max_pixels = quality.max_pixels(max_pixels)
    # absolute paths: the jobs may run in worker processes with another working directory
    roots = [roots] if isinstance(roots, (str, os.PathLike)) else list(roots)
    roots = [Path(r).absolute() for r in roots]
    tiles, duplicates = find_tiles(roots)
    if limit is not None:
        tiles = tiles[: max(int(limit), 0)]
    out = Path(out).absolute()
    options = tile_options(spec, include_unclassified, max_pixels)
    # checked before anything in the store changes
    done = finished_tiles(out, tiles, options) if resume else {}
    out = start_store(out)
    if not resume:
        for path in (out / SHARDS).glob(f"*{SIDECAR}"):
            path.unlink(missing_ok=True)
    report = PrepareReport()
    for item, reason in duplicates:
        report.skip(item, reason)
    todo = [t for t in tiles if t.name not in done]
    cut = run_tiles(
        _cut_tile_task,
        [(t, out, spec, include_unclassified, max_pixels) for t in todo],
        workers=workers,
        progress=progress,
        desc="prepare xbd",
        costs=[_tile_cost(t) for t in todo],
        scheduler=scheduler,
        client=client,
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
