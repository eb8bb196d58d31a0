"""Per-building chip pairs cut from a georeferenced scene, for `prepare scene` and for scoring.

Pre and post tiles are mosaicked virtually on the pre grid (:mod:`data_prep.mosaic`), the post
imagery is shifted onto the pre imagery when their georeferencing disagrees by more than a pixel
(:mod:`data_prep.alignment`, ``--align``), footprints are reprojected onto the grid
(:mod:`data_prep.footprints`), and buildings are cut in spatial blocks: the buildings whose
centroid falls in one ``block_size`` square of the grid share one windowed read of pre and post,
so memory stays bounded by the block and the whole scene is never loaded.

A building is chipped only when its footprint lies entirely inside valid data of both mosaics
(inside the tiles, and every footprint pixel free of nodata, masks and zero alpha); otherwise it
counts as not covered. A building whose pre or post chip is blank (one flat value: an all-zero
or constant-fill raster, :func:`data_prep.quality.is_blank`) is skipped with the reason
``blank imagery``, and so is one whose read window exceeds the pixel limit. Chips follow the chip spec exactly as for xBD: the window from
:func:`data_prep.windows.chip_window` in pre-grid pixels, zero fill beyond the imagery, resampled
with :func:`data_prep.windows.resize_chip`.

Writing the chips of a scene into a chip store, one job per part of the scene, is
:mod:`data_prep.scene_store`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from data_prep.footprint_cover import footprints_valid
from data_prep.footprints import Footprints
from data_prep.mosaic import Scene, SceneError
from data_prep.quality import blank_reason, pixel_limit_problem
from data_prep.residual import CONTEXT_SIDE, ReadContext
from data_prep.spec import ChipSpec
from data_prep.timing import StageTimes
from data_prep.windows import (
    ChipWindow,
    chip_window,
    cut_pair,
)

#: Default side, in grid pixels, of the blocks that share one read.
BLOCK_SIZE = 1024
#: Chip windows larger than this many pixels are refused (a footprint that large is not a building).
MAX_WINDOW = 4096

CHIP = "chip"
NOT_COVERED = "not_covered"
SKIPPED = "skipped"


@dataclass
class BuildingChip:
    """One building of a scene and, when it is covered, its chip pair.

    Attributes:
        index: position of the building in the :class:`~data_prep.footprints.Footprints` arrays.
        uid: building id.
        label: class id 0-3, -1 when unlabelled.
        status: ``"chip"``, ``"not_covered"`` (not entirely inside valid pre and post data) or
            ``"skipped"`` (see ``reason``: e.g. a blank chip, ``blank imagery (...)``).
        reason: why the building was skipped, empty otherwise.
        bbox: (minx, miny, maxx, maxy) footprint bounds in pre-grid pixels.
        window: the chip window in pre-grid pixels.
        lon, lat: footprint centroid in degrees (EPSG:4326).
        pre, post: uint8 [chip_size, chip_size, 3] chips when ``status == "chip"``, else None.
        context_px: the building's residual pre/post shift in grid pixels measured on the
            imagery around it (:func:`data_prep.residual.context_residual`; NaN: no clear
            shift), when the chips were cut with ``context=True``; else None.
    """

    index: int
    uid: str
    label: int
    status: str
    reason: str
    bbox: tuple[float, float, float, float]
    window: ChipWindow
    lon: float
    lat: float
    pre: np.ndarray | None = None
    post: np.ndarray | None = None
    context_px: float | None = None


@dataclass
class SceneBuildings:
    """What cutting needs of some buildings of a scene: all of them, or one part's.

    Entry ``k`` of every list describes building ``index[k]`` of the footprint file's buildings.
    Small and picklable, so that one part's buildings travel to the worker that cuts them.
    """

    index: list[int]
    uid: list[str]
    label: list[int]
    pixels: np.ndarray  # [n] footprints in grid pixels (shapely)
    bounds: np.ndarray  # [n, 4] their bounds
    windows: list[ChipWindow]
    lonlat: np.ndarray  # [n, 2] centroids in degrees

    def __len__(self) -> int:
        return len(self.index)

    def chip(
        self, k: int, status: str, reason: str = "", pre=None, post=None, context_px=None
    ) -> BuildingChip:
        return BuildingChip(
            index=self.index[k],
            uid=self.uid[k],
            label=int(self.label[k]),
            status=status,
            reason=reason,
            bbox=tuple(float(v) for v in self.bounds[k]),
            window=self.windows[k],
            lon=float(self.lonlat[k, 0]),
            lat=float(self.lonlat[k, 1]),
            pre=pre,
            post=post,
            context_px=context_px,
        )

    def take(self, ks: Sequence[int]) -> SceneBuildings:
        """The buildings at positions ``ks``, in that order."""
        ks = list(ks)
        return SceneBuildings(
            index=[self.index[k] for k in ks],
            uid=[self.uid[k] for k in ks],
            label=[int(self.label[k]) for k in ks],
            pixels=self.pixels[ks] if ks else np.zeros(0, dtype=object),
            bounds=self.bounds[ks] if ks else np.zeros((0, 4)),
            windows=[self.windows[k] for k in ks],
            lonlat=self.lonlat[ks] if ks else np.zeros((0, 2)),
        )


@dataclass
class ReadPlan:
    """How the buildings of a scene are cut (:func:`plan_reads`).

    Attributes:
        buildings: every building, position ``k`` = building ``k`` of the footprints.
        early: ``(k, status, reason)`` of the buildings settled without a read (not covered, or
            a window too large), in footprint order.
        groups: positions of the buildings that share one read, one list per read, in the order
            of the reads (row-major over the blocks of the grid).
        margin: pixels read around each read's buildings (:func:`cut_reads`; None: the default,
            which chip preparation and scoring share).
    """

    buildings: SceneBuildings
    early: list[tuple[int, str, str]]
    groups: list[list[int]]
    margin: int | None = None


def plan_reads(
    scene: Scene,
    footprints: Footprints,
    spec: ChipSpec,
    block_size: int = BLOCK_SIZE,
    margin: int | None = None,
) -> ReadPlan:
    """Sort the buildings of a scene into reads: the buildings whose centroid falls in one
    ``block_size`` square of the grid share one read (a building with a window larger than half
    a block, and each building of a block whose read would exceed the pixel limit, is read on its
    own); buildings outside the pre/post coverage, or with a window over :data:`MAX_WINDOW`,
    need no read. ``margin``: pixels each read takes around its buildings
    (:attr:`ReadPlan.margin`).
    """
    import shapely

    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n = len(footprints)
    grid = scene.grid
    pixels = grid.to_pixels(footprints.geometries)
    bounds = shapely.bounds(pixels) if n else np.zeros((0, 4))
    centroids = shapely.centroid(pixels) if n else np.zeros(0, dtype=object)
    cx, cy = (
        (shapely.get_x(centroids), shapely.get_y(centroids)) if n else (np.zeros(0), np.zeros(0))
    )
    lonlat = footprints.lonlat()
    # Tolerance of half a pixel: the pixel test in the reads decides at the edges.
    coverage = scene.coverage.buffer(0.5 * grid.res)
    shapely.prepare(coverage)
    inside = shapely.contains(coverage, footprints.geometries) if n else np.zeros(0, dtype=bool)
    windows = [chip_window((cx[i], cy[i]), tuple(bounds[i]), spec) for i in range(n)]
    buildings = SceneBuildings(
        index=list(range(n)),
        uid=list(footprints.uids),
        label=[int(v) for v in footprints.labels],
        pixels=np.asarray(pixels, dtype=object),
        bounds=np.asarray(bounds, dtype=float).reshape(-1, 4),
        windows=windows,
        lonlat=np.asarray(lonlat, dtype=float).reshape(-1, 2),
    )
    early: list[tuple[int, str, str]] = []
    blocks: dict[tuple[int, int, int], list[int]] = {}
    for i in range(n):
        if not inside[i]:
            early.append((i, NOT_COVERED, ""))
            continue
        size = windows[i].size
        if size > MAX_WINDOW:
            early.append(
                (
                    i,
                    SKIPPED,
                    f"chip window of {size} px exceeds {MAX_WINDOW} px; is this footprint a building?",
                )
            )
            continue
        key_r, key_c = int(cy[i] // block_size), int(cx[i] // block_size)
        blocks.setdefault((key_r, key_c, i if size > block_size // 2 else -1), []).append(i)

    groups: list[list[int]] = []
    for key in sorted(blocks):
        members = blocks[key]
        if len(members) > 1 and _block_too_large(members, windows, bounds, scene.max_pixels):
            groups.extend([i] for i in members)  # read each building on its own
        else:
            groups.append(members)
    return ReadPlan(buildings=buildings, early=early, groups=groups, margin=margin)


def cut_reads(
    scene: Scene,
    buildings: SceneBuildings,
    groups: Sequence[Sequence[int]],
    spec: ChipSpec,
    context: bool = False,
    margin: int | None = None,
    timer: StageTimes | None = None,
) -> Iterator[BuildingChip]:
    """Read each group of ``buildings`` (positions into it) from ``scene`` once and yield one
    :class:`BuildingChip` per building, group after group.

    Each read takes ``margin`` (default :data:`data_prep.residual.CONTEXT_SIDE` / 2) pixels
    around the group as well, inside the grid and within the pixel limit, with or without
    ``context``: the post image is warped per read, so the same reads are what keeps chips cut
    for scoring identical to chips cut for training. With ``context`` every chip comes with its
    building's residual shift measured there (:attr:`BuildingChip.context_px`;
    :class:`data_prep.residual.ReadContext`: the buildings of a read share its grey images).
    Whether each footprint lies on valid imagery is decided for the whole group at once
    (:func:`data_prep.footprint_cover.footprints_valid`). ``timer`` collects the seconds spent
    reading (``read``), cutting (``cut``) and measuring (``context``).
    """
    timer = timer if timer is not None else StageTimes()
    windows, bounds = buildings.windows, buildings.bounds
    clock = time.perf_counter
    for members in groups:
        (c0, r0, c1, r1), problem = read_window(scene, members, windows, bounds, margin)
        if problem:
            for k in members:
                yield buildings.chip(k, SKIPPED, problem)
            continue
        t = clock()
        pre_rgb, pre_valid, post_rgb, post_valid = scene.read_pair(c0, r0, c1 - c0, r1 - r0)
        both = pre_valid & post_valid
        t1 = clock()
        timer.add("read", t1 - t)
        covered = footprints_valid(
            [buildings.pixels[k] for k in members], bounds[list(members)], both, c0, r0
        )
        shared = None
        timer.add("cut", clock() - t1)
        for k, ok in zip(members, covered, strict=True):
            if not ok:
                yield buildings.chip(k, NOT_COVERED)
                continue
            t = clock()
            w = windows[k]
            local = ChipWindow(w.col_off - c0, w.row_off - r0, w.size)
            pre, post = cut_pair(pre_rgb, post_rgb, local, spec.chip_size)
            blank = blank_reason(pre, post)
            t1 = clock()
            timer.add("cut", t1 - t)
            if blank:
                yield buildings.chip(k, SKIPPED, blank)
                continue
            shift = None
            if context:
                if shared is None:
                    shared = ReadContext(pre_rgb, post_rgb, valid=both)
                centre = (local.col_off + w.size / 2, local.row_off + w.size / 2)
                shift = shared.residual(centre, w.size)
                timer.add("context", clock() - t1)
            yield buildings.chip(k, CHIP, pre=pre, post=post, context_px=shift)


def read_window(
    scene: Scene, members: Sequence[int], windows, bounds, margin: int | None = None
) -> tuple[tuple[int, int, int, int], str]:
    """The window :func:`cut_reads` reads for the buildings ``members`` (positions into
    ``windows`` and ``bounds``): ``((c0, r0, c1, r1), problem)``, the problem empty unless the
    buildings alone exceed the pixel limit. ``margin`` pixels around them are taken as well
    (default :data:`data_prep.residual.CONTEXT_SIDE` / 2) where the limit allows, inside the grid
    (a window already reaching past an edge keeps its own extent there)."""
    c0, r0, c1, r1 = _block_extent(members, windows, bounds)
    problem = pixel_limit_problem(c1 - c0, r1 - r0, scene.max_pixels, "read window")
    if problem:
        return (c0, r0, c1, r1), problem
    m = CONTEXT_SIDE // 2 if margin is None else int(margin)
    width, height = scene.grid.width, scene.grid.height
    wider = (
        max(c0 - m, min(c0, 0)),
        max(r0 - m, min(r0, 0)),
        min(c1 + m, max(c1, width)),
        min(r1 + m, max(r1, height)),
    )
    if not pixel_limit_problem(
        wider[2] - wider[0], wider[3] - wider[1], scene.max_pixels, "read window"
    ):
        return wider, ""
    return (c0, r0, c1, r1), ""


def single_read(
    scene: Scene, plan: ReadPlan, margin: int | None = None
) -> tuple[int, int, int, int] | None:
    """``(col, row, width, height)`` of the one read of a plan whose buildings all share it (a
    small scene), None when it has several reads, none, or one over the pixel limit.

    Scene scoring reads this window once and keeps it (:meth:`data_prep.mosaic.Scene.read_pair`):
    the alignment measurement cuts its blocks from it when they lie inside, and when no shift is
    applied the chips are cut from that very read instead of a second warp of the post imagery."""
    if len(plan.groups) != 1:
        return None
    b = plan.buildings
    (c0, r0, c1, r1), problem = read_window(scene, plan.groups[0], b.windows, b.bounds, margin)
    return None if problem else (c0, r0, c1 - c0, r1 - r0)


def iter_building_chips(
    scene: Scene,
    footprints: Footprints,
    spec: ChipSpec,
    *,
    block_size: int = BLOCK_SIZE,
    progress: bool = True,
    context: bool = False,
    timer: StageTimes | None = None,
    plan: ReadPlan | None = None,
) -> Iterator[BuildingChip]:
    """Cut the chip pair of every building, reading the scene one block of buildings at a time.

    Buildings outside the pre/post coverage are yielded first (no read needed), then the others
    block by block (row-major over ``block_size`` squares of the grid; :func:`plan_reads`).

    Args:
        scene: an open scene.
        footprints: buildings in the scene's grid CRS (:func:`load_footprints` with
            ``scene.grid.crs``).
        spec: the chip specification.
        block_size: side in grid pixels of the squares whose buildings share one read.
        progress: show a tqdm progress bar over buildings (on a terminal).
        context: also measure each building's residual shift on the imagery around it
            (:func:`cut_reads`); scoring does, chip preparation does not.
        timer: collects the seconds spent planning the reads (``plan``) and those of
            :func:`cut_reads`.
        plan: the reads already planned (:func:`plan_reads` with the same arguments, the
            scene's post offset unchanged since; it also says the margin read around them);
            None plans them here.

    Yields:
        One :class:`BuildingChip` per building.
    """
    from tqdm import tqdm

    timer = timer if timer is not None else StageTimes()
    if plan is None:
        with timer.stage("plan"):
            plan = plan_reads(scene, footprints, spec, block_size)
    buildings = plan.buildings
    with tqdm(
        total=len(buildings), desc="buildings", unit="bldg", disable=None if progress else True
    ) as bar:
        for k, status, reason in plan.early:
            bar.update(1)
            yield buildings.chip(k, status, reason)
        for b in cut_reads(scene, buildings, plan.groups, spec, context, plan.margin, timer):
            bar.update(1)
            yield b


def _block_extent(members, windows, bounds) -> tuple[int, int, int, int]:
    c0 = min(min(windows[i].col_off, math.floor(bounds[i, 0])) for i in members)
    r0 = min(min(windows[i].row_off, math.floor(bounds[i, 1])) for i in members)
    c1 = max(max(windows[i].col_off + windows[i].size, math.ceil(bounds[i, 2])) for i in members)
    r1 = max(max(windows[i].row_off + windows[i].size, math.ceil(bounds[i, 3])) for i in members)
    return c0, r0, c1, r1


def _block_too_large(members, windows, bounds, limit: int) -> bool:
    c0, r0, c1, r1 = _block_extent(members, windows, bounds)
    return (c1 - c0) * (r1 - r0) > limit


def pixel_centroids(grid, footprints: Footprints) -> np.ndarray:
    """``[N, 2]`` footprint centroids in the grid's pixels (x = column, y = row)."""
    import shapely

    if not len(footprints):
        return np.zeros((0, 2))
    c = shapely.centroid(grid.to_pixels(footprints.geometries))
    return np.column_stack([shapely.get_x(c), shapely.get_y(c)])


def check_overlap(footprints: Footprints, scene: Scene) -> None:
    """Raise a clear error when no footprint touches the area covered by both pre and post.

    Raises:
        SceneError: naming the footprint file, with both extents in the grid CRS.
    """
    import shapely

    coverage = scene.coverage
    if len(footprints) and shapely.intersects(coverage, footprints.geometries).any():
        return
    fb = shapely.total_bounds(footprints.geometries) if len(footprints) else (np.nan,) * 4
    raise SceneError(
        footprints.path,
        f"none of its {len(footprints)} footprint(s) overlaps the area covered by both pre and post "
        f"imagery: footprints span {_fmt(fb)}, imagery {_fmt(coverage.bounds)} in "
        f"{scene.grid.crs.to_string()} (source CRS {footprints.source_crs}); check that the file "
        "belongs to this scene and that its CRS is declared correctly",
    )


def _fmt(bounds) -> str:
    return "(" + ", ".join(f"{v:.6g}" for v in bounds) + ")"
