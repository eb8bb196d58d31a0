"""The PyTorch backend of evaluation: the model of a run folder as a
:class:`~runtime.evaluation.scorers.Scorer` (the ONNX backend, torch-free, is
:class:`~runtime.evaluation.scorers.OnnxScorer`), and the second, augmented view of chips that
either backend embeds for SAA and SAD (:func:`augmented_view`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.special import softmax
from torch.utils.data import DataLoader
from tqdm import tqdm

from data_prep.spec import CLASS_NAMES, ChipSpec
from local_damage.config import load_yaml
from local_damage.data import ChipPairDataset, normalize
from local_damage.models import build_model
from local_damage.train import checkpoint as ckpt
from local_damage.train.config import Config
from local_damage.train.device import autocast_context, resolve_device
from local_damage.train.loop import model_config_for
from runtime.evaluation.scorers import EvaluationError, Scored, Scorer, check_views
from runtime.training_tiles import run_training_tiles


def augmented_view(
    chips: Path, chip_ids: Sequence[str], input_size: int, seed: int
) -> ChipPairDataset:
    """Dataset of the second view: the training augmentation, seeded per chip (a
    :data:`runtime.evaluation.scorers.SecondView`)."""
    dataset = ChipPairDataset(chips, chip_ids, input_size, augment=True, seed=seed)
    dataset.set_epoch(0)
    return dataset


class TorchScorer(Scorer):
    """The model of a run folder (``config.yaml`` + ``best.safetensors``), run with PyTorch.

    Chips are resized to the run's ``data.input_size`` and normalised as in training; the model
    runs in eval mode without gradients, with the run's ``train.amp`` setting on ``device``.

    Raises:
        EvaluationError: the folder is not a run folder, or has no best weights yet.
    """

    def __init__(self, run: str | Path, device: str = "auto"):
        run = Path(run)
        if not run.is_dir():
            raise EvaluationError(f"{run}: run folder not found")
        config = run / "config.yaml"
        if not config.is_file():
            raise EvaluationError(
                f"{run}: no config.yaml; not a run folder (make one with `local-damage train`)"
            )
        weights = run / ckpt.BEST
        if not weights.is_file():
            raise EvaluationError(f"{run}: no {ckpt.BEST}; the run has not finished an epoch yet")
        self.cfg = load_yaml(Config, config)
        self.run = run
        self.summary = read_summary(run)
        self.training_tiles = run_training_tiles(self.summary, run)
        self.source = {"run": str(run)}
        spec = self.summary.get("chip_spec")
        self.spec = ChipSpec.from_dict(spec) if spec else None
        self.class_names = tuple(CLASS_NAMES[: self.cfg.model.num_classes])
        self.input_size = int(self.cfg.data.input_size)
        self.false_alarm_cost = float(self.cfg.grade.false_alarm_cost)
        self.device_name = self.cfg.train.device if device == "auto" else device
        self._weights = weights
        self._model = None

    @property
    def model(self):
        """The rebuilt model (built on first use)."""
        if self._model is None:
            self.device = resolve_device(self.device_name)
            model = build_model(model_config_for(self.cfg))
            ckpt.load_weights(model, self._weights)
            self._model = model.to(self.device).eval()
        return self._model

    def _forward(self, dataset, batch_size: int, progress: bool, desc: str, full: bool):
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
        check_views(views)
        chips = Path(chips)
        plain = ChipPairDataset(chips, chip_ids, self.input_size)
        first = self._forward(plain, batch_size, progress, "evaluate", full=True)
        z_view2 = None
        if views == 2:  # the same chips in the same (manifest) order, augmented
            second = augmented_view(chips, chip_ids, self.input_size, seed)
            z_view2 = self._forward(second, batch_size, progress, "second view", full=False)["z"]
        return Scored(
            chip_ids=list(plain.chip_ids),
            labels=first["labels"].astype("int64"),
            logits=first["logits"],
            probabilities=softmax(first["logits"].astype("float64"), axis=1).astype("float32"),
            z=first["z"],
            e_post=first["e_post"],
            z_view2=z_view2,
        )


def read_summary(run: Path) -> dict[str, Any]:
    """A run's ``summary.json`` ({} when it has none).

    Raises:
        EvaluationError: the file is not valid JSON.
    """
    path = run / "summary.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise EvaluationError(f"{path}: not valid JSON ({exc})") from exc
