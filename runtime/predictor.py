"""The ONNX Runtime predictor shared by the scoring commands and the web app (no torch).

A local-damage model file (written by ``local-damage export``) takes uint8 RGB chip pairs
``pre`` / ``post`` ``[N, S, S, 3]`` and returns ``logits`` ``[N, K]`` and ``embedding`` ``[N, D]``;
its metadata props (JSON text) carry the class names, the chip spec the chips must be cut with,
the input size ``S`` and what the model card shows. :class:`Predictor` opens one such file, checks
it, and scores chip pairs of any size.

A model calibrated by ``local-damage calibrate`` (or ``export --calibrate-fold``) carries a
temperature ``T`` in its ``calibration`` metadata prop (:mod:`runtime.calibration`); the predictor
returns ``softmax(logits / T)`` as the probabilities, so every scoring path (``score``,
``score-batch``, the web app, ``evaluate`` of an ONNX model) gives calibrated probabilities.

A model adapted to a new event by ``local-damage adapt`` carries a head in its ``adaptation``
metadata prop (:mod:`app.adapt.fit`): the predictor computes the head's scores from the graph's raw
logits and embedding and returns them as ``logits`` (the graph's own output stays in
``raw_logits``); the probabilities are their softmax, divided by ``T`` as above. A model without
that prop returns the graph's raw output as ``logits``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from data_prep.spec import ChipSpec
from data_prep.windows import resize_chip
from runtime.calibration import read_temperature
from runtime.contract import (
    CHANGE_MAP,
    INPUT_NAMES,
    OUTPUT_NAMES,
    REQUIRED_METADATA,
    SUPPORTED_FORMAT_VERSIONS,
    ModelError,
    open_session,
    session_options,
)
from runtime.exchange import find_cut, head_model, with_outputs
from runtime.flags import ood_summary
from runtime.grading import GRADE_RULE_KEY, NO_DAMAGE, grade_rule_block, read_default_cost
from runtime.head import adaptation_summary, read_head

#: Test-time augmentation: the views of a chip pair whose outputs are averaged, as
#: ``(quarter turns, mirrored)``. Overhead imagery has no up or down, so a turned or mirrored
#: pair shows the same building; ``none`` is the pair as it is.
TTA_VIEWS: dict[str, tuple[tuple[int, bool], ...]] = {
    "none": ((0, False),),
    "flips": ((0, False), (2, False), (0, True), (2, True)),
    "d8": tuple((k, m) for m in (False, True) for k in range(4)),
}


#: The largest encoder output of a pair (both halves, float32) kept for grading it exchanged
#: (:meth:`Predictor.exchanged`): the order check keeps up to 64 pairs. A model whose last
#: feature map is larger (a deep encoder at a large input size) grades them exchanged through
#: the whole network instead, from the chips it keeps anyway.
MAX_SIDES_BYTES = 1 << 20


def tta_view(chips: np.ndarray, turns: int, mirrored: bool) -> np.ndarray:
    """``[N, H, W, C]`` chips turned by ``turns`` quarter turns, then mirrored left-right."""
    out = np.rot90(chips, turns, axes=(1, 2)) if turns else chips
    return out[:, :, ::-1] if mirrored else out


class Prediction(NamedTuple):
    """Scores of ``N`` chip pairs.

    Attributes:
        logits: ``[N, K]`` float32 class scores: the graph's raw output, or for an adapted model
            the adapted head's scores (:mod:`app.adapt.fit`).
        probabilities: ``[N, K]`` float32 ``softmax(logits / T)`` with the model's temperature
            ``T`` (1 for an uncalibrated model); rows sum to 1.
        embedding: ``[N, D]`` float32 unit-norm joint embedding ``z``.
        change_map: ``[N, 1, S, S]`` float32 latent feature-correlation map (channel-averaged
            pre/post feature difference, Sec. 3.4 of the paper), only when asked for and the model
            has it; None otherwise.
        raw_logits: ``[N, K]`` float32 raw output of the graph (the same array as ``logits``
            for a model without an adapted head).
        sides: ``[N, 2, ...]`` float32, each pair's encoder output for its pre and its post chip
            (:mod:`runtime.exchange`), only when asked for and the model allows it; what
            :meth:`Predictor.exchanged` grades the pairs exchanged from.
    """

    logits: np.ndarray
    probabilities: np.ndarray
    embedding: np.ndarray
    change_map: np.ndarray | None = None
    raw_logits: np.ndarray | None = None
    sides: np.ndarray | None = None


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax of ``[N, K]`` logits, float32, numerically stable."""
    x = np.asarray(logits, dtype=np.float32)
    if x.size == 0:
        return x.copy()
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def resize_chips(chips: np.ndarray, size: int) -> np.ndarray:
    """Resize uint8 ``[N, H, W, 3]`` chips to ``[N, size, size, 3]``.

    Uses :func:`data_prep.windows.resize_chip`, the resampler training uses, so a model sees the
    same pixels in service as in training; returned unchanged when already at ``size``.
    """
    n, h, w = chips.shape[:3]
    if h == size and w == size:
        return chips
    if h != w:
        raise ValueError(f"chips must be square, got {h}x{w}")

    out = np.empty((n, size, size, 3), np.uint8)
    for i in range(n):
        out[i] = resize_chip(chips[i], size)
    return out


class Predictor:
    """One ONNX Runtime session over a local-damage model file.

    Args:
        path: the ``.onnx`` model file.
        providers: onnxruntime execution providers in order of preference (default: CUDA when
            available, then CPU).
        threads: intra-op threads (default: onnxruntime's choice, one per physical core).
        tta: test-time augmentation, a key of :data:`TTA_VIEWS`: each pair is graded in every
            view (turned and mirrored alike, pre and post) and the raw logits and the unit
            embeddings are averaged (the embedding renormalised); the change map is the plain
            view's. ``flips`` costs 4 and ``d8`` 8 network passes a pair.

    Attributes:
        path: the model file.
        spec: the :class:`~data_prep.spec.ChipSpec` chips must be cut with.
        class_names: the ``K`` class names, in logit order.
        input_size: side ``S`` of the model input in pixels.
        embedding_dim: ``D``, the width of the embedding.
        metadata: every metadata prop, parsed from JSON.
        has_change_map: whether the model also outputs ``change_map`` (exported with
            ``--change-map``).
        temperature: the calibration temperature ``T`` the probabilities are computed with;
            None for an uncalibrated model (``T = 1``).
        head: the adapted head (:class:`runtime.head.Head`) applied to the graph's output; None
            for a model that was not adapted.
        false_alarm_cost: the false-alarm cost the model's grades are given with when the
            analyst sets none (its ``grade_rule`` metadata, :mod:`runtime.grading`; 1, the most
            probable grade, when it has none).
        providers: the providers the session actually uses.

    Raises:
        ModelError: the file is missing, is not an ONNX model, lacks a required metadata prop,
            or its inputs/outputs are not those of a local-damage model, or its calibration
            metadata holds no valid temperature, or its grade rule no valid false-alarm cost.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        providers: Sequence[str] | None = None,
        threads: int | None = None,
        tta: str = "none",
    ) -> None:
        if tta not in TTA_VIEWS:
            raise ValueError(
                f"unknown test-time augmentation {tta!r}; one of {', '.join(TTA_VIEWS)}"
            )
        self.tta = tta
        self.path = Path(path)
        self._session, self.metadata = open_session(self.path, providers, threads, "model")
        self.providers: list[str] = list(self._session.get_providers())
        self._threads = threads
        # the encoder/head cut (runtime.exchange): unknown until sides are first asked for
        self._cut: object = None
        self._head = None
        self._check()

    def _fail(self, problem: str) -> ModelError:
        return ModelError(f"{self.path}: {problem}")

    def _check(self) -> None:
        """Validate metadata, inputs and outputs; set spec, class_names, sizes."""
        md = self.metadata
        if md.get("task") == "localize":
            raise self._fail(
                "is a building localiser (metadata task 'localize'), not a damage model; give it "
                "as --localizer, and a damage model from `local-damage export` as --model"
            )
        missing = [k for k in REQUIRED_METADATA if k not in md]
        if missing:
            raise self._fail(
                f"missing metadata key(s) {', '.join(missing)}; not a model written by "
                "`local-damage export`"
            )
        if md["format_version"] not in SUPPORTED_FORMAT_VERSIONS:
            raise self._fail(
                f"model format version {md['format_version']!r} is not supported (this version "
                f"reads {', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}); update local-damage"
            )
        names = md["class_names"]
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise self._fail(f"metadata class_names must be a list of names, got {names!r}")
        self.class_names: tuple[str, ...] = tuple(names)
        size = md["input_size"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise self._fail(f"metadata input_size must be a positive integer, got {size!r}")
        self.input_size: int = size
        try:
            if not isinstance(md["chip_spec"], dict):
                raise TypeError("not a mapping")
            self.spec: ChipSpec = ChipSpec.from_dict(md["chip_spec"])
        except (TypeError, ValueError) as exc:
            raise self._fail(f"metadata chip_spec {md['chip_spec']!r} is invalid ({exc})") from exc

        inputs = {i.name: i for i in self._session.get_inputs()}
        if sorted(inputs) != sorted(INPUT_NAMES):
            raise self._fail(
                f"inputs are {sorted(inputs)}, expected exactly {list(INPUT_NAMES)} "
                "(uint8 [N, H, W, 3] chips)"
            )
        for name in INPUT_NAMES:
            arg = inputs[name]
            if arg.type != "tensor(uint8)":
                raise self._fail(f"input {name!r} has type {arg.type}, expected tensor(uint8)")
            shape = list(arg.shape)
            static_hw = [d for d in shape[1:3] if isinstance(d, int)]
            if len(shape) != 4 or shape[3] != 3 or any(d != size for d in static_hw):
                raise self._fail(
                    f"input {name!r} has shape {shape}, expected [N, {size}, {size}, 3]"
                )
        outputs = {o.name: o for o in self._session.get_outputs()}
        absent = [n for n in OUTPUT_NAMES if n not in outputs]
        if absent:
            raise self._fail(
                f"outputs are {sorted(outputs)}; missing {', '.join(absent)} "
                f"(expected {list(OUTPUT_NAMES)})"
            )
        k = outputs["logits"].shape[-1] if outputs["logits"].shape else None
        if isinstance(k, int) and k != len(self.class_names):
            raise self._fail(
                f"logits have {k} classes but metadata class_names lists {len(self.class_names)}"
            )
        self.has_change_map: bool = CHANGE_MAP in outputs
        d = outputs["embedding"].shape[-1] if outputs["embedding"].shape else None
        self.embedding_dim: int = d if isinstance(d, int) else int(md.get("embedding_dim") or 0)

        try:
            self.temperature: float | None = read_temperature(md, self.path)
        except ValueError as exc:
            raise ModelError(str(exc)) from exc

        try:
            self.head = read_head(md, len(self.class_names), self.embedding_dim, self.path)
            self.false_alarm_cost: float = read_default_cost(md, self.path)
        except ValueError as exc:
            raise ModelError(str(exc)) from exc
        if self.false_alarm_cost != 1.0 and NO_DAMAGE not in self.class_names:
            raise self._fail(
                f"metadata {GRADE_RULE_KEY} sets a false-alarm cost, which needs a "
                f"{NO_DAMAGE!r} class; its classes are {', '.join(self.class_names)}"
            )

    def predict(
        self,
        pre: np.ndarray,
        post: np.ndarray,
        batch_size: int = 32,
        change_map: bool = False,
        sides: bool = False,
    ) -> Prediction:
        """Score chip pairs.

        Args:
            pre: uint8 ``[N, H, W, 3]`` RGB chips cut with :attr:`spec` from the pre image; any
                ``H`` and ``W`` (resized to :attr:`input_size`).
            post: the same buildings from the post image, same shape.
            batch_size: pairs per ONNX Runtime call.
            change_map: also return the latent correlation map when the model has it
                (:attr:`has_change_map`).
            sides: also return each pair's encoder output for :meth:`exchanged`, when the model
                allows it (:attr:`can_exchange`); None in :attr:`Prediction.sides` otherwise.

        Returns:
            A :class:`Prediction`; ``N = 0`` gives empty ``[0, K]`` and ``[0, D]`` arrays.

        Raises:
            ValueError: the arrays are not uint8 ``[N, H, W, 3]`` of equal shape.
        """
        pre, post = np.asarray(pre), np.asarray(post)
        for name, arr in (("pre", pre), ("post", post)):
            if arr.ndim != 4 or arr.shape[-1] != 3:
                raise ValueError(f"{name} chips must be [N, H, W, 3] RGB, got shape {arr.shape}")
            if arr.dtype != np.uint8:
                raise ValueError(f"{name} chips must be uint8 (0-255), got {arr.dtype}")
        if pre.shape != post.shape:
            raise ValueError(f"pre and post chips differ in shape: {pre.shape} vs {post.shape}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        n, k = len(pre), len(self.class_names)
        if n == 0:
            empty = np.zeros((0, k), np.float32)
            return Prediction(
                empty,
                empty.copy(),
                np.zeros((0, self.embedding_dim), np.float32),
                raw_logits=empty.copy(),
            )
        with_map = change_map and self.has_change_map
        names = [*OUTPUT_NAMES, CHANGE_MAP] if with_map else list(OUTPUT_NAMES)
        cut = self._exchange_cut() if sides else None
        if cut is not None:
            names = [*names, *cut.names]
        logits, embedding, maps, kept = [], [], [], []
        views = TTA_VIEWS[self.tta]
        for i in range(0, n, batch_size):
            a = resize_chips(pre[i : i + batch_size], self.input_size)
            b = resize_chips(post[i : i + batch_size], self.input_size)
            lo_sum = z_sum = None
            for j, (turns, mirrored) in enumerate(views):
                got = self._session.run(
                    names if j == 0 else list(OUTPUT_NAMES),
                    {
                        "pre": np.ascontiguousarray(tta_view(a, turns, mirrored)),
                        "post": np.ascontiguousarray(tta_view(b, turns, mirrored)),
                    },
                )
                lo_v = np.asarray(got[0], dtype=np.float32)
                z_v = np.asarray(got[1], dtype=np.float32)
                lo_sum = lo_v if lo_sum is None else lo_sum + lo_v
                z_sum = z_v if z_sum is None else z_sum + z_v
                if with_map and j == 0:
                    maps.append(np.asarray(got[2], dtype=np.float32))
                if cut is not None and j == 0:
                    kept.append(self._sides(got[len(names) - len(cut.names) :], len(a)))
            if len(views) > 1:
                lo_sum = lo_sum / np.float32(len(views))
                norm = np.linalg.norm(z_sum, axis=1, keepdims=True)
                z_sum = z_sum / np.maximum(norm, np.float32(1e-12))
            logits.append(lo_sum)
            embedding.append(z_sum)
        return self._prediction(
            np.concatenate(logits),
            np.concatenate(embedding),
            np.concatenate(maps) if maps else None,
            np.concatenate(kept) if kept and all(k is not None for k in kept) else None,
        )

    def _prediction(self, raw, z, maps=None, sides=None) -> Prediction:
        """The :class:`Prediction` of the graph's raw logits and embedding: the adapted head's
        scores where the model has one, probabilities at the model's temperature."""
        lo = raw if self.head is None else self.head.scores(raw, z)
        return Prediction(lo, self.probabilities(lo), z, maps, raw, sides)

    @property
    def can_exchange(self) -> bool:
        """Whether :meth:`exchanged` can grade pairs from their :attr:`Prediction.sides`: the
        graph splits into encoder and head (:func:`runtime.exchange.find_cut`) and the pairs are
        graded in one view (no test-time augmentation)."""
        return self._exchange_cut() is not None

    def _exchange_cut(self):
        """The cut, building the session that outputs it and the head's session on first use;
        None where the model has none (or uses test-time augmentation)."""
        if self._cut is None:
            self._cut = False
            if self.tta == "none":
                import onnx

                try:
                    proto = onnx.load(str(self.path))
                    cut = find_cut(proto)
                    if cut is not None:
                        session = self._open(with_outputs(proto, cut))
                        self._head = self._open(head_model(proto, cut))
                        self._session, self._cut = session, cut
                except Exception:  # noqa: BLE001 - any failure: the whole graph grades exchanged
                    self._cut = False
        return self._cut or None

    def _open(self, proto):
        """An ONNX Runtime session over an in-memory graph, with this predictor's providers and
        threads."""
        import onnxruntime as ort

        return ort.InferenceSession(
            proto.SerializeToString(), session_options(self._threads), providers=self.providers
        )

    def _sides(self, got: Sequence[np.ndarray], n: int) -> np.ndarray | None:
        """``[n, 2, ...]`` from the cut's tensors of one run of ``n`` pairs; None (and no more
        tries) when the slices' bounds are not the batch size, as the cut supposes, or a pair's
        two halves are larger than :data:`MAX_SIDES_BYTES`."""
        features, *bounds = got
        if (
            any(np.asarray(b).ravel().tolist() != [n] for b in bounds)
            or len(features) != 2 * n
            or 2 * features[0].size * 4 > MAX_SIDES_BYTES
        ):
            self._cut = False
            return None
        features = np.asarray(features, dtype=np.float32)
        return np.stack([features[:n], features[n:]], axis=1)

    def exchanged(self, sides: np.ndarray) -> Prediction:
        """Grade pairs with pre and post exchanged from their :attr:`Prediction.sides`: the
        same :class:`Prediction` (adapted head and temperature included) as :meth:`predict`
        of the chips given the other way round, bit for bit, at the cost of the graph's head.

        Raises:
            ValueError: the model cannot (:attr:`can_exchange`).
        """
        cut = self._exchange_cut()
        if cut is None:
            raise ValueError(f"{self.path}: cannot grade pairs exchanged from their sides")
        sides = np.asarray(sides, dtype=np.float32)
        n = len(sides)
        feed = {cut.features: np.ascontiguousarray(np.concatenate([sides[:, 1], sides[:, 0]]))}
        feed.update({b: np.array([n], dtype=np.int64) for b in cut.bounds})
        raw, z = (np.asarray(x, dtype=np.float32) for x in self._head.run(list(OUTPUT_NAMES), feed))
        return self._prediction(raw, z)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """Class probabilities of ``[N, K]`` logits (:attr:`Prediction.logits`):
        ``softmax(logits / T)``, float32."""
        lo = np.asarray(logits, dtype=np.float32)
        return softmax(lo if self.temperature is None else lo / np.float32(self.temperature))

    def card(self) -> dict[str, Any]:
        """What a model picker shows: name, classes, training data, validation and held-out test
        metrics, calibration, the ``ood`` flag's threshold and where it came from (None: the
        model never flags ``ood``), the grade rule it gives grades with when the analyst sets no
        false-alarm cost (``grade_rule``), the adapted head without its weights (None: not adapted),
        licence, chip spec, input size, precision, parity, the
        providers in use and the test-time augmentation (``tta``)."""

        md = self.metadata
        config = md.get("config") or {}
        model_cfg = config.get("model", {}) if isinstance(config, dict) else {}
        loss_cfg = config.get("loss", {}) if isinstance(config, dict) else {}
        return {
            "name": self.path.stem,
            "path": str(self.path),
            "size_mb": round(self.path.stat().st_size / 1e6, 2),
            "classes": list(self.class_names),
            "encoder": model_cfg.get("encoder"),
            "method": loss_cfg.get("method"),
            "precision": md.get("precision", "fp32"),
            "input_size": self.input_size,
            "embedding_dim": self.embedding_dim,
            "chip_spec": self.spec.to_dict(),
            "training_data": md.get("training_data"),
            "validation_metrics": md.get("validation_metrics"),
            "test_metrics": md.get("test_metrics"),
            "calibration": md.get("calibration"),
            "grade_rule": grade_rule_block(self.false_alarm_cost),
            "ood": ood_summary(md),
            "adaptation": adaptation_summary(md),
            "license": md.get("license"),
            "parity": md.get("parity"),
            "created_by": md.get("created_by"),
            "created": md.get("created"),
            "format_version": md.get("format_version"),
            "providers": list(self.providers),
            "tta": self.tta,
        }

    def __repr__(self) -> str:
        return (
            f"Predictor({str(self.path)!r}, classes={len(self.class_names)}, "
            f"input_size={self.input_size}, providers={self.providers})"
        )
