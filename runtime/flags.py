"""Abstain flags: why a building's grade should be checked by a person (no torch).

A flag does not withhold the grade (except ``blank``): the building is still scored, and its
``flags`` column names every reason to doubt the grade, ``;``-joined, empty when there is none.

- ``blank``: the pre or the post chip is one flat value (zero or nodata fill, a constant raster),
  by :func:`data_prep.quality.is_blank`. Such a building is not scored at all; its ``status`` is
  ``skipped: blank imagery (...)`` and its ``flags`` ``blank``.
- ``cloud``: most of the post chip is bright and texture-poor (:func:`sky_flag`).
- ``haze``: the post chip is brighter than the pre chip and its local contrast has collapsed
  relative to the pre chip's (:func:`sky_flag`).
- ``misaligned``: after the scene's own shift is corrected, the building's residual pre/post
  shift exceeds :data:`MISALIGNED_CONTEXT_PX` source pixels, measured on the imagery around it
  (:func:`data_prep.residual.context_residual`, given by the scoring code), or, for a chip pair
  with no imagery around it, :data:`MISALIGNED_PX` chip pixels measured on the chips
  (:func:`data_prep.residual.residual_shift`).
- ``ood``: the building's embedding is far from every class prototype: its largest cosine
  similarity to the prototypes stored in the model's ``ood`` metadata prop is below the stored
  threshold (:class:`OodCheck`). A model without that prop never flags ``ood``.

Every threshold below was chosen and measured on real held-out xBD chips; see docs/flags.md and
``local-damage bench flags``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from data_prep.quality import blank_reasons, is_blank
from data_prep.residual import CONTEXT_LIMIT_PX, residual_shift
from runtime.contract import ModelError

#: Every flag name, in the order they are written. All but ``oversized`` are raised on the chips
#: (:class:`Flagger`); ``oversized`` by scoring, on a detected footprint larger than any building
#: its localiser learnt from (``app.scoring.grade.flag_oversized``).
FLAGS = ("blank", "cloud", "haze", "misaligned", "ood", "oversized")
BLANK, CLOUD, HAZE, MISALIGNED, OOD, OVERSIZED = FLAGS
#: Output column holding the flags.
COLUMN = "flags"
#: Separator of flag names in the column.
SEPARATOR = ";"
#: Metadata prop of a model file holding the class prototypes and the ``ood`` threshold.
METADATA_KEY = "ood"
#: How the ``ood`` score is computed (stored in the metadata block).
OOD_METHOD = "largest cosine similarity of the embedding to a class prototype"

#: ``misaligned`` when the residual pre/post shift measured on the chips alone exceeds this many
#: chip pixels.
MISALIGNED_PX = 3.0
#: ``misaligned`` when the residual shift measured on the imagery around the building
#: (:func:`data_prep.residual.context_residual`) exceeds this many source pixels: the smallest
#: limit with at most 1% false alarms on the real xBD tiles of folds 0, 2, 3 and 4 (docs/flags.md).
#: Kept beside the measurement (``data_prep.residual.CONTEXT_LIMIT_PX``), which is exact around it.
MISALIGNED_CONTEXT_PX = CONTEXT_LIMIT_PX
#: The residual-shift measurement every :class:`Flagger` uses by default:
#: ``(pre, post) -> shift in chip pixels, or None when it cannot be measured``; None: no
#: ``misaligned`` flag. The alignment check of ``data_prep``
#: (:func:`data_prep.residual.residual_shift`).
MEASURE_SHIFT: Callable[[np.ndarray, np.ndarray], float | None] | None = residual_shift

#: Luminance (0-255) above which a post pixel counts as bright.
CLOUD_BRIGHT = 170.0
#: Local contrast (mean absolute 3x3 Laplacian of luminance, 0-255 units) under which a pixel
#: counts as flat.
CLOUD_FLAT = 6.0
#: ``cloud`` when at least this fraction of the post chip, or of the pre chip, is bright and flat.
CLOUD_FRACTION = 0.6
#: ``haze``: the post chip's texture energy is below this fraction of the pre chip's ...
HAZE_CONTRAST_RATIO = 0.35
#: ... and its mean luminance is at least this much above the pre chip's.
HAZE_BRIGHTENING = 25.0


def flags_text(names: Iterable[str]) -> str:
    """The column value of a building: flag names in :data:`FLAGS` order, ``;``-joined."""
    given = set(names)
    unknown = given - set(FLAGS)
    if unknown:
        raise ValueError(f"unknown flag(s) {sorted(unknown)}; flags are {list(FLAGS)}")
    return SEPARATOR.join(f for f in FLAGS if f in given)


def parse_flags(text: str | None) -> list[str]:
    """The flag names of a column value (None or empty: no flags)."""
    return [f for f in (text or "").split(SEPARATOR) if f]


# --------------------------------------------------------------------------------------------
# imagery checks


def blank_flag(pre: np.ndarray, post: np.ndarray) -> bool:
    """Whether the pre or post uint8 ``[H, W, 3]`` chip is blank (one flat value)."""

    return is_blank(pre) or is_blank(post)


def luminance(chip: np.ndarray) -> np.ndarray:
    """float32 ``[..., H, W]`` Rec. 601 luma (0-255) of uint8 ``[..., H, W, 3]`` RGB chips.

    Each channel is converted as it is weighted (the same float32 products and sums as
    converting the whole chip first, a third less work), from planes OpenCV splits out of the
    interleaved pixels (numpy's arithmetic on a strided channel runs at half the speed)."""
    import cv2

    c = np.asarray(chip)
    if c.dtype != np.uint8:
        c = c.astype(np.float32)
        return 0.299 * c[..., 0] + 0.587 * c[..., 1] + 0.114 * c[..., 2]
    if c.ndim < 3 or c.shape[-1] != 3 or c.size == 0:
        planes = (c[..., 0], c[..., 1], c[..., 2])
    else:
        planes = cv2.split(np.ascontiguousarray(c).reshape(-1, 1, 3))
    out = np.multiply(planes[0], np.float32(0.299), dtype=np.float32)
    out += np.multiply(planes[1], np.float32(0.587), dtype=np.float32)
    out += np.multiply(planes[2], np.float32(0.114), dtype=np.float32)
    return out.reshape(c.shape[:-1])


def local_contrast(gray: np.ndarray) -> np.ndarray:
    """float32 ``[H, W]`` absolute 4-neighbour Laplacian of a luminance image (edges replicated).

    A texture measure that ignores smooth illumination gradients: near 0 on cloud, haze and flat
    fill, several units on roofs, roads and vegetation.
    """
    g = np.pad(np.asarray(gray, dtype=np.float32), 1, mode="edge")
    lap = 4 * g[1:-1, 1:-1] - g[:-2, 1:-1] - g[2:, 1:-1] - g[1:-1, :-2] - g[1:-1, 2:]
    return np.abs(lap)


@dataclass(frozen=True)
class SkyStats:
    """The measurements behind ``cloud`` and ``haze`` for one chip pair.

    Attributes:
        bright_flat: fraction of post pixels brighter than :data:`CLOUD_BRIGHT` with local
            contrast under :data:`CLOUD_FLAT`.
        bright_flat_pre: the same fraction of the pre chip's pixels.
        contrast_ratio: mean local contrast of the post chip / that of the pre chip.
        brightening: mean luminance of the post chip minus that of the pre chip.
    """

    bright_flat: float
    contrast_ratio: float
    brightening: float
    bright_flat_pre: float = 0.0


def sky_stats(pre: np.ndarray, post: np.ndarray) -> SkyStats:
    """:class:`SkyStats` of a uint8 ``[H, W, 3]`` chip pair."""
    gp, gq = luminance(pre), luminance(post)
    cp, cq = local_contrast(gp), local_contrast(gq)
    bright_flat = float(np.mean((gq > CLOUD_BRIGHT) & (cq < CLOUD_FLAT)))
    bright_flat_pre = float(np.mean((gp > CLOUD_BRIGHT) & (cp < CLOUD_FLAT)))
    pre_texture = float(cp.mean())
    ratio = float(cq.mean()) / pre_texture if pre_texture > 1e-6 else math.inf
    return SkyStats(bright_flat, ratio, float(gq.mean() - gp.mean()), bright_flat_pre)


def sky_flag(pre: np.ndarray, post: np.ndarray) -> str | None:
    """``"cloud"``, ``"haze"`` or None for a uint8 ``[H, W, 3]`` chip pair.

    ``cloud`` when at least :data:`CLOUD_FRACTION` of the post chip, or of the pre chip, is
    bright and flat (a cloud over the building before the event hides it as much as one after;
    a localiser can even take a cloud on the pre image for a building); otherwise ``haze`` when
    the post chip is at least :data:`HAZE_BRIGHTENING` brighter than the pre chip and keeps
    under :data:`HAZE_CONTRAST_RATIO` of its local contrast.
    """
    return _sky_decision(sky_stats(pre, post))


def _sky_decision(s: SkyStats) -> str | None:
    if max(s.bright_flat, s.bright_flat_pre) >= CLOUD_FRACTION:
        return CLOUD
    if s.contrast_ratio < HAZE_CONTRAST_RATIO and s.brightening >= HAZE_BRIGHTENING:
        return HAZE
    return None


def sky_flags(pre: np.ndarray, post: np.ndarray) -> list[str | None]:
    """:func:`sky_flag` of every pair of uint8 ``[N, H, W, 3]`` chips, the pixel work done for
    the whole batch at once (each value equals :func:`sky_flag` of the pair: the same
    arithmetic on the same pixels, and each mean taken over one chip as there)."""
    return [_sky_decision(s) for s in batch_sky_stats(pre, post)]


def batch_sky_stats(pre: np.ndarray, post: np.ndarray) -> list[SkyStats]:
    """:func:`sky_stats` of every pair of uint8 ``[N, H, W, 3]`` chips: the same values, bit for
    bit (each chip's mean is one contiguous row of the batch, summed as the chip on its own)."""
    n = len(pre)
    if n == 0:
        return []
    gp, gq = luminance(pre), luminance(post)
    cp, cq = _batch_contrast(gp), _batch_contrast(gq)
    pixels = gp[0].size
    bright = np.count_nonzero(((gq > CLOUD_BRIGHT) & (cq < CLOUD_FLAT)).reshape(n, -1), axis=1)
    bright_pre = np.count_nonzero(((gp > CLOUD_BRIGHT) & (cp < CLOUD_FLAT)).reshape(n, -1), axis=1)
    bright, bright_pre = bright / pixels, bright_pre / pixels  # the float64 means, exactly
    texture_pre, texture_post, mean_pre, mean_post = (
        a.reshape(n, -1).mean(axis=1) for a in (cp, cq, gp, gq)
    )
    out: list[SkyStats] = []
    for i in range(n):
        pre_texture = float(texture_pre[i])
        ratio = float(texture_post[i]) / pre_texture if pre_texture > 1e-6 else math.inf
        out.append(
            SkyStats(
                float(bright[i]), ratio, float(mean_post[i] - mean_pre[i]), float(bright_pre[i])
            )
        )
    return out


def _batch_contrast(gray: np.ndarray) -> np.ndarray:
    """:func:`local_contrast` of every image of a float32 ``[N, H, W]`` batch (the same
    operations in the same order, in place, on an edge-replicated copy made by slicing)."""
    gray = np.asarray(gray, dtype=np.float32)
    n, h, w = gray.shape
    g = np.empty((n, h + 2, w + 2), np.float32)
    g[:, 1:-1, 1:-1] = gray
    g[:, 0, 1:-1], g[:, -1, 1:-1] = gray[:, 0], gray[:, -1]
    g[:, :, 0], g[:, :, -1] = g[:, :, 1], g[:, :, -2]
    lap = np.multiply(g[:, 1:-1, 1:-1], np.float32(4))
    lap -= g[:, :-2, 1:-1]
    lap -= g[:, 2:, 1:-1]
    lap -= g[:, 1:-1, :-2]
    lap -= g[:, 1:-1, 2:]
    return np.abs(lap, out=lap)


def misaligned_flag(shift_px: float | None, limit: float = MISALIGNED_PX) -> bool:
    """Whether a residual pre/post shift (chip pixels; None: not measured) exceeds ``limit``."""
    return shift_px is not None and math.isfinite(shift_px) and shift_px > limit


# --------------------------------------------------------------------------------------------
# out of distribution


def unit(x: np.ndarray) -> np.ndarray:
    """Rows of ``[N, D]`` scaled to unit length in float64 (zero rows stay zero)."""
    arr = np.asarray(x, dtype=np.float64)
    norms = np.linalg.norm(arr, axis=-1, keepdims=True)
    return np.divide(arr, norms, out=np.zeros_like(arr), where=norms > 1e-12)


def class_prototypes(
    embedding: np.ndarray, labels: np.ndarray, k: int
) -> tuple[np.ndarray, list[int]]:
    """Unit-length mean embedding of each class of labelled ``[N, D]`` embeddings.

    Args:
        embedding: ``[N, D]`` embeddings (rows of zero length are left out).
        labels: ``[N]`` class ids in ``[0, K)``.
        k: the number of classes ``K``.

    Returns:
        ``(prototypes, classes)``: float64 ``[C, D]`` prototypes of the ``C`` classes that have
        an example, and their class ids.

    Raises:
        ValueError: shapes that do not match, or no usable example at all.
    """
    z, y = unit(embedding), np.asarray(labels)
    if z.ndim != 2 or y.shape != (len(z),):
        raise ValueError(f"need [N, D] embeddings and [N] labels, got {z.shape} and {y.shape}")
    usable = np.linalg.norm(z, axis=1) > 0.5
    classes = [c for c in range(k) if np.any(usable & (y == c))]
    if not classes:
        raise ValueError("no labelled embedding to make class prototypes from")
    return unit(np.stack([z[usable & (y == c)].mean(axis=0) for c in classes])), classes


def ood_scores(embedding: np.ndarray, prototypes: np.ndarray) -> np.ndarray:
    """float64 ``[N]`` largest cosine similarity of each ``[N, D]`` embedding to ``[K, D]``
    prototypes (a zero embedding scores 0)."""
    z = unit(np.atleast_2d(embedding))
    return (z @ unit(prototypes).T).max(axis=1)


def ood_threshold(scores: np.ndarray, quantile: float) -> float:
    """The ``quantile`` of in-distribution scores: about that fraction of them fall below it."""
    s = np.asarray(scores, dtype=np.float64)
    if s.size == 0:
        raise ValueError("no scores to choose an ood threshold from")
    if not 0 < quantile < 1:
        raise ValueError(f"quantile must lie in (0, 1), got {quantile}")
    return float(np.quantile(s, quantile))


def ood_block(
    prototypes: np.ndarray,
    threshold: float,
    class_names: Sequence[str],
    quantile: float,
    prototypes_from: Mapping[str, Any],
    threshold_from: Mapping[str, Any],
    scene: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``ood`` metadata prop of a model.

    Args:
        prototypes: ``[K, D]`` class prototypes (:func:`class_prototypes`).
        threshold: the cosine under which an embedding is flagged (:func:`ood_threshold`).
        class_names: the ``K`` classes, in prototype order.
        quantile: the fraction of the threshold chips meant to fall under it.
        prototypes_from: where the prototypes came from (chips, folds, n per class).
        threshold_from: where the threshold was chosen (chips, fold, n, flagged fraction).
        scene: the reference familiarity a whole scene is judged against
            (:func:`runtime.familiarity.scene_reference`); None: scenes are not judged.
    """
    protos = unit(prototypes)
    out = {
        "method": OOD_METHOD,
        "class_names": list(class_names),
        "prototypes": [[round(float(v), 7) for v in row] for row in protos],
        "threshold": float(threshold),
        "quantile": float(quantile),
        "prototypes_from": dict(prototypes_from),
        "threshold_from": dict(threshold_from),
    }
    if scene is not None:
        out["scene"] = dict(scene)
    return out


def ood_summary(metadata: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The ``ood`` block of a model's metadata without its prototype vectors (for model cards),
    or None when the model has none (it never flags ``ood``)."""
    block = (metadata or {}).get(METADATA_KEY)
    if not isinstance(block, Mapping):
        return None
    return {k: v for k, v in block.items() if k != "prototypes"}


@dataclass(frozen=True)
class OodCheck:
    """Class prototypes and the threshold under which an embedding is flagged ``ood``.

    Attributes:
        prototypes: float64 ``[K, D]`` unit-length class prototypes.
        threshold: flag when the largest cosine to a prototype is below this.
        block: the whole metadata block it was read from.
    """

    prototypes: np.ndarray
    threshold: float
    block: Mapping[str, Any]

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any] | None) -> OodCheck | None:
        """The check stored in a model's parsed metadata, or None when it has none.

        Raises:
            ModelError: an ``ood`` prop without a ``[K, D]`` prototype list and a finite
                threshold.
        """
        block = (metadata or {}).get(METADATA_KEY)
        if block is None:
            return None
        try:
            protos = np.asarray(block["prototypes"], dtype=np.float64)
            threshold = float(block["threshold"])
        except (TypeError, KeyError, ValueError) as exc:
            raise ModelError(
                f"metadata {METADATA_KEY} must hold 'prototypes' [K, D] and a 'threshold' ({exc})"
            ) from exc
        if protos.ndim != 2 or protos.size == 0 or not math.isfinite(threshold):
            raise ModelError(
                f"metadata {METADATA_KEY} has prototypes of shape {protos.shape} and threshold "
                f"{threshold}; expected [K, D] and a finite number"
            )
        return cls(unit(protos), threshold, dict(block))

    def scores(self, embedding: np.ndarray) -> np.ndarray:
        """float64 ``[N]`` :func:`ood_scores` of ``[N, D]`` embeddings."""
        z = np.atleast_2d(embedding)
        if z.shape[-1] != self.prototypes.shape[1]:
            raise ValueError(
                f"embeddings have {z.shape[-1]} dimensions, the prototypes {self.prototypes.shape[1]}"
            )
        return ood_scores(z, self.prototypes)

    def flagged(self, embedding: np.ndarray) -> np.ndarray:
        """bool ``[N]``: which embeddings are out of distribution."""
        return self.scores(embedding) < self.threshold


# --------------------------------------------------------------------------------------------
# all flags


class Flagger:
    """Every flag of chip pairs, for one model.

    Args:
        metadata: the model's parsed metadata (:attr:`runtime.predictor.Predictor.metadata`); its
            ``ood`` prop, when present, enables the ``ood`` flag.
        misaligned_px: the ``misaligned`` limit in chip pixels (shifts measured on chips).
        context_px: the ``misaligned`` limit in source pixels (shifts measured around the
            building, given to :meth:`pair` as ``context_px``).
        measure_shift: ``(pre, post) -> shift in chip pixels or None``, the residual pre/post
            shift of a chip pair, used when no shift is given; None: :data:`MEASURE_SHIFT`.

    Attributes:
        ood: the :class:`OodCheck` of the model, None when it carries no prototypes.
    """

    def __init__(
        self,
        metadata: Mapping[str, Any] | None = None,
        misaligned_px: float = MISALIGNED_PX,
        measure_shift: Callable[[np.ndarray, np.ndarray], float | None] | None = None,
        context_px: float = MISALIGNED_CONTEXT_PX,
    ) -> None:
        self.ood = OodCheck.from_metadata(metadata)
        self.misaligned_px = float(misaligned_px)
        self.context_px = float(context_px)
        self.measure_shift = measure_shift if measure_shift is not None else MEASURE_SHIFT

    @property
    def checks(self) -> list[str]:
        """The flags this flagger can raise (``ood`` only with prototypes, ``misaligned`` only
        with a shift measurement; ``oversized`` is scoring's, on detected footprints)."""
        off = {OVERSIZED} | ({OOD} if self.ood is None else set())
        if self.measure_shift is None:
            off.add(MISALIGNED)
        return [f for f in FLAGS if f not in off]

    def pair(
        self,
        pre: np.ndarray,
        post: np.ndarray,
        embedding: np.ndarray | None = None,
        shift_px: float | None = None,
        context_px: float | None = None,
    ) -> list[str]:
        """The flags of one uint8 ``[H, W, 3]`` chip pair, in :data:`FLAGS` order.

        Args:
            pre, post: the chips as cut for the model.
            embedding: the model's ``[D]`` embedding of the pair (None: not scored, no ``ood``).
            shift_px: residual pre/post shift in chip pixels (None: measured by
                :attr:`measure_shift` when there is one); not used with ``context_px``.
            context_px: residual shift in source pixels measured on the imagery around the
                building (:func:`data_prep.residual.context_residual`; NaN: measured, no
                clear shift); None: only the chips are measured.
        """
        if blank_flag(pre, post):
            return [BLANK]
        if context_px is not None:
            shift_px, limit = context_px, self.context_px
        else:
            limit = self.misaligned_px
            if shift_px is None and self.measure_shift is not None:
                shift_px = self.measure_shift(pre, post)
        out = []
        sky = sky_flag(pre, post)
        if sky:
            out.append(sky)
        if misaligned_flag(shift_px, limit):
            out.append(MISALIGNED)
        if embedding is not None and self.ood is not None and self.ood.flagged(embedding)[0]:
            out.append(OOD)
        return out

    def batch(
        self,
        pre: np.ndarray,
        post: np.ndarray,
        embedding: np.ndarray | None = None,
        shift_px: Sequence[float | None] | None = None,
        context_px: Sequence[float | None] | None = None,
        ood_scores: np.ndarray | None = None,
    ) -> list[list[str]]:
        """The flags of ``N`` chip pairs: uint8 ``[N, H, W, 3]`` chips, ``[N, D]`` embeddings,
        ``N`` chip shifts and ``N`` context shifts (None, or a None entry: as in :meth:`pair`);
        ``ood_scores``: the embeddings' :meth:`OodCheck.scores` when the caller has them already.

        The same flags as :meth:`pair` of each pair, with the blank and sky checks done on the
        whole batch at once (:func:`data_prep.quality.blank_reasons`, :func:`sky_flags`)."""
        n = len(pre)
        ood = np.zeros(n, bool)
        if self.ood is not None and n:
            if ood_scores is not None:
                ood = np.asarray(ood_scores) < self.ood.threshold
            elif embedding is not None:
                ood = self.ood.flagged(embedding)
        pre, post = np.asarray(pre), np.asarray(post)
        blank = blank_reasons(pre, post) if n else []
        sky = sky_flags(pre, post) if n else []
        out = []
        for i in range(n):
            if blank[i] is not None:
                out.append([BLANK])
                continue
            shift = None if shift_px is None else shift_px[i]
            context = None if context_px is None else context_px[i]
            if context is not None:
                shift, limit = context, self.context_px
            else:
                limit = self.misaligned_px
                if shift is None and self.measure_shift is not None:
                    shift = self.measure_shift(pre[i], post[i])
            flags = [sky[i]] if sky[i] else []
            if misaligned_flag(shift, limit):
                flags.append(MISALIGNED)
            if ood[i]:
                flags.append(OOD)
            out.append(flags)
        return out


def pair_flags(
    pre: np.ndarray,
    post: np.ndarray,
    embedding: np.ndarray | None = None,
    metadata: Mapping[str, Any] | None = None,
    shift_px: float | None = None,
) -> list[str]:
    """The flags of one chip pair (see :meth:`Flagger.pair`); builds a :class:`Flagger` from
    ``metadata`` each call, so loops should make one :class:`Flagger` instead."""
    return Flagger(metadata).pair(pre, post, embedding, shift_px)
