"""Shared fixtures: seeded synthetic data made on the fly, and the real data in ../shared/data."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def shared_data(name: str) -> Path:
    """Path of a real data set in ../shared/data, skipping the test when it is absent."""
    path = SHARED_DATA / name
    if not path.exists():
        pytest.skip(
            f"real data {path} not present (it lives beside the repository in ../shared/data)"
        )
    return path


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
