"""Pre/post alignment: how far the post image is shifted from the pre image, and its correction
(no torch).

Georeferenced pre and post imagery is often off by metres: different orthorectification,
different sensors, a shifted tile. The model compares pre and post pixel by pixel, so a shift
looks like change. Two measurements, both on grey images (Rec. 601 luma):

- **Scene shift** (:func:`estimate_scene_shift`): the pre and post mosaics are read on the pre grid
  in up to :data:`MAX_BLOCKS` square blocks of :data:`BLOCK` pixels (those with the most buildings
  first, every block fully inside both mosaics). Each block's shift comes from phase correlation
  (:func:`block_shift`: OpenCV ``phaseCorrelate`` with a Hanning window, refined once after
  moving the post block by the first estimate); its ``response`` (the share of correlation
  energy in the peak, 0-1) is its confidence. Blocks whose response is below
  :data:`MIN_RESPONSE` or whose imagery is flat are left out; the scene shift is the median of the
  remaining blocks, kept only when at least :data:`MIN_BLOCKS` blocks agree with it to within
  :data:`AGREE_PX` and they are at least half of the confident ones. The spread (median distance
  of the agreeing blocks from the scene shift) says how uniform the shift is.
- **Second measurement** when the phase-correlation blocks do not agree: the same blocks are
  matched again by normalised cross-correlation of half-resolution, blurred grey images
  (:func:`block_shift_ncc`, the measure :mod:`data_prep.residual` uses around buildings, within
  ``±CONTEXT_SEARCH`` px), which is steadier where the two views differ a little everywhere
  (relief, leaning buildings, another off-nadir angle); the same agreement rule decides, and the
  report's ``method`` says which measurement the shift comes from.
- **Correction** (:func:`align_scene`): when the scene shift is confident and longer than
  :data:`MIN_CORRECT_PX` it is applied to the post mosaic's warp
  (:meth:`data_prep.mosaic.Mosaic.set_offset`): the post tiles are read as if their transform were
  moved by the shift, so chips are cut by the one chip-cutting function from corrected imagery.
  A shift that is not confident is never applied, and the report says why.
- **Residual shift of a building** after the correction: :mod:`data_prep.residual`
  (template matching of the pre image over the post image around the building).

Sign convention everywhere: a shift ``(dx, dy)`` in pixels (x = column to the right, y = row
down) means the post image shows at ``(x + dx, y + dy)`` what the pre image shows at ``(x, y)``.
Phase correlation is used for blocks because it is fast on large blocks and insensitive to
brightness changes; a building's residual shift is template-matched (:mod:`data_prep.residual`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from data_prep.registration import CONTEXT_MIN_NCC, context_shift, gray

if TYPE_CHECKING:
    from data_prep.mosaic import Scene

#: ``--align`` choices: estimate and correct when confident, or leave the post imagery as is.
AUTO, OFF = "auto", "off"
ALIGN_MODES = (AUTO, OFF)

#: Side in grid pixels of the blocks the scene shift is measured in.
BLOCK = 512
#: Most blocks read to measure a scene shift.
MAX_BLOCKS = 16
#: Smallest side of a block (smaller grids are measured in one block of their own size).
MIN_BLOCK = 64
#: Least fraction of a block that must lie inside both mosaics.
BLOCK_COVERED = 0.95
#: Phase-correlation response under which a block's shift is not trusted.
MIN_RESPONSE = 0.04
#: Least standard deviation of a block's grey values (0-255) for it to be measured at all.
MIN_TEXTURE = 2.0
#: Least number of agreeing blocks for a confident scene shift.
MIN_BLOCKS = 2
#: Blocks within this many pixels of the median shift agree with it.
AGREE_PX = 1.5
#: A confident scene shift is corrected only when longer than this many grid pixels.
MIN_CORRECT_PX = 1.0


# --------------------------------------------------------------------------------------------
# blocks: phase correlation


@dataclass(frozen=True)
class BlockShift:
    """The shift of one block (grid pixels, post relative to pre) and its confidence.

    Attributes:
        dx, dy: the shift; NaN when the block could not be measured.
        response: phase-correlation response (0-1; the share of correlation energy in the peak).
        col, row: the block's top-left grid pixel (-1 for a block given as arrays).
        size: the block's side in pixels.
        confident: whether the block is trusted (response, texture).
    """

    dx: float
    dy: float
    response: float
    col: int = -1
    row: int = -1
    size: int = 0
    confident: bool = False

    @property
    def length(self) -> float:
        return float(math.hypot(self.dx, self.dy))


def _shift_image(image: np.ndarray, dx: float, dy: float) -> np.ndarray:
    """float32 image moved by ``(-dx, -dy)``: out[y, x] = image[y + dy, x + dx] (edges reflected)."""
    import cv2

    m = np.array([[1, 0, dx], [0, 1, dy]], dtype=np.float32)
    h, w = image.shape[:2]
    return cv2.warpAffine(
        image,
        m,
        (w, h),
        flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
        borderMode=cv2.BORDER_REFLECT_101,
    )


def block_shift(
    pre: np.ndarray, post: np.ndarray, min_response: float = MIN_RESPONSE
) -> BlockShift:
    """Shift of a post block relative to the pre block of the same window, by phase correlation.

    Args:
        pre, post: uint8 ``[S, S, 3]`` RGB (or float ``[S, S]`` grey) blocks of one size.
        min_response: response under which the result is not confident.

    Returns:
        The :class:`BlockShift`: post shows at ``(x + dx, y + dy)`` what pre shows at ``(x, y)``.
        Flat imagery (grey standard deviation under :data:`MIN_TEXTURE`) gives NaN, not confident.
    """
    import cv2

    a, b = gray(pre), gray(post)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"pre and post blocks must have one 2-D shape, got {a.shape}, {b.shape}")
    h, w = a.shape
    if min(float(a.std()), float(b.std())) < MIN_TEXTURE:
        return BlockShift(math.nan, math.nan, 0.0, size=w)
    window = cv2.createHanningWindow((w, h), cv2.CV_32F)
    a = a - a.mean()
    (dx, dy), response = cv2.phaseCorrelate(a, b - b.mean(), window)
    if math.hypot(dx, dy) > 0.25:
        # Refine once: the window weighs a shifted block unevenly, so measure what is left after
        # moving post back by the first estimate.
        moved = _shift_image(b, dx, dy)
        (rx, ry), r2 = cv2.phaseCorrelate(a, moved - moved.mean(), window)
        if math.hypot(rx, ry) < 2.0:
            dx, dy, response = dx + rx, dy + ry, max(response, r2)
    ok = bool(response >= min_response)
    return BlockShift(float(dx), float(dy), float(response), size=w, confident=ok)


def block_shift_ncc(pre: np.ndarray, post: np.ndarray) -> BlockShift:
    """Shift of a post block by normalised cross-correlation of half-resolution, blurred grey
    blocks (:func:`data_prep.registration.context_shift`, within ``±CONTEXT_SEARCH`` px): the second
    measurement, used when the phase-correlation blocks do not agree. ``response`` is the peak
    correlation; confident when it is at least ``CONTEXT_MIN_NCC`` and the peak is not on the
    edge of the search range. Flat blocks and blocks too small to search give NaN."""
    a, b = gray(pre), gray(post)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"pre and post blocks must have one 2-D shape, got {a.shape}, {b.shape}")
    if min(float(a.std()), float(b.std())) < MIN_TEXTURE:
        return BlockShift(math.nan, math.nan, 0.0, size=a.shape[1])
    try:
        s = context_shift(pre, post)
    except ValueError:  # too small for the search range
        return BlockShift(math.nan, math.nan, 0.0, size=a.shape[1])
    ok = bool(s.inside and s.ncc >= CONTEXT_MIN_NCC)
    return BlockShift(s.dx, s.dy, float(s.ncc), size=a.shape[1], confident=ok)


def combine_measurements(
    pairs: Sequence[tuple[np.ndarray, np.ndarray, int, int]], blocks: Sequence[BlockShift]
) -> SceneShift:
    """:func:`combine_blocks` of the phase-correlation ``blocks``; when they do not agree, the
    same blocks (``pairs``: pre block, post block, col, row) measured again by
    :func:`block_shift_ncc`, kept when those agree (``method`` ``correlation``)."""
    out = combine_blocks(blocks)
    if out.confident or not pairs:
        return out
    second = []
    for pre, post, col, row in pairs:
        b = block_shift_ncc(pre, post)
        second.append(BlockShift(b.dx, b.dy, b.response, col, row, b.size, b.confident))
    alt = combine_blocks(second)
    if not alt.confident:
        return out
    alt.method = "correlation"
    alt.reason = f"{alt.reason} (by correlation; phase correlation was {out.reason})"
    return alt


@dataclass
class SceneShift:
    """The post-to-pre shift of a scene and whether it was applied.

    Attributes:
        mode: ``auto`` or ``off``.
        dx, dy: the scene shift in grid pixels (NaN when not measured).
        res: grid pixel size in CRS units (metres for a projected CRS).
        units: the CRS's linear unit name (``metre``, ``degree``, ...).
        confident: whether the shift is trusted (enough agreeing confident blocks).
        applied: whether the post imagery was corrected by it.
        reason: why it was (not) applied, in words.
        spread_px: median distance of the agreeing blocks from the scene shift.
        response: median response of the agreeing blocks.
        blocks: every block measured.
        agreeing: how many confident blocks agree with the scene shift.
    """

    mode: str = AUTO
    dx: float = math.nan
    dy: float = math.nan
    res: float = 1.0
    units: str = "metre"
    confident: bool = False
    applied: bool = False
    reason: str = ""
    spread_px: float = math.nan
    response: float = math.nan
    blocks: list[BlockShift] = field(default_factory=list)
    agreeing: int = 0
    method: str = "phase"

    @property
    def length_px(self) -> float:
        return float(math.hypot(self.dx, self.dy))

    @property
    def confident_blocks(self) -> int:
        return sum(b.confident for b in self.blocks)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (shift in pixels and CRS units, east/north; blocks listed)."""

        def num(v: float, nd: int = 3) -> float | None:
            return None if v is None or not math.isfinite(v) else round(float(v), nd)

        out = {
            "mode": self.mode,
            "applied": self.applied,
            "confident": self.confident,
            "reason": self.reason,
            "method": self.method,
            "shift_px": {"dx": num(self.dx), "dy": num(self.dy), "length": num(self.length_px)},
            f"shift_{_unit_key(self.units)}": {
                "east": num(self.dx * self.res),
                "north": num(-self.dy * self.res),
                "length": num(self.length_px * self.res),
            },
            "pixel_size": num(self.res, 6),
            "spread_px": num(self.spread_px),
            "response": num(self.response, 4),
            "blocks": len(self.blocks),
            "confident_blocks": self.confident_blocks,
            "agreeing_blocks": self.agreeing,
            "per_block": [
                {k: (num(v) if isinstance(v, float) else v) for k, v in asdict(b).items()}
                for b in self.blocks
            ],
        }
        if self.units == "pixel":  # not georeferenced: pixels only
            del out["shift_units"]
        return out

    def summary(self) -> str:
        """One line for a run's summary."""
        if self.mode == OFF:
            return "alignment: off (post imagery used as given)"
        unit = _unit_short(self.units)
        if not math.isfinite(self.dx):
            return f"alignment: not corrected: {self.reason}"
        shift = f"post shifted by ({self.dx:+.2f}, {self.dy:+.2f}) px (x right, y down)"
        if self.units != "pixel":
            shift += (
                f" = {self.dx * self.res:+.2f} {unit} east, {-self.dy * self.res:+.2f} {unit} north"
            )
        spread = (
            f"{self.agreeing}/{self.confident_blocks} confident blocks agree "
            f"(of {len(self.blocks)}), spread {self.spread_px:.2f} px, response {self.response:.3f}"
        )
        verdict = "corrected" if self.applied else f"not corrected: {self.reason}"
        return f"alignment: {shift}; {spread}; {verdict}"


def _unit_key(units: str) -> str:
    return {"metre": "m", "meter": "m", "degree": "deg"}.get(units, "units")


def _unit_short(units: str) -> str:
    return {"metre": "m", "meter": "m", "degree": "deg"}.get(units, units)


def combine_blocks(
    blocks: Sequence[BlockShift],
    min_blocks: int = MIN_BLOCKS,
    agree_px: float = AGREE_PX,
    min_correct_px: float = MIN_CORRECT_PX,
) -> SceneShift:
    """The scene shift from per-block shifts: the median of the confident blocks, refined over
    those within ``agree_px`` of it (see the module docstring); ``applied`` says whether it
    should be corrected."""
    out = SceneShift(blocks=list(blocks))
    good = [b for b in blocks if b.confident and math.isfinite(b.dx)]
    if not blocks:
        out.reason = "no block lies inside both pre and post imagery"
        return out
    if not good:
        out.reason = (
            f"no confident block (of {len(blocks)}: phase-correlation response under "
            f"{MIN_RESPONSE} or flat imagery)"
        )
        return out
    d = np.array([[b.dx, b.dy] for b in good])
    med = np.median(d, axis=0)
    near = np.hypot(*(d - med).T) <= agree_px
    if near.any():
        med = np.median(d[near], axis=0)
        near = np.hypot(*(d - med).T) <= agree_px
    n = int(near.sum())
    out.dx, out.dy = float(med[0]), float(med[1])
    out.agreeing = n
    if n:
        out.spread_px = float(np.median(np.hypot(*(d[near] - med).T)))
        out.response = float(np.median([b.response for b, k in zip(good, near, strict=True) if k]))
    if n < min_blocks or n < 0.5 * len(good):
        out.reason = (
            f"not confident: {n} of {len(good)} confident block(s) agree within {agree_px} px "
            f"(need at least {min_blocks} and half)"
        )
        return out
    out.confident = True
    if out.length_px <= min_correct_px:
        out.reason = f"{out.length_px:.2f} px is within {min_correct_px:g} px"
        return out
    out.applied = True
    out.reason = "confident"
    return out


# --------------------------------------------------------------------------------------------
# scenes


def _block_side(height: int, width: int, block: int) -> int:
    """``block``, or half the image's shorter side when that is smaller (so that several blocks
    fit), but at least :data:`MIN_BLOCK` and at most the image."""
    side = min(block, max(min(height, width) // 2, MIN_BLOCK))
    return max(min(side, height, width), 1)


def choose_blocks(
    scene: Scene,
    centroids: np.ndarray | None = None,
    block: int = BLOCK,
    max_blocks: int = MAX_BLOCKS,
) -> list[tuple[int, int, int]]:
    """Blocks ``(col, row, size)`` of the grid to measure the scene shift in.

    A lattice of ``block``-pixel squares at half-block steps (half the grid's shorter side when
    that is smaller); those at least :data:`BLOCK_COVERED` inside both mosaics are kept, the ones
    holding the most building centroids first (``centroids``: ``[N, 2]`` grid pixels), the
    rest spread evenly, at most ``max_blocks`` of them, none overlapping another by more than half.
    """
    import shapely

    grid = scene.grid
    size = _block_side(grid.height, grid.width, block)
    step = max(size // 2, 1)
    coverage = scene.coverage
    shapely.prepare(coverage)
    t = grid.transform
    candidates = []
    for row in range(0, max(grid.height - size, 0) + 1, step):
        for col in range(0, max(grid.width - size, 0) + 1, step):
            x0, y0 = t @ (col, row)
            x1, y1 = t @ (col + size, row + size)
            box = shapely.box(min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1))
            if shapely.contains(coverage, box) or (
                coverage.intersection(box).area >= BLOCK_COVERED * box.area
            ):
                candidates.append((col, row))
    if not candidates:
        return []
    counts = np.zeros(len(candidates))
    if centroids is not None and len(centroids):
        c = np.asarray(centroids, dtype=np.float64)
        for i, (col, row) in enumerate(candidates):
            inside = (c[:, 0] >= col) & (c[:, 0] < col + size)
            inside &= (c[:, 1] >= row) & (c[:, 1] < row + size)
            counts[i] = inside.sum()
    # most buildings first; equal counts in an even spread over the lattice
    spread = np.argsort(np.arange(len(candidates)) * 0.6180339887 % 1.0, kind="stable")
    rank = np.empty(len(candidates))
    rank[spread] = np.arange(len(candidates))
    order = sorted(range(len(candidates)), key=lambda i: (-counts[i], rank[i]))
    chosen: list[tuple[int, int, int]] = []
    for i in order:
        col, row = candidates[i]
        if all(abs(col - c) >= step or abs(row - r) >= step for c, r, _ in chosen):
            chosen.append((col, row, size))
        if len(chosen) >= max_blocks:
            break
    return chosen


def estimate_scene_shift(
    scene: Scene,
    centroids: np.ndarray | None = None,
    block: int = BLOCK,
    max_blocks: int = MAX_BLOCKS,
    read: tuple[int, int, int, int] | None = None,
) -> SceneShift:
    """Measure the post-to-pre shift of an open scene (nothing is corrected; see
    :func:`align_scene`).

    Args:
        scene: an open scene (pre and post mosaics on the pre grid).
        centroids: ``[N, 2]`` building centroids in grid pixels; blocks holding buildings are
            measured first (None: blocks spread over the scene).
        block: block side in grid pixels.
        max_blocks: most blocks read.
        read: ``(col, row, width, height)`` of the one read the scene's chips will take
            (:func:`data_prep.scene.single_read`): when every block lies inside it, the blocks
            are cut from that read, which the scene keeps for the chips.
    """
    # a block is one read window: keep it inside the scene's pixel limit (the guard against
    # oversized reads refuses anything larger)
    block = max(1, min(block, math.isqrt(scene.max_pixels)))
    out = _measure_blocks(scene, choose_blocks(scene, centroids, block, max_blocks), read)
    out.res = scene.grid.res
    out.units = _linear_units(scene.grid.crs)
    return out


def _block_reader(scene: Scene, cells: Sequence[tuple[int, int, int]], read=None):
    """``read(col, row, size)`` of the blocks ``cells``: the chips' own read ``read`` (kept for
    them) when it holds every block; else one read of the box around them all,
    cut into blocks, when that box holds no more pixels than the blocks together (a small scene:
    its overlapping blocks cover it several times over, and each read costs a GDAL call, a warp
    for post imagery on another grid); else a read per block.

    On a tile read on its own grid the cut blocks are the very pixels of a read per block; a
    warped read differs between windows within GDAL's approximation of the transformation
    (:meth:`data_prep.mosaic.Tile.read_warped`), which moved Joplin's measured scene shift by
    0.01 px (0.769 -> 0.760)."""
    c0, r0 = min((c for c, _, _ in cells), default=0), min((r for _, r, _ in cells), default=0)
    c1 = max((c + s for c, _, s in cells), default=0)
    r1 = max((r + s for _, r, s in cells), default=0)
    if cells and read is not None:
        col, row, width, height = read
        if col <= c0 and row <= r0 and c1 <= col + width and r1 <= row + height:
            return _cutter(scene.read_pair(col, row, width, height, keep=True), col, row)
    area = (c1 - c0) * (r1 - r0)
    if len(cells) < 2 or area > sum(s * s for _, _, s in cells) or area > scene.max_pixels:
        return lambda col, row, size: scene.read_pair(col, row, size, size)
    return _cutter(scene.read_pair(c0, r0, c1 - c0, r1 - r0), c0, r0)


def _cutter(whole, c0: int, r0: int):
    def cut(col: int, row: int, size: int):
        y, x = row - r0, col - c0
        return tuple(a[y : y + size, x : x + size] for a in whole)

    return cut


def _measure_blocks(scene: Scene, cells: Sequence[tuple[int, int, int]], window=None) -> SceneShift:
    blocks, pairs = [], []
    read = _block_reader(scene, cells, window)
    for col, row, size in cells:
        pre, pre_valid, post, post_valid = read(col, row, size)
        if (pre_valid & post_valid).mean() < BLOCK_COVERED:
            continue
        b = block_shift(pre, post)
        blocks.append(BlockShift(b.dx, b.dy, b.response, col, row, size, b.confident))
        pairs.append((pre, post, col, row))
    return combine_measurements(pairs, blocks)


def _linear_units(crs) -> str:
    try:
        units = crs.linear_units
    except Exception:  # pragma: no cover - exotic CRS objects
        return "units"
    if crs.is_geographic:
        return "degree"
    return units or "units"


def align_scene(
    scene: Scene,
    centroids: np.ndarray | None = None,
    mode: str = AUTO,
    block: int = BLOCK,
    max_blocks: int = MAX_BLOCKS,
    read: tuple[int, int, int, int] | None = None,
) -> SceneShift:
    """Measure the scene's post-to-pre shift and, when confident and longer than
    :data:`MIN_CORRECT_PX`, correct the post mosaic by it (before any chip is cut).

    Args:
        scene: an open scene; its post mosaic's offset is set when the shift is applied.
        centroids: building centroids in grid pixels (``[N, 2]``), to measure where buildings are.
        mode: ``auto`` (measure, correct when confident) or ``off`` (leave the imagery as is).
        block, max_blocks, read: see :func:`estimate_scene_shift`.

    Returns:
        The :class:`SceneShift`, ``applied`` when the post imagery was moved.
    """
    if mode not in ALIGN_MODES:
        raise ValueError(f"align mode must be one of {', '.join(ALIGN_MODES)}, got {mode!r}")
    if mode == OFF:
        return SceneShift(
            mode=OFF,
            res=scene.grid.res,
            units=_linear_units(scene.grid.crs),
            reason="off",
        )
    shift = estimate_scene_shift(scene, centroids, block, max_blocks, read)
    if shift.applied:
        scene.post.set_offset(shift.dx, shift.dy)
    return shift


def image_blocks(
    height: int, width: int, block: int = BLOCK, max_blocks: int = MAX_BLOCKS
) -> list[tuple[int, int, int]]:
    """Blocks ``(col, row, size)`` spread over a whole image (half-block steps, at most
    ``max_blocks``, evenly spread)."""
    size = _block_side(height, width, block)
    step = max(size // 2, 1)
    cells = [
        (col, row, size)
        for row in range(0, max(height - size, 0) + 1, step)
        for col in range(0, max(width - size, 0) + 1, step)
    ]
    if len(cells) <= max_blocks:
        return cells
    pick = np.linspace(0, len(cells) - 1, max_blocks).round().astype(int)
    return [cells[i] for i in sorted(set(pick.tolist()))]


def align_images(
    pre: np.ndarray,
    post: np.ndarray,
    mode: str = AUTO,
    res: float = 1.0,
    units: str = "pixel",
    block: int = BLOCK,
    max_blocks: int = MAX_BLOCKS,
) -> tuple[np.ndarray, SceneShift]:
    """Measure the shift of a whole post image against its pixel-aligned pre image and correct
    it as :func:`align_scene` does (xBD-style image pairs held in memory).

    Args:
        pre, post: uint8 ``[H, W, 3]`` images of one size.
        mode: ``auto`` or ``off``.
        res, units: pixel size and its unit, for the report (1 ``pixel`` when not georeferenced).
        block, max_blocks: block side and most blocks.

    Returns:
        ``(post, shift)``: the corrected post image (the input itself when not applied; zero
        filled where the shift uncovers it) and the :class:`SceneShift`.
    """
    import cv2

    if mode not in ALIGN_MODES:
        raise ValueError(f"align mode must be one of {', '.join(ALIGN_MODES)}, got {mode!r}")
    if mode == OFF:
        return post, SceneShift(mode=OFF, res=res, units=units, reason="off")
    h, w = pre.shape[:2]
    blocks, pairs = [], []
    for col, row, size in image_blocks(h, w, block, max_blocks):
        a, b = pre[row : row + size, col : col + size], post[row : row + size, col : col + size]
        m = block_shift(a, b)
        blocks.append(BlockShift(m.dx, m.dy, m.response, col, row, size, m.confident))
        pairs.append((a, b, col, row))
    shift = combine_measurements(pairs, blocks)
    shift.res, shift.units = res, units
    if not shift.applied:
        return post, shift
    m = np.array([[1, 0, shift.dx], [0, 1, shift.dy]], dtype=np.float32)
    moved = cv2.warpAffine(
        post,
        m,
        (w, h),
        flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
        borderMode=cv2.BORDER_CONSTANT,
        borderValue=0,
    )
    return moved, shift
