"""Shared fixtures: seeded synthetic data made on the fly, and the real data in ../shared/data."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

#: Overrides for a tiny, fast training run (tests only).
TINY_TRAIN = [
    "model.encoder=resnet18",
    "model.proj_hidden=32",
    "model.cls_hidden=32",
    "model.embed_dim=16",
    "model.latent_size=4",
    "data.input_size=32",
    "train.batch_size=4",
    "train.epochs=1",
]


def in_ci() -> bool:
    """Whether the tests run in CI: ``CI`` set (``.ci/run`` sets ``CI=true``, as CI services do)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(reason: str) -> NoReturn:
    """Something a test needs is absent: the test fails in CI, where everything it needs must be
    present, and skips with ``reason`` elsewhere."""
    if in_ci():
        pytest.fail(f"{reason}; CI is set, so this test must run", pytrace=False)
    pytest.skip(reason)


def shared_data(name: str) -> Path:
    """Path of a real data set in ../shared/data; when it is absent the test skips, or fails in
    CI (:func:`missing`)."""
    path = SHARED_DATA / name
    if not path.exists():
        missing(f"real data {path} not present (it lives beside the repository in ../shared/data)")
    return path


def run_cli(*argv) -> int:
    """``local-damage ARGV...`` run in this process (arguments turned to strings); its exit code."""
    from cli.main import main

    return main([str(a) for a in argv])


@pytest.fixture(scope="session")
def synthetic_xbd(tmp_path_factory) -> Path:
    """A small seeded xBD-format dataset (see data_prep.synthetic.make_xbd); returns its root."""
    from data_prep.synthetic import make_xbd

    root = tmp_path_factory.mktemp("xbd")
    make_xbd(root, seed=0)
    return root


@pytest.fixture(scope="session")
def synthetic_scene(tmp_path_factory):
    """A small seeded georeferenced scene (see data_prep.synthetic_scene.make_scene)."""
    from data_prep.synthetic_scene import make_scene

    return make_scene(tmp_path_factory.mktemp("scene"), seed=0)


@pytest.fixture(scope="session")
def score_model(tmp_path_factory) -> Path:
    """A tiny exported ONNX model (resnet18, 32 px, one epoch on synthetic xBD) for scoring tests.

    Made by the real pipeline: make_xbd -> prepare_xbd -> make_splits -> train -> export_run.
    """
    from data_prep.spec import ChipSpec
    from data_prep.split import make_splits
    from data_prep.synthetic import make_xbd
    from data_prep.xbd import prepare_xbd
    from local_damage.config import load_yaml
    from local_damage.export.model import export_run
    from local_damage.train.config import Config
    from local_damage.train.loop import train

    root = tmp_path_factory.mktemp("score_model")
    make_xbd(root / "xbd", seed=0)
    prepare_xbd([root / "xbd"], root / "chips", spec=ChipSpec(chip_size=64, min_size=32))
    make_splits(root / "chips", folds=3)
    overrides = [
        "model.encoder=resnet18",
        "train.epochs=1",
        "train.batch_size=8",
        "data.input_size=32",
        "model.proj_hidden=32",
        "model.cls_hidden=32",
        "model.embed_dim=16",
    ]
    train(load_yaml(Config, None, overrides), root / "chips", root / "run", fold=0, progress=False)
    export_run(root / "run", root / "model.onnx")
    return root / "model.onnx"
