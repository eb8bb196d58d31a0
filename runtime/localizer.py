"""The building localiser at inference time, on ONNX Runtime (no torch).

A localiser model file (``local-damage localize export``; docs/localize.md) takes uint8 RGB images
``image`` ``[N, H, W, 3]`` (H and W multiples of 32, normalisation inside the graph) and returns
``building`` ``[N, H, W]``, the building probability of every pixel. Its metadata props (JSON
text) say how to apply it: ``task`` ``"localize"``, ``scale`` (the image is resized by it
first), ``tile_size`` (window side in model-input pixels), ``threshold`` and ``min_area_px``
(smallest blob kept, native pixels), and optionally ``largest_building_px`` (the largest building
footprint of its training tiles, native pixels: scoring flags a detection larger than that
``oversized``).

:class:`Localizer` applies it to one image (:meth:`Localizer.predict`: resize, overlapping
windows whose centres are kept, resize back; :meth:`Localizer.mask`; :meth:`Localizer.detect`:
polygons by :func:`data_prep.polygons.mask_to_polygons`), and :func:`detect_scene` to a
georeferenced scene of any size, one block of the pre mosaic at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.polygons import PolygonOptions, mask_to_polygons
from runtime.contract import (
    LOCALIZE_TASK,
    LOCALIZER_INPUT,
    LOCALIZER_METADATA,
    LOCALIZER_OUTPUT,
    SUPPORTED_FORMAT_VERSIONS,
    ModelError,
    open_session,
)
from runtime.registry import LOCALIZER_NAME, default_localizer

#: Default side, in grid pixels, of the scene blocks read at once by :func:`detect_scene`.
BLOCK_SIZE = 1024
#: Default margin, in grid pixels, read around each block (context, and buildings across edges).
MARGIN = 128
#: Douglas-Peucker tolerance of the detected outlines, in native pixels.
SIMPLIFY_PX = 1.0


def resize(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """``image`` resized to ``(height, width)``: area averaging when shrinking, else bilinear."""
    import cv2

    height, width = size
    if image.shape[:2] == (height, width):
        return image
    shrink = height < image.shape[0] or width < image.shape[1]
    return cv2.resize(
        image, (width, height), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR
    )


def _starts(length: int, window: int, stride: int) -> list[int]:
    """Window starts covering ``[0, length)``, the last flush with the end."""
    if length <= window:
        return [0]
    starts = list(range(0, length - window, stride))
    starts.append(length - window)
    return starts


class Localizer:
    """One ONNX Runtime session over a localiser model file.

    Args:
        path: the ``.onnx`` file.
        providers: onnxruntime execution providers (default: CUDA when available, then CPU).
        threads: intra-op threads (default: onnxruntime's choice).

    Attributes:
        path, metadata, providers: the file, its parsed metadata props, the providers in use.
        scale: factor images are resized by before the model (1.0 = native).
        tile_size: window side in model-input pixels (a multiple of 32).
        threshold: building probability threshold.
        min_area_px: smallest blob kept, in native pixels.
        largest_building_px: the largest building footprint of its training tiles in native
            pixels, or None when the file does not say (then nothing is flagged ``oversized``).

    Raises:
        ModelError: the file is missing, not ONNX, a damage model, or not a valid localiser.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        providers: Sequence[str] | None = None,
        threads: int | None = None,
    ) -> None:
        self.path = Path(path)
        self._session, self.metadata = open_session(
            self.path, providers, threads, "localiser model"
        )
        self.providers: list[str] = list(self._session.get_providers())
        self._check()

    def _fail(self, problem: str) -> ModelError:
        return ModelError(f"{self.path}: {problem}")

    def _check(self) -> None:
        md = self.metadata
        if md.get("task") != LOCALIZE_TASK:
            if "class_names" in md and "chip_spec" in md:
                raise self._fail(
                    "is a damage model, not a building localiser; give it as --model, and a "
                    "localiser (local-damage localize export) as --localizer"
                )
            raise self._fail(
                f"not a building localiser (metadata task is {md.get('task')!r}, expected "
                f"{LOCALIZE_TASK!r}); export one with `local-damage localize export`"
            )
        missing = [k for k in LOCALIZER_METADATA if k not in md]
        if missing:
            raise self._fail(f"missing localiser metadata key(s) {', '.join(missing)}")
        if md["format_version"] not in SUPPORTED_FORMAT_VERSIONS:
            raise self._fail(
                f"localiser format version {md['format_version']!r} is not supported; update "
                "local-damage"
            )

        def number(key: str, low: float, high: float, integer: bool = False):
            value = md[key]
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            ok = ok and (not integer or float(value).is_integer()) and low <= value <= high
            if not ok:
                raise self._fail(f"metadata {key} must be in [{low}, {high}], got {value!r}")
            return int(value) if integer else float(value)

        self.scale: float = number("scale", 1e-3, 16.0)
        if self.scale <= 0:
            raise self._fail(f"metadata scale must be positive, got {self.scale}")
        self.tile_size: int = number("tile_size", 32, 16384, integer=True)
        if self.tile_size % 32:
            raise self._fail(f"metadata tile_size must be a multiple of 32, got {self.tile_size}")
        self.threshold: float = number("threshold", 0.0, 1.0)
        self.min_area_px: int = number("min_area_px", 0, 10**9, integer=True)
        self.largest_building_px: int | None = (
            number("largest_building_px", 1, 10**12, integer=True)
            if md.get("largest_building_px") is not None
            else None
        )
        inputs = self._session.get_inputs()
        if [i.name for i in inputs] != [LOCALIZER_INPUT] or inputs[0].type != "tensor(uint8)":
            raise self._fail(
                f"inputs are {[(i.name, i.type) for i in inputs]}, expected one uint8 'image' "
                "[N, H, W, 3]"
            )
        shape = list(inputs[0].shape)
        if len(shape) != 4 or shape[3] != 3:
            raise self._fail(f"input 'image' has shape {shape}, expected [N, H, W, 3]")
        outputs = [o.name for o in self._session.get_outputs()]
        if LOCALIZER_OUTPUT not in outputs:
            raise self._fail(f"outputs are {outputs}; missing 'building' [N, H, W]")

    def _run(self, batch: np.ndarray) -> np.ndarray:
        out = self._session.run([LOCALIZER_OUTPUT], {LOCALIZER_INPUT: np.ascontiguousarray(batch)})[
            0
        ]
        return np.asarray(out, dtype=np.float32)

    def predict(self, image: np.ndarray, batch_size: int = 1) -> np.ndarray:
        """Building probability of every pixel of an image.

        The image is resized by :attr:`scale`, cut into windows of :attr:`tile_size` that overlap
        by an eighth of their side on each edge (edge windows padded by reflection to a multiple
        of 32), each pixel taken from the window where it lies farthest inside, and the result
        resized back (bilinear).

        Args:
            image: uint8 ``[H, W, 3]`` RGB at native resolution.
            batch_size: windows per ONNX Runtime call. One by default: a model that averages
                flips runs four images per window, and a batch of four windows (16 images of
                512 px) more than doubled the peak memory of scoring a scene (1.73 GB against
                0.78 GB on Joplin) for no gain in speed on a CPU.

        Returns:
            float32 ``[H, W]`` probabilities in [0, 1].
        """
        image = np.asarray(image)
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(
                f"expected a uint8 [H, W, 3] RGB image, got {image.dtype} {image.shape}"
            )
        height, width = image.shape[:2]
        if height == 0 or width == 0:
            return np.zeros((height, width), np.float32)
        size = (max(1, round(height * self.scale)), max(1, round(width * self.scale)))
        small = np.ascontiguousarray(resize(image, size))
        h, w = size
        tile = self.tile_size
        if h <= tile and w <= tile:
            window = _pad32(small)
            prob = self._run(window[None])[0, :h, :w]
        else:
            overlap = tile // 8
            stride = tile - 2 * overlap
            rows, cols = _starts(h, tile, stride), _starts(w, tile, stride)
            prob = np.zeros((h, w), np.float32)
            jobs = [(r, c) for r in rows for c in cols]
            for i in range(0, len(jobs), batch_size):
                chunk = jobs[i : i + batch_size]
                windows = np.stack(
                    [_pad_to(small[r : r + tile, c : c + tile], tile) for r, c in chunk]
                )
                out = self._run(windows)
                for (r, c), p in zip(chunk, out, strict=True):
                    # the centre of each window, and its outer edge where it meets the image's
                    r0 = r if r == 0 else r + overlap
                    c0 = c if c == 0 else c + overlap
                    r1 = min(h, r + tile) if r + tile >= h else r + tile - overlap
                    c1 = min(w, c + tile) if c + tile >= w else c + tile - overlap
                    prob[r0:r1, c0:c1] = p[r0 - r : r1 - r, c0 - c : c1 - c]
        if (h, w) != (height, width):
            import cv2

            prob = cv2.resize(prob, (width, height), interpolation=cv2.INTER_LINEAR)
        return np.clip(prob, 0.0, 1.0)

    def mask(self, image: np.ndarray) -> np.ndarray:
        """Bool ``[H, W]`` building mask: probability ``>= threshold``, 8-connected blobs of fewer
        than ``min_area_px`` pixels removed (the rule the model's threshold was chosen with)."""
        import cv2

        binary = self.predict(image) >= self.threshold
        if self.min_area_px <= 1 or not binary.any():
            return binary
        _, labels, stats, _ = cv2.connectedComponentsWithStats(binary.astype(np.uint8), 8)
        keep = stats[:, cv2.CC_STAT_AREA] >= self.min_area_px
        keep[0] = False
        return keep[labels]

    def polygons(self, probability: np.ndarray, transform=None) -> list:
        """Building polygons of a probability map (:func:`data_prep.polygons.mask_to_polygons`
        with this model's threshold and smallest blob)."""

        options = PolygonOptions(
            threshold=self.threshold,
            min_area_px=max(self.min_area_px, 1),
            simplify_px=SIMPLIFY_PX,
        )
        return mask_to_polygons(probability, options, transform=transform)

    def detect(self, image: np.ndarray, transform=None) -> list:
        """Building polygons of one image.

        Args:
            image: uint8 ``[H, W, 3]`` RGB (the pre-disaster image).
            transform: ``affine.Affine`` from pixels to map coordinates; None for pixel
                coordinates (x = column, y = row).

        Returns:
            Shapely polygons, one per building found.
        """
        return self.polygons(self.predict(image), transform)

    def card(self) -> dict[str, Any]:
        """What the model is: name, path, operating point, training data, metrics, licence."""
        md = self.metadata
        return {
            "name": self.path.stem,
            "path": str(self.path),
            "task": LOCALIZE_TASK,
            "scale": self.scale,
            "tile_size": self.tile_size,
            "threshold": self.threshold,
            "min_area_px": self.min_area_px,
            "largest_building_px": self.largest_building_px,
            "flip_tta": bool(md.get("flip_tta", False)),
            "trained_on": md.get("trained_on"),
            "metrics": md.get("metrics"),
            "license": md.get("license"),
            "providers": list(self.providers),
        }

    def __repr__(self) -> str:
        return (
            f"Localizer({str(self.path)!r}, scale={self.scale}, tile_size={self.tile_size}, "
            f"threshold={self.threshold})"
        )


def _pad32(image: np.ndarray) -> np.ndarray:
    h, w = image.shape[:2]
    return _pad(image, h + (-h % 32), w + (-w % 32))


def _pad_to(image: np.ndarray, tile: int) -> np.ndarray:
    return _pad(image, tile, tile)


def _pad(image: np.ndarray, height: int, width: int) -> np.ndarray:
    h, w = image.shape[:2]
    if (h, w) == (height, width):
        return image
    mode = "reflect" if h > 1 and w > 1 else "edge"
    return np.pad(image, ((0, height - h), (0, width - w), (0, 0)), mode=mode)


#: What to do when no localiser is available (said wherever one is needed).
HOW_TO_GET_ONE = (
    "give building footprints, or a localiser model with --localizer PATH (put it at "
    f"models/{LOCALIZER_NAME} to have it used by default; `local-damage localize train` and "
    "`localize export` make one, see docs/localize.md)"
)


def load_localizer(path: str | os.PathLike | None = None, threads: int | None = None) -> Localizer:
    """The localiser at ``path``, else the default one (:func:`default_localizer`).

    Raises:
        ModelError: none available (saying how to get one), or the file is not a valid localiser.
    """
    if path is None:
        path = default_localizer()
        if path is None:
            raise ModelError(
                f"no building localiser model available (models/{LOCALIZER_NAME} is not there), "
                f"so buildings cannot be detected; {HOW_TO_GET_ONE}"
            )
    return Localizer(path, threads=threads)


# --------------------------------------------------------------------------- scenes


def detect_scene(
    localizer: Localizer,
    scene,
    *,
    block_size: int = BLOCK_SIZE,
    margin: int = MARGIN,
    progress: bool = True,
) -> Iterator:
    """The buildings of a georeferenced scene, read one block of the pre mosaic at a time.

    The pre grid is cut into ``block_size`` squares; each square that meets the area covered by
    both pre and post is read with ``margin`` pixels around it (context for the model, and room
    for buildings that cross the square's edge), and a building found there is kept when its
    centroid lies inside the square, so a building across two squares is kept once. Pixels
    without valid pre imagery are never building, and a building entirely outside the area
    covered by both pre and post is left out (it could not be graded). Memory is that of one
    block, whatever the scene's size.

    Args:
        localizer: the loaded localiser.
        scene: an open :class:`data_prep.mosaic.Scene`.
        block_size: side of the squares in grid pixels.
        margin: pixels read around each square; buildings larger than this may be cut.
        progress: show a progress bar over blocks.

    Yields:
        Shapely polygons in the grid CRS.
    """
    import shapely
    from tqdm import tqdm

    if block_size < 1 or margin < 0:
        raise ValueError(
            f"block_size must be positive and margin not negative, got {block_size}, {margin}"
        )
    grid = scene.grid
    coverage = scene.coverage
    shapely.prepare(coverage)
    t = grid.transform
    blocks = []
    for r0 in range(0, grid.height, block_size):
        for c0 in range(0, grid.width, block_size):
            x0, y0 = t @ (c0, r0)
            x1, y1 = t @ (min(c0 + block_size, grid.width), min(r0 + block_size, grid.height))
            box = shapely.box(min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1))
            if coverage.intersects(box):
                blocks.append((r0, c0))
    for r0, c0 in tqdm(blocks, desc="localising", unit="block", disable=None if progress else True):
        rb, cb = r0 - margin, c0 - margin
        side_r = min(block_size, grid.height - r0) + 2 * margin
        side_c = min(block_size, grid.width - c0) + 2 * margin
        rgb, valid = scene.pre.read(cb, rb, side_c, side_r)
        if not valid.any():
            continue
        prob = localizer.predict(rgb)
        prob[~valid] = 0.0
        rows_end = min(r0 + block_size, grid.height)
        cols_end = min(c0 + block_size, grid.width)
        for poly in localizer.polygons(prob):
            c = poly.centroid
            col, row = c.x + cb, c.y + rb
            if c0 <= col < cols_end and r0 <= row < rows_end:
                placed = _to_grid(poly, grid, cb, rb)
                if coverage.intersects(placed):  # elsewhere it could not be graded
                    yield placed


def _to_grid(poly, grid, col_off: int, row_off: int):
    from shapely import affinity

    t = grid.window_transform(col_off, row_off)
    return affinity.affine_transform(poly, [t.a, t.b, t.d, t.e, t.c, t.f])
