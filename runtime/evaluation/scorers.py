"""Model wrappers for evaluation: a run folder (PyTorch) or an exported ONNX model, one interface.

Both are :class:`Scorer` objects whose :meth:`Scorer.score` turns a list of chips into a
:class:`Scored` bundle (labels, logits, probabilities, ``z``, and ``e_post`` where the backend
exposes it). This module and :class:`OnnxScorer` are torch-free; a second, augmented view needs
the training augmentation, so torch, and is handed in (:data:`SecondView`,
:func:`local_damage.evaluation.torch_scorer.augmented_view`). The PyTorch backend is
:class:`local_damage.evaluation.torch_scorer.TorchScorer`, and the ``evaluate`` command picks
one. Everything after scoring (metrics, representation geometry, figures, files) is
:mod:`runtime.evaluation.evaluate`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.errors import LocalDamageError
from data_prep.spec import ChipSpec
from data_prep.store import ChipReader, read_manifest
from runtime.predictor import Predictor
from runtime.training_tiles import TrainingTiles, training_tiles

METRICS_JSON = "metrics.json"

#: A second view of chips: ``(chips, chip_ids, input_size, seed)`` to a sequence of
#: ``(pre, post, label)`` items, pre and post ``[3, input_size, input_size]`` arrays (or tensors)
#: of the training augmentation, seeded per chip, in manifest order.
SecondView = Callable[[Path, Sequence[str], int, int], Sequence[tuple]]


class EvaluationError(LocalDamageError, ValueError):
    """Input that cannot be evaluated: names the file at fault and what to do."""


# --------------------------------------------------------------------------------------------
# model outputs on a set of chips


@dataclass
class Scored:
    """A model's outputs on N chips, row i = ``chip_ids[i]``.

    Attributes:
        chip_ids: the N chip ids, in the order scored.
        labels: int64 [N] true class ids.
        logits: float32 [N, K] raw class scores.
        probabilities: float32 [N, K] softmax of the logits, divided by the model's temperature
            when it has one (:attr:`Scorer.temperature`).
        z: float32 [N, D] L2-normalised joint embedding of the unaugmented chips.
        e_post: float32 [N, D] L2-normalised post-image embedding, or None (ONNX models).
        z_view2: float32 [N, D] z of a second, augmented view of each chip, or None.
        graded: int64 [N] grades under a false-alarm cost other than 1
            (:func:`runtime.grading.grades` of the probabilities), or None: the most probable.
    """

    chip_ids: list[str]
    labels: np.ndarray
    logits: np.ndarray
    probabilities: np.ndarray
    z: np.ndarray
    e_post: np.ndarray | None = None
    z_view2: np.ndarray | None = None
    graded: np.ndarray | None = None

    @property
    def predictions(self) -> np.ndarray:
        """int64 [N] predicted class ids: :attr:`graded` where set, else the argmax of the
        logits."""
        if self.graded is not None:
            return self.graded
        return self.logits.argmax(axis=1).astype("int64")


class Scorer:
    """A trained model that scores chip pairs of a chip store.

    Attributes:
        source: where the model came from, e.g. ``{"run": "RUN"}`` or ``{"model": "m.onnx"}``.
        spec: the chip spec the model was trained with (None when unknown).
        class_names: the K class names, in label order.
        input_size: side of the model input in pixels.
        temperature: the calibration temperature its probabilities are computed with; None when
            uncalibrated.
        training_tiles: the tiles it was trained on (:mod:`runtime.training_tiles`), so that
            figures computed on them are marked.
        false_alarm_cost: the model's own grade rule (:mod:`runtime.grading`; 1: the most
            probable grade), which an evaluation grades with unless told otherwise.
    """

    source: dict[str, str]
    spec: ChipSpec | None
    class_names: tuple[str, ...]
    input_size: int
    temperature: float | None = None
    training_tiles: TrainingTiles = TrainingTiles(None, "the model's training tiles are unknown")
    false_alarm_cost: float = 1.0

    def score(
        self,
        chips: str | Path,
        chip_ids: Sequence[str],
        views: int = 1,
        batch_size: int = 64,
        seed: int = 0,
        progress: bool = False,
    ) -> Scored:
        """Score ``chip_ids`` of the store ``chips``.

        Args:
            chips: chip store folder.
            chip_ids: ids of labelled chips to score.
            views: 1, or 2 to also embed a second view made with the training augmentation.
            batch_size: pairs per forward pass.
            seed: seed of the second view's augmentation.
            progress: show a progress bar.

        Returns:
            A :class:`Scored` bundle, rows in manifest order.
        """
        raise NotImplementedError


def check_views(views: int) -> None:
    """Raise ValueError unless ``views`` is 1 or 2."""
    if views not in (1, 2):
        raise ValueError(f"views must be 1 or 2, got {views}")


class OnnxScorer(Scorer):
    """An exported ONNX model run through :class:`runtime.predictor.Predictor` (the serving path).

    The first view passes the stored chips as they are (the predictor resizes them itself); the
    second view passes the training augmentation's output at the predictor's input size.

    Args:
        model: the ONNX file.
        tta: test-time augmentation (``runtime.predictor.TTA_VIEWS``).
        second_view: the second view's chips (the training augmentation, so torch:
            :func:`local_damage.evaluation.torch_scorer.augmented_view`); None scores one view
            only.
    """

    def __init__(self, model: str | Path, tta: str = "none", second_view: SecondView | None = None):
        model = Path(model)
        if not model.is_file():
            raise EvaluationError(f"{model}: ONNX model not found")
        self.predictor = Predictor(model, tta=tta)
        self.source = {"model": str(model)}
        if tta != "none":
            self.source["tta"] = tta
        self.spec = self.predictor.spec
        self.class_names = tuple(self.predictor.class_names)
        self.input_size = int(self.predictor.input_size)
        self.temperature = self.predictor.temperature
        self.false_alarm_cost = self.predictor.false_alarm_cost
        self.training_tiles = training_tiles(self.predictor.metadata)
        self.second_view = second_view

    def _predict(self, batches: Iterator[tuple], batch_size: int):
        labels, logits, probs, z = [], [], [], []
        for pre, post, y in batches:
            result = self.predictor.predict(pre, post, batch_size=batch_size)
            labels.append(np.asarray(y))
            logits.append(np.asarray(result.logits, dtype=np.float32))
            probs.append(np.asarray(result.probabilities, dtype=np.float32))
            z.append(np.asarray(result.embedding, dtype=np.float32))
        return (
            np.concatenate(labels),
            np.concatenate(logits),
            np.concatenate(probs),
            np.concatenate(z),
        )

    def score(self, chips, chip_ids, views=1, batch_size=64, seed=0, progress=False) -> Scored:
        from tqdm import tqdm

        check_views(views)
        if views == 2 and self.second_view is None:
            raise EvaluationError(
                "a second view needs the training augmentation (PyTorch): give the scorer a "
                "second_view, or score one view"
            )
        chips = Path(chips)
        frame = read_manifest(chips)
        wanted = set(chip_ids)
        missing = sorted(wanted - set(frame["chip_id"]))
        if missing:
            raise EvaluationError(
                f"{chips}: {len(missing)} chip id(s) not in the manifest, e.g. {missing[:3]}"
            )
        # manifest order, as ChipPairDataset (the second view) keeps it
        records = frame[frame["chip_id"].isin(wanted)].to_dict("records")
        ids = [r["chip_id"] for r in records]
        reader = ChipReader(chips)

        def stored() -> Iterator[tuple]:
            steps = range(0, len(records), batch_size)
            for start in tqdm(steps, desc="evaluate", disable=not progress, leave=False):
                pairs = [reader.pair(r) for r in records[start : start + batch_size]]
                yield (
                    np.stack([p[0] for p in pairs]),
                    np.stack([p[1] for p in pairs]),
                    np.array([int(r["label"]) for r in records[start : start + batch_size]]),
                )

        labels, logits, probs, z = self._predict(stored(), batch_size)
        z_view2 = None
        if views == 2:
            dataset = self.second_view(chips, ids, self.input_size, seed)

            def augmented() -> Iterator[tuple]:
                for start in range(0, len(dataset), batch_size):
                    items = [
                        dataset[i] for i in range(start, min(start + batch_size, len(dataset)))
                    ]
                    yield (
                        np.stack([np.asarray(it[0]).transpose(1, 2, 0) for it in items]),
                        np.stack([np.asarray(it[1]).transpose(1, 2, 0) for it in items]),
                        np.array([it[2] for it in items]),
                    )

            z_view2 = self._predict(augmented(), batch_size)[3]
        return Scored(ids, labels.astype("int64"), logits, probs, z, None, z_view2)
