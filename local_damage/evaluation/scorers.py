"""Model wrappers for evaluation: a run folder (PyTorch) or an exported ONNX model, one interface.

Both are :class:`Scorer` objects whose :meth:`Scorer.score` turns a list of chips into a
:class:`Scored` bundle (labels, logits, probabilities, ``z``, and ``e_post`` where the backend
exposes it); :func:`load_scorer` picks the backend. Everything after scoring (metrics,
representation geometry, figures, files) is :mod:`local_damage.evaluation.evaluate`'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from data_prep.errors import LocalDamageError

if TYPE_CHECKING:
    import numpy as np

    from data_prep.spec import ChipSpec

METRICS_JSON = "metrics.json"


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
    """

    chip_ids: list[str]
    labels: np.ndarray
    logits: np.ndarray
    probabilities: np.ndarray
    z: np.ndarray
    e_post: np.ndarray | None = None
    z_view2: np.ndarray | None = None

    @property
    def predictions(self) -> np.ndarray:
        """int64 [N] predicted class ids (argmax of the logits)."""
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
    """

    source: dict[str, str]
    spec: ChipSpec | None
    class_names: tuple[str, ...]
    input_size: int
    temperature: float | None = None

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


def _check_views(views: int) -> None:
    if views not in (1, 2):
        raise ValueError(f"views must be 1 or 2, got {views}")


def _augmented_view(chips: Path, chip_ids: Sequence[str], input_size: int, seed: int):
    """Dataset of the second view: the training augmentation, seeded per chip."""
    from local_damage.data import ChipPairDataset

    dataset = ChipPairDataset(chips, chip_ids, input_size, augment=True, seed=seed)
    dataset.set_epoch(0)
    return dataset


class TorchScorer(Scorer):
    """The model of a run folder (``config.yaml`` + ``best.safetensors``), run with PyTorch.

    Chips are resized to the run's ``data.input_size`` and normalised as in training; the model
    runs in eval mode without gradients, with the run's ``train.amp`` setting on ``device``.
    """

    def __init__(self, run: str | Path, device: str = "auto"):
        from local_damage.config import load_yaml
        from local_damage.train import checkpoint as ckpt
        from local_damage.train.config import Config

        run = Path(run)
        if not run.is_dir():
            raise FileNotFoundError(f"{run}: run folder not found")
        config = run / "config.yaml"
        if not config.is_file():
            raise FileNotFoundError(
                f"{run}: no config.yaml; not a run folder (make one with `local-damage train`)"
            )
        weights = run / ckpt.BEST
        if not weights.is_file():
            raise FileNotFoundError(f"{run}: no {ckpt.BEST}; the run has not finished an epoch yet")
        self.cfg = load_yaml(Config, config)
        self.run = run
        self.summary = _read_summary(run)
        self.source = {"run": str(run)}
        spec = self.summary.get("chip_spec")
        self.spec = _spec_from(spec) if spec else None
        from data_prep.spec import CLASS_NAMES

        self.class_names = tuple(CLASS_NAMES[: self.cfg.model.num_classes])
        self.input_size = int(self.cfg.data.input_size)
        self.device_name = self.cfg.train.device if device == "auto" else device
        self._weights = weights
        self._model = None

    @property
    def model(self):
        """The rebuilt model (built on first use)."""
        if self._model is None:
            from local_damage.models import build_model
            from local_damage.train import checkpoint as ckpt
            from local_damage.train.loop import model_config_for, resolve_device

            self.device = resolve_device(self.device_name)
            model = build_model(model_config_for(self.cfg))
            ckpt.load_weights(model, self._weights)
            self._model = model.to(self.device).eval()
        return self._model

    def _forward(self, dataset, batch_size: int, progress: bool, desc: str, full: bool):
        import numpy as np
        import torch
        from torch.utils.data import DataLoader
        from tqdm import tqdm

        from local_damage.data import normalize
        from local_damage.train.loop import autocast_context

        model = self.model
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=False)
        out: dict[str, list] = {"labels": [], "logits": [], "z": [], "e_post": []}
        with torch.inference_mode():
            for pre, post, y in tqdm(loader, desc=desc, disable=not progress, leave=False):
                pre = normalize(pre.to(self.device))
                post = normalize(post.to(self.device))
                with autocast_context(self.cfg.train.amp, self.device):
                    if full:
                        result = model(pre, post)
                        logits, z, e_post = result.logits, result.z, result.e_post
                    else:
                        (logits, z), e_post = model.predict(pre, post), None
                out["labels"].append(y.numpy())
                out["z"].append(z.float().cpu().numpy())
                if full:
                    out["logits"].append(logits.float().cpu().numpy())
                    out["e_post"].append(e_post.float().cpu().numpy())
        return {k: np.concatenate(v) if v else None for k, v in out.items()}

    def score(self, chips, chip_ids, views=1, batch_size=64, seed=0, progress=False) -> Scored:
        from scipy.special import softmax

        from local_damage.data import ChipPairDataset

        _check_views(views)
        chips = Path(chips)
        plain = ChipPairDataset(chips, chip_ids, self.input_size)
        first = self._forward(plain, batch_size, progress, "evaluate", full=True)
        z_view2 = None
        if views == 2:  # the same chips in the same (manifest) order, augmented
            second = _augmented_view(chips, chip_ids, self.input_size, seed)
            z_view2 = self._forward(second, batch_size, progress, "second view", full=False)["z"]
        return Scored(
            chip_ids=[r["chip_id"] for r in plain.records],
            labels=first["labels"].astype("int64"),
            logits=first["logits"],
            probabilities=softmax(first["logits"].astype("float64"), axis=1).astype("float32"),
            z=first["z"],
            e_post=first["e_post"],
            z_view2=z_view2,
        )


class OnnxScorer(Scorer):
    """An exported ONNX model run through :class:`runtime.predictor.Predictor` (the serving path).

    The first view passes the stored chips as they are (the predictor resizes them itself); the
    second view passes the training augmentation's output at the predictor's input size.
    """

    def __init__(self, model: str | Path, tta: str = "none"):
        model = Path(model)
        if not model.is_file():
            raise FileNotFoundError(f"{model}: ONNX model not found")
        from runtime.predictor import Predictor

        self.predictor = Predictor(model, tta=tta)
        self.source = {"model": str(model)}
        if tta != "none":
            self.source["tta"] = tta
        self.spec = self.predictor.spec
        self.class_names = tuple(self.predictor.class_names)
        self.input_size = int(self.predictor.input_size)
        self.temperature = self.predictor.temperature

    def _predict(self, batches: Iterator[tuple], batch_size: int):
        import numpy as np

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
        import numpy as np
        from tqdm import tqdm

        from data_prep.store import ChipReader, read_manifest

        _check_views(views)
        chips = Path(chips)
        frame = read_manifest(chips)
        wanted = set(chip_ids)
        missing = sorted(wanted - set(frame["chip_id"]))
        if missing:
            raise KeyError(
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
            dataset = _augmented_view(chips, ids, self.input_size, seed)

            def augmented() -> Iterator[tuple]:
                for start in range(0, len(dataset), batch_size):
                    items = [
                        dataset[i] for i in range(start, min(start + batch_size, len(dataset)))
                    ]
                    yield (
                        np.stack([it[0].numpy().transpose(1, 2, 0) for it in items]),
                        np.stack([it[1].numpy().transpose(1, 2, 0) for it in items]),
                        np.array([it[2] for it in items]),
                    )

            z_view2 = self._predict(augmented(), batch_size)[3]
        return Scored(ids, labels.astype("int64"), logits, probs, z, None, z_view2)


def _read_summary(run: Path) -> dict[str, Any]:
    import json

    path = run / "summary.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise EvaluationError(f"{path}: not valid JSON ({exc})") from exc


def _spec_from(d: dict) -> ChipSpec:
    from data_prep.spec import ChipSpec

    return ChipSpec.from_dict(d)


def load_scorer(
    run: str | Path | None = None,
    model: str | Path | None = None,
    device: str = "auto",
    tta: str = "none",
) -> Scorer:
    """A :class:`TorchScorer` for a run folder or an :class:`OnnxScorer` for an ONNX file.

    ``tta``: test-time augmentation of the ONNX model (``runtime.predictor.TTA_VIEWS``).

    Raises:
        FileNotFoundError: the run folder lacks config.yaml or best.safetensors, or the ONNX file
            does not exist.
        ValueError: both or neither of ``run`` and ``model``; ``tta`` with a run folder.
    """
    if (run is None) == (model is None):
        raise ValueError("give exactly one of a run folder or an ONNX model")
    if run is not None and tta != "none":
        raise ValueError(
            f"test-time augmentation ({tta}) grades an exported model: export the run and give "
            "it as --model"
        )
    return TorchScorer(run, device=device) if run is not None else OnnxScorer(model, tta)
