"""A scene's chips into a chip store: `local-damage prepare scene`.

The scene is opened and its alignment measured once (:func:`prepare_scene`), its buildings are
planned into reads (:func:`data_prep.scene.plan_reads`), and the reads, in row-major order, are
joined into parts of about ``part_size`` buildings (:func:`plan_parts`, independent of the number
of workers). Each part is one job on :mod:`data_prep.engine` (in this process, on an embedded
Dask cluster or on an existing one): the job opens the scene itself, cuts its part
(:func:`data_prep.scene.cut_reads`) and writes its own shards; only its manifest rows and report
come back.

Store layout: ``tile`` and ``event`` of every row are the scene name; each part writes its own
shards of at most ``shard_size`` chips, named ``<scene>-p<part>-<n>``: ``<scene>-p0000-000_pre.npy``,
``<scene>-p0000-001_pre.npy``, ``<scene>-p0001-000_pre.npy``, ... The manifest lists buildings in
the footprint file's order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.alignment import AUTO, align_scene
from data_prep.engine import Bar, Engine, JobFailed, map_jobs
from data_prep.footprints import load_footprints
from data_prep.mosaic import SceneError, open_scene
from data_prep.report import PrepareReport, Skipped
from data_prep.scene import (
    BLOCK_SIZE,
    NOT_COVERED,
    SKIPPED,
    BuildingChip,
    SceneBuildings,
    check_overlap,
    cut_reads,
    pixel_centroids,
    plan_reads,
)
from data_prep.spec import CLASS_NAMES, ChipSpec
from data_prep.store import start_store, write_manifest, write_shard

#: Default number of chips per shard file.
SHARD_SIZE = 1024
#: Default number of buildings per `prepare scene` job (whole read blocks; see plan_parts).
PART_SIZE = 4096


class _ShardWriter:
    """Collects chips and writes them in shards of at most ``size`` chips."""

    def __init__(self, root: Path, scene: str, size: int):
        self.root, self.scene, self.size = root, scene, size
        self.pre: list[np.ndarray] = []
        self.post: list[np.ndarray] = []
        self.pending: list[dict] = []
        self.count = 0

    def add(self, row: dict, pre: np.ndarray, post: np.ndarray) -> None:
        if not self.count and not self.pre:
            start_store(self.root)  # the store is touched only once there is a chip to write
        row["index"] = len(self.pre)
        self.pending.append(row)
        self.pre.append(pre)
        self.post.append(post)
        if len(self.pre) >= self.size:
            self.flush()

    def flush(self) -> None:
        if not self.pre:
            return
        pre_file, post_file = write_shard(
            self.root, f"{self.scene}-{self.count:03d}", np.stack(self.pre), np.stack(self.post)
        )
        for row in self.pending:
            row["pre_file"], row["post_file"] = pre_file, post_file
        self.count += 1
        self.pre, self.post, self.pending = [], [], []


def plan_parts(groups: Sequence[Sequence[int]], part_size: int = PART_SIZE) -> list[list[int]]:
    """Consecutive read groups joined into parts of at least ``part_size`` buildings (the last
    may hold fewer; a group is never split); each part is one job. The parts depend only on the
    groups and ``part_size``, never on the number of workers, so the shards are the same
    wherever the jobs run.

    Returns:
        For each part, the indices of its groups in ``groups``.
    """
    if part_size < 1:
        raise ValueError(f"part_size must be positive, got {part_size}")
    parts: list[list[int]] = []
    current: list[int] = []
    count = 0
    for g, members in enumerate(groups):
        current.append(g)
        count += len(members)
        if count >= part_size:
            parts.append(current)
            current, count = [], 0
    if current:
        parts.append(current)
    return parts


@dataclass
class PartJob:
    """One job of `prepare scene`: cut the buildings of one part into its own shards.

    Attributes:
        pre, post: the scene's tiles (absolute paths; the job opens the scene itself).
        max_pixels: the pixel limit.
        offset: the post mosaic's ``(dx, dy)`` correction measured once by the command.
        dropped: tiles (absolute paths) whose reads failed in the command; left out here too.
        spec: the chip specification.
        name: the scene name.
        footprints: the footprint file, for the report.
        out: the chip store (absolute path).
        part: the part's number; its shards are ``<scene>-p<part>-<n>_{pre,post}.npy``.
        shard_size: most chips per shard file.
        buildings: the part's buildings.
        groups: positions in ``buildings`` of the buildings sharing each read.
    """

    pre: list[str]
    post: list[str]
    max_pixels: int | None
    offset: tuple[float, float]
    dropped: list[str]
    spec: ChipSpec
    name: str
    footprints: str
    out: str
    part: int
    shard_size: int
    buildings: SceneBuildings
    groups: list[list[int]]

    @property
    def shard_name(self) -> str:
        return f"{self.name}-p{self.part:04d}"


def cut_part(job: PartJob) -> tuple[list[tuple[int, dict]], PrepareReport, list[Skipped]]:
    """Cut the buildings of one part (a job: see :class:`PartJob`); its shards are written
    atomically under deterministic names, so that a job run again writes the same files.

    Returns:
        ``(rows, report, dropped)``: ``(building index, manifest row)`` of every chip, the part's
        report (chips, buildings not covered or skipped), and tiles dropped after a read failure.
    """
    import cv2

    threads = cv2.getNumThreads()
    cv2.setNumThreads(1)  # parts are the unit of parallelism
    report = PrepareReport()
    rows: list[tuple[int, dict]] = []
    try:
        with open_scene(job.pre, job.post, job.max_pixels) as scene:
            if job.offset != (0.0, 0.0):
                scene.post.set_offset(*job.offset)
            for mosaic in (scene.pre, scene.post):
                for tile in [t for t in mosaic.tiles if t.path in job.dropped]:
                    mosaic.tiles.remove(tile)
                    tile.close()
            writer = _ShardWriter(Path(job.out), job.shard_name, job.shard_size)
            for b in cut_reads(scene, job.buildings, job.groups, job.spec):
                if b.status == NOT_COVERED:
                    report.not_covered += 1
                elif b.status == SKIPPED:
                    report.skip(f"{job.footprints} feature {b.uid}", b.reason)
                else:
                    row = _manifest_row(job.name, b)
                    writer.add(row, b.pre, b.post)
                    rows.append((b.index, row))
                    report.add_chip(job.name, b.label)
            writer.flush()
            dropped = [*scene.pre.skipped, *scene.post.skipped]
    finally:
        cv2.setNumThreads(threads)
    return rows, report, dropped


def _run_parts(jobs: list[PartJob], engine: Engine, progress: bool) -> list:
    """``[cut_part(job) ...]`` through :mod:`data_prep.engine`, costliest parts first."""
    options = dict(
        keys=[job.shard_name for job in jobs],
        costs=[len(job.buildings) for job in jobs],
        bar=Bar("prepare scene", "part", None if progress else False),
    )
    with engine.open(len(jobs)) as cluster:  # no idle workers to start
        return map_jobs(cut_part, jobs, client=cluster, **options)


def _manifest_row(name: str, b: BuildingChip) -> dict:
    return {
        "chip_id": f"{name}:{b.uid}",
        "event": name,
        "tile": name,
        "uid": b.uid,
        "label": b.label,
        "label_name": CLASS_NAMES[b.label] if b.label >= 0 else "",
        "bbox_minx": round(b.bbox[0], 3),
        "bbox_miny": round(b.bbox[1], 3),
        "bbox_maxx": round(b.bbox[2], 3),
        "bbox_maxy": round(b.bbox[3], 3),
        "win_col": b.window.col_off,
        "win_row": b.window.row_off,
        "win_size": b.window.size,
        "lon": round(b.lon, 7),
        "lat": round(b.lat, 7),
    }


@dataclass(frozen=True)
class SceneOptions:
    """How `prepare scene` reads the footprints and cuts the scene; the imagery, the footprint
    file, the store, the chip specification and where the jobs run are :func:`prepare_scene`'s
    arguments.

    Attributes:
        label_field: footprint attribute holding the damage label; None for unlabelled chips.
        event: event and scene name for the manifest (None: the footprint file's stem).
        block_size: side in grid pixels of the squares whose buildings share one read.
        shard_size: most chips per shard file.
        max_pixels: pixel limit per internal block and per read window (None:
            :func:`data_prep.quality.max_pixels`); a large tile read in windows is not refused.
        align: ``auto``: measure the post-to-pre shift and correct it before chips are cut when
            it is confident and longer than a pixel (:func:`data_prep.alignment.align_scene`);
            ``off``: use the post imagery as georeferenced. Recorded in the report and store.json.
        part_size: buildings per job (whole read blocks are kept together).
    """

    label_field: str | None = None
    event: str | None = None
    block_size: int = BLOCK_SIZE
    shard_size: int = SHARD_SIZE
    max_pixels: int | None = None
    align: str = AUTO
    part_size: int = PART_SIZE


def prepare_scene(
    pre_paths: Sequence[str | os.PathLike],
    post_paths: Sequence[str | os.PathLike],
    buildings: str | os.PathLike,
    out: str | os.PathLike,
    spec: ChipSpec | None = None,
    options: SceneOptions | None = None,
    *,
    engine: Engine | None = None,
    progress: bool = True,
) -> PrepareReport:
    """Cut the chip pairs of every building of a scene into the chip store ``out``.

    The command opens the scene, measures the alignment and plans the reads; the buildings are
    then cut in parts of about ``options.part_size`` buildings (:func:`plan_parts`), one job per part
    (:mod:`data_prep.engine`): each job opens the scene itself, cuts its part and writes its own
    shards, and only its manifest rows and report come back. The parts do not depend on where
    the jobs run, so the store is the same byte for byte with one process, an embedded cluster
    or an existing one. A part whose job fails is listed in the report; the others are written.

    Unusable tiles and buildings are skipped and listed in the report. A problem that leaves
    nothing to do (no usable pre or post tile, an unreadable or empty footprint file, an unknown
    label field, footprints outside the imagery) is recorded in the report too, with no chips and
    the existing store left untouched, so the exit code says the run failed; so is a run that
    cuts no chip at all (every building blank, not covered or skipped).

    Args:
        pre_paths: pre-disaster GeoTIFF tiles (any CRS and resolution).
        post_paths: post-disaster GeoTIFF tiles (any CRS and resolution).
        buildings: footprint file (GeoJSON, GeoPackage or Shapefile, any CRS).
        out: chip store folder.
        spec: chip specification (default ``ChipSpec()``).
        options: the label field, the event name, reads, shards, parts, the pixel limit and the
            alignment (default ``SceneOptions()``).
        engine: where the jobs run, one job per part (default ``Engine()``: in this process;
            an embedded cluster never starts more workers than there are parts). The workers
            of an existing scheduler must see the inputs and ``out`` at the same paths.
        progress: show a progress bar over the parts (on a terminal).

    Returns:
        The report: chips per class, buildings not covered, items skipped with the reason.

    Raises:
        data_prep.engine.EngineError: the scheduler does not answer or the cluster cannot start.
    """
    spec = spec or ChipSpec()
    options = options or SceneOptions()
    label_field, event = options.label_field, options.event
    shard_size, part_size = options.shard_size, options.part_size
    if shard_size < 1:
        raise ValueError(f"shard_size must be positive, got {shard_size}")
    if part_size < 1:
        raise ValueError(f"part_size must be positive, got {part_size}")
    report = PrepareReport()
    name = (event or Path(buildings).stem).strip() or "scene"
    out = Path(out)
    try:
        scene = open_scene(pre_paths, post_paths, options.max_pixels)
    except SceneError as exc:
        report.skip(exc.item, exc.reason)
        return report
    with scene:
        report.skipped.extend(scene.skipped)
        try:
            footprints = load_footprints(buildings, scene.grid.crs, label_field=label_field)
            check_overlap(footprints, scene)
        except SceneError as exc:
            report.skip(exc.item, exc.reason)
            return report
        report.skipped.extend(footprints.skipped)
        shift = align_scene(scene, pixel_centroids(scene.grid, footprints), options.align)
        report.alignment, report.alignment_text = shift.to_dict(), shift.summary()

        plan = plan_reads(scene, footprints, spec, options.block_size)
        for k, status, reason in plan.early:  # settled without a read
            if status == NOT_COVERED:
                report.not_covered += 1
            else:
                report.skip(f"{footprints.path} feature {plan.buildings.uid[k]}", reason)
        parts = plan_parts(plan.groups, part_size)
        # tiles the alignment's reads dropped stay out of the jobs' mosaics too
        dropped_here = [
            str(Path(t.item).absolute()) for t in [*scene.pre.skipped, *scene.post.skipped]
        ]
        jobs = []
        for p, part in enumerate(parts):
            members = [k for g in part for k in plan.groups[g]]
            local = {k: j for j, k in enumerate(members)}
            jobs.append(
                PartJob(
                    pre=[str(Path(x).absolute()) for x in pre_paths],
                    post=[str(Path(x).absolute()) for x in post_paths],
                    max_pixels=scene.max_pixels,
                    offset=scene.post.offset,
                    dropped=dropped_here,
                    spec=spec,
                    name=name,
                    footprints=str(footprints.path),
                    out=str(out.absolute()),
                    part=p,
                    shard_size=shard_size,
                    buildings=plan.buildings.take(members),
                    groups=[[local[k] for k in plan.groups[g]] for g in part],
                )
            )
        results = _run_parts(jobs, engine or Engine(), progress)
        rows: list[tuple[int, dict]] = []
        dropped: list[Skipped] = []
        for job, result in zip(jobs, results, strict=True):
            if isinstance(result, JobFailed):
                uids = job.buildings.uid
                report.skip(
                    f"{footprints.path} part {job.part}",
                    f"{len(uids)} building(s) (features {uids[0]} ... {uids[-1]}) not prepared: "
                    f"{result.error}",
                )
                continue
            part_rows, part_report, part_dropped = result
            rows.extend(part_rows)
            report.merge(part_report)
            dropped.extend(s for s in part_dropped if s not in dropped)
        report.skipped.extend([*scene.pre.skipped, *scene.post.skipped, *dropped])
        meta = {
            "spec": spec.to_dict(),
            "source": "scene",
            "inputs": {
                "pre": [str(p) for p in pre_paths],
                "post": [str(p) for p in post_paths],
                "buildings": str(buildings),
                "label_field": label_field,
                "event": name,
            },
            "radiometry": scene.radiometry(),
            "crs": scene.grid.crs.to_string(),
            "grid": scene.grid.to_dict(),
            "alignment": report.alignment,
            "report": report.to_dict(),
        }
        if rows:  # no chip (all blank, not covered or skipped): the store is left untouched
            write_manifest(out, [row for _, row in sorted(rows, key=lambda r: r[0])], meta)
    return report
