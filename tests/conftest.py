"""Shared fixtures: seeded synthetic data made on the fly, and the real data in ../shared/data."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def app_process(work: Path, *options):
    """`local-damage app --work WORK OPTIONS...` in its own process on a free local port, its
    output in ``WORK/app.log``: yields ``(process, url)`` once it answers (fails the test when it
    exits or does not answer within 180 s) and stops it after (SIGINT, then SIGKILL)."""
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "GRADIO_ANALYTICS_ENABLED": "False"}
    cmd = [sys.executable, "-m", "cli.main", "app", "--port", str(port), "--work", str(work)]
    log = open(work / "app.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([*cmd, *map(str, options)], cwd=work, env=env, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"local-damage app exited: {(work / 'app.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(url, timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"local-damage app did not answer on {url} within 180 s")
                time.sleep(0.5)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


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
    from local_damage.train.loaders import ChipSplit
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
    split = ChipSplit(fold=0)
    train(load_yaml(Config, None, overrides), root / "chips", root / "run", split, progress=False)
    export_run(root / "run", root / "model.onnx")
    return root / "model.onnx"


@pytest.fixture(scope="module")
def predictor(score_model):
    """The tiny exported model (``score_model``) loaded by ONNX Runtime."""
    from runtime.predictor import Predictor

    return Predictor(score_model)


@pytest.fixture(scope="module")
def chips(score_model) -> Path:
    """The synthetic chip store behind the tiny model (3 folds; fold 0 validated it)."""
    return score_model.parent / "chips"


@pytest.fixture(scope="module")
def store(base, chips):
    """The labelled buildings of ``chips`` with the class names of ``base``: the model a test
    module adapts, which each module that uses this fixture defines as its own ``base`` fixture."""
    from app.adapt.labelled import from_chip_store
    from runtime.predictor import Predictor

    return from_chip_store(chips, Predictor(base).class_names)


@pytest.fixture(scope="module")
def rect_scene(tmp_path_factory) -> dict:
    """The bright rectangles on dark ground of tests/app/rects.py (``make_rect_scene``)."""
    from tests.app.rects import make_rect_scene

    return make_rect_scene(tmp_path_factory.mktemp("rects"))
