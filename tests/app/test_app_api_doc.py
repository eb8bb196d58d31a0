"""docs/app.md's HTTP API example, run as written against `local-damage app` with the bundled
models (only the server's port and the image file names are changed)."""

from __future__ import annotations

import contextlib
import io
import re
import socket

import numpy as np
import pytest

from tests.conftest import REPO, app_process

DOC = REPO / "docs" / "app.md"
DOC_URL = "http://127.0.0.1:7860/"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api_example() -> str:
    """The Python block of the "HTTP API" section of docs/app.md."""
    section = DOC.read_text().split("## HTTP API", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"{DOC}: no Python example in the HTTP API section"
    return match.group(1)


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    """`local-damage app` with no model options (the bundled models), on a free port."""
    if not (REPO / "models" / "default.onnx").is_file():
        pytest.fail("models/default.onnx is missing: the bundled model ships with the project")
    with app_process(tmp_path_factory.mktemp("app_work")) as (_, url):
        yield url


@pytest.mark.slow
def test_the_api_example_runs_against_the_app(app_url, tmp_path, monkeypatch):
    import cv2

    from data_prep.synthetic import make_xbd, tile_name

    root = tmp_path / "xbd"
    make_xbd(root, seed=0, n_tiles=1)
    name = tile_name(0)
    files = {
        "tile_pre_disaster.png": root / "images" / f"{name}_pre_disaster.png",
        "tile_post_disaster.png": root / "images" / f"{name}_post_disaster.png",
        "tile_post_disaster.json": root / "labels" / f"{name}_post_disaster.json",
    }
    for when in ("pre", "post"):
        image = cv2.imread(str(files[f"tile_{when}_disaster.png"]))
        chip = tmp_path / f"chip_{when}.png"
        assert cv2.imwrite(str(chip), np.ascontiguousarray(image[:96, :96]))
        files[f"chip_{when}.png"] = chip

    code = api_example()
    assert DOC_URL in code and "models/default.onnx" in code
    code = code.replace(DOC_URL, app_url)
    for doc_name, path in files.items():
        assert f'"{doc_name}"' in code, doc_name
        code = code.replace(f'"{doc_name}"', repr(str(path)))
    monkeypatch.chdir(REPO)  # the example runs from the project folder
    printed = io.StringIO()
    scope: dict = {}
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(DOC), "exec"), scope)

    table = scope["table"]
    assert table["headers"][-5:] == ["flags", "status", "source", "corrected", "by"]
    assert {row[-3] for row in table["data"]} == {"given"}
    assert "Saved: building #0 is **destroyed** (by anonymous)" in printed.getvalue()
    assert "buildings**" in scope["summary"]
    assert scope["probabilities"]["label"] in {
        c["label"] for c in scope["probabilities"]["confidences"]
    }
    assert "source" in printed.getvalue()
