"""The bundled models and how a command finds a model when none is named (no torch).

The project ships ``models/default.onnx`` (the damage model) and ``models/localizer.onnx`` (the
building localiser). A command without ``--model`` uses ``./models`` when it holds models, else
the bundled folder beside the packages. A command given a name instead of a file (``--model
default``, ``--localizer localizer``) gets the model of that name from the same folders
(:func:`resolve_model`), from any working folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from runtime.contract import LOCALIZE_TASK, ModelError, model_task

#: File name of the bundled model that every command uses when no --model is given.
DEFAULT_MODEL_NAME = "default.onnx"
#: File name of the bundled localiser, beside the bundled damage model.
LOCALIZER_NAME = "localizer.onnx"
#: The project's models/ folder (next to the packages in a source checkout).
BUNDLED_MODELS = Path(__file__).resolve().parent.parent / "models"


def list_models(folder: str | os.PathLike = "models") -> list[Path]:
    """The damage models (``.onnx`` files) in ``folder`` (not recursive), sorted by name; empty
    when absent. Hidden files (a model being written atomically is a hidden temporary) and
    building localisers (metadata task ``localize``) are left out."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(
        p
        for p in folder.iterdir()
        if p.suffix == ".onnx"
        and not p.name.startswith(".")
        and p.is_file()
        and model_task(p) != LOCALIZE_TASK
    )


def default_models_dir() -> Path:
    """``./models`` when it holds .onnx files, else the project's bundled ``models/`` folder."""
    here = Path("models")
    return here if list_models(here) else BUNDLED_MODELS


def default_model(folder: str | os.PathLike | None = None) -> Path:
    """The model used when none is named: ``default.onnx``, else the first .onnx of ``folder``.

    Raises:
        ModelError: when the folder holds no .onnx file.
    """
    folder = Path(folder) if folder is not None else default_models_dir()
    models = list_models(folder)
    if not models:
        raise ModelError(
            f"{folder}: no .onnx model here; give --model, or export one with `local-damage export`"
        )
    named = [p for p in models if p.name == DEFAULT_MODEL_NAME]
    return named[0] if named else models[0]


def default_localizer(folder: str | os.PathLike | None = None) -> Path | None:
    """The localiser used when none is named: ``localizer.onnx`` of ``folder`` (default: ./models,
    then the project's bundled models/); None when there is none."""
    folders = [Path(folder)] if folder is not None else [Path("models"), BUNDLED_MODELS]
    for f in folders:
        path = f / LOCALIZER_NAME
        if path.is_file():
            return path
    return None


def model_folders() -> list[Path]:
    """Where a model name is looked up: ``./models``, then the project's bundled ``models/``."""
    folders: list[Path] = []
    for folder in (Path("models"), BUNDLED_MODELS):
        if folder.is_dir() and all(folder.resolve() != f.resolve() for f in folders):
            folders.append(folder)
    return folders


def model_names() -> list[str]:
    """The names a command accepts for a model (the ``.onnx`` files of :func:`model_folders`,
    damage models and localisers, without the suffix), sorted."""
    return sorted(
        {
            p.stem
            for folder in model_folders()
            for p in folder.glob("*.onnx")
            if p.is_file() and not p.name.startswith(".")
        }
    )


def resolve_model(value: str | os.PathLike, kind: str = "model") -> Path:
    """The model file a command was given: ``value`` itself when it exists, else the model of
    that name (``default``, ``localizer``, with or without ``.onnx``, or as ``models/<name>.onnx``
    as the docs write it) in ``./models`` or the project's bundled ``models/``, from any working
    folder.

    Args:
        value: a path, or the name of a bundled model.
        kind: what the model is, for the message (``model``, ``localiser model``).

    Raises:
        ModelError: neither a file nor a model name; the message lists the names there are.
    """
    path = Path(value)
    if path.exists():
        return path
    if path.parent in (Path("."), Path("models")) and path.name:
        stem = path.name[: -len(".onnx")] if path.name.endswith(".onnx") else path.name
        for folder in model_folders():
            candidate = folder / f"{stem}.onnx"
            if stem and candidate.is_file():
                return candidate
    names = model_names()
    listed = ", ".join(names) if names else "none: the models/ folder holds no .onnx file"
    raise ModelError(
        f"{value}: {kind} file not found, and not the name of a bundled model (names: {listed}); "
        "give the path of an .onnx file or one of those names"
    )
