"""The web app's views of an assessed tile (app.web.tile_views): the pre/post slider's images,
the map in its frame, the chosen building's chips and row, as plain functions without Gradio.
The page itself: tests/app/test_app_map_browser.py."""

from __future__ import annotations

import html
import re
from pathlib import Path

import numpy as np
import pytest


def _map_data(frame: str) -> dict:
    """The map data block of the document inside an ``<iframe srcdoc>``."""
    import json

    document = html.unescape(re.search(r'srcdoc="([^"]*)"', frame).group(1))
    block = re.search(
        r'<script id="ld-data" type="application/json">(.*?)</script>', document, re.S
    )
    return json.loads(block.group(1))


def test_georeferenced_tile_views(predictor, synthetic_scene, tmp_path):
    import cv2

    from app.web.app import assess_tile
    from app.web.callbacks import AppContext, on_building, on_views
    from app.web.model_picker import ModelCache
    from app.web.tile_views import CHIP_VIEW_SIZE

    s = synthetic_scene
    r = assess_tile(predictor, s.pre[0], s.post[0], s.buildings, tmp_path / "s")
    assert r.web_map is not None and r.web_map.is_file()
    (pre, post), frame = on_views(str(r.session))
    a, b = cv2.imread(pre), cv2.imread(post)
    assert a.shape == b.shape and a.std() > 0 and b.std() > 0  # post on the pre grid
    assert not np.array_equal(a, b)  # the two acquisitions, not one twice
    assert frame.startswith("<iframe") and "<script" not in frame  # the document is escaped
    data = _map_data(frame)
    assert data["georeferenced"] is True and data["basemap"] is not None
    assert len(data["buildings"]["features"]) == r.buildings
    graded = [f["properties"] for f in data["buildings"]["features"] if f["properties"]["damage"]]
    assert len(graded) == sum(r.counts.values()) > 0
    # the building chosen: its chips side by side at the page's size, and its row of the table
    row = graded[0]["n"]
    ctx = AppContext(ModelCache([str(predictor.path)]), tmp_path / "work")
    chip_pre, chip_post, details = on_building(ctx, str(r.session), str(predictor.path), row)
    assert chip_pre.shape == chip_post.shape == (CHIP_VIEW_SIZE, CHIP_VIEW_SIZE, 3)
    want = r.rows[row]
    assert f"**Building #{row}**" in details and f"`{want['uid']}`" in details
    assert f"**{want['damage']}**" in details and f"confidence: {want['confidence']:.3f}" in details
    assert graded[0]["uid"] == want["uid"] and graded[0]["damage"] == want["damage"]


def test_pixel_tile_views(predictor, synthetic_xbd, tmp_path):
    import cv2

    from app.web.app import AppError, assess_tile
    from app.web.callbacks import on_views
    from app.web.tile_views import building_details
    from data_prep.synthetic import tile_name

    name = tile_name(0)
    images = synthetic_xbd / "images"
    pre, post = images / f"{name}_pre_disaster.png", images / f"{name}_post_disaster.png"
    label = synthetic_xbd / "labels" / f"{name}_post_disaster.json"
    r = assess_tile(predictor, pre, post, label, tmp_path / "s")
    (a, b), frame = on_views(str(r.session))
    assert cv2.imread(a).shape == cv2.imread(str(pre)).shape  # the tile itself, both sides
    assert np.abs(cv2.imread(b).astype(int) - cv2.imread(str(post)).astype(int)).mean() < 3
    data = _map_data(frame)
    assert data["georeferenced"] is False
    assert {f["properties"]["n"] for f in data["buildings"]["features"]} <= set(range(r.buildings))
    assert Path(a).parent == r.session  # written once, with the assessment
    with pytest.raises(AppError, match="does not exist"):
        building_details(r.session, r.buildings)


def test_views_without_an_assessment():
    from app.web.callbacks import on_building, on_views

    assert on_views(None) == (None, "")
    assert on_building(None, None, None, 3) == (None, None, "")
