"""The models the web app offers: the model files of its picker (:func:`model_choices`) and their
loaded predictors (:class:`ModelCache`)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from app.web.adapt_panel import MODELS_FOLDER
from app.web.sessions import AppError
from runtime.contract import ModelError
from runtime.predictor import Predictor
from runtime.registry import list_models


def model_choices(
    models_dir: str | os.PathLike = "models",
    extra: str | None = None,
    work_dir: str | os.PathLike | None = None,
) -> list[str]:
    """Model files the picker offers: ``extra`` (``--model``) first, then ``models_dir/*.onnx``,
    then the models adapted in the app (``work_dir/models/*.onnx``, when ``work_dir`` is given)."""
    paths = [str(Path(extra).resolve())] if extra else []
    folders = [Path(models_dir)] + ([Path(work_dir) / MODELS_FOLDER] if work_dir else [])
    for p in (p for folder in folders for p in list_models(folder)):
        if str(p.resolve()) not in paths:
            paths.append(str(p.resolve()))
    return paths


class ModelCache:
    """Loaded predictors by path, restricted to the offered model files (thread safe)."""

    def __init__(self, allowed: list[str]) -> None:
        self.allowed = list(allowed)
        self._loaded: dict[str, Predictor] = {}
        self._lock = threading.Lock()

    def add(self, path: str | os.PathLike) -> str:
        """Offer one more model file (e.g. a model adapted in the app); returns its path."""
        path = str(Path(path).resolve())
        with self._lock:
            if path not in self.allowed:
                self.allowed.append(path)
        return path

    def get(self, path: str | None) -> Predictor:
        """The predictor of an offered model file.

        Raises:
            AppError: no model chosen, a path that is not offered, or not a valid model.
        """
        if not path:
            raise AppError("no model chosen; put .onnx files in models/ or start with --model")
        if path not in self.allowed:
            raise AppError(f"model {Path(path).name} is not one of the models this app offers")
        with self._lock:
            if path not in self._loaded:
                try:
                    predictor = Predictor(path)
                except ModelError as exc:
                    raise AppError(f"model {Path(path).name}: {exc}") from exc
                # one warm-up run, so that the first analyst does not wait for it
                chip = np.zeros((1, predictor.input_size, predictor.input_size, 3), np.uint8)
                predictor.predict(chip, chip)
                self._loaded[path] = predictor
            return self._loaded[path]
