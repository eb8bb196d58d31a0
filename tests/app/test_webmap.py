"""The web map (`score --map`, `score-batch --map`): one self-contained HTML file per scene.

Scored with the session's tiny exported model (``score_model`` in conftest.py) on the synthetic
scene and xBD tiles; the imagery tiles are decoded and checked against where the imagery lies.
The map in a browser: tests/app/test_webmap_browser.py.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_cli


@pytest.fixture(scope="module")
def scene_map(tmp_path_factory, synthetic_scene, score_model):
    """The synthetic scene scored once with --map (and once without, to compare)."""
    out = tmp_path_factory.mktemp("map")
    s = synthetic_scene
    common = ["--pre", *s.pre, "--post", *s.post, "--buildings", s.buildings]
    common += ["--model", score_model, "--block-size", "200", "--quiet"]
    rc = run_cli("score", *common, "--out", out / "with.geojson", "--map", out / "scene.html")
    assert rc == 0
    assert run_cli("score", *common, "--out", out / "without.geojson") == 0
    return out


def _decode(uri: str) -> np.ndarray:
    """A tile's data URI as a BGRA array (an opaque tile is stored without alpha)."""
    import cv2

    head, data = uri.split(",", 1)
    assert head == "data:image/webp;base64"
    image = cv2.imdecode(np.frombuffer(base64.b64decode(data), np.uint8), cv2.IMREAD_UNCHANGED)
    if image.shape[2] == 3:
        image = np.dstack([image, np.full(image.shape[:2], 255, np.uint8)])
    return image


@pytest.mark.slow
def test_map_is_self_contained(scene_map):
    text = (scene_map / "scene.html").read_text()
    # nothing is loaded from elsewhere: no script or style sheet by address, Leaflet inlined
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", text)
    assert "Leaflet 1.9.3" in text and "sourceMappingURL" not in text
    assert "url(images/" not in text and "url(data:image/png;base64," in text
    # the only address in the data is the basemap's, which is off when the file opens
    from app.scoring.webmap import BASEMAP, read_map_data

    data = read_map_data(scene_map / "scene.html")
    payload = json.dumps(data)
    assert re.findall(r"https?://[^\"' ]+", payload) == [BASEMAP["url"]]


def test_map_holds_every_building_with_its_scores(scene_map, synthetic_scene):
    import geopandas as gpd

    from app.scoring.webmap import read_map_data

    data = read_map_data(scene_map / "scene.html")
    df = gpd.read_file(scene_map / "with.geojson")
    features = data["buildings"]["features"]
    assert data["georeferenced"] is True
    assert len(features) == df.geometry.notna().sum() == synthetic_scene.n_buildings
    scored = df[df["status"] == "scored"]
    assert data["counts"] == df.loc[scored.index, "damage"].value_counts().to_dict() | {
        name: 0 for name in data["classes"] if name not in set(scored["damage"])
    }
    for f in features:
        p, row = f["properties"], df.iloc[f["properties"]["n"]]
        assert p["uid"] == str(row["uid"]) and p["status"] == row["status"]
        assert p["source"] == "given" and p["flags"] == (row["flags"] or "")
        if row["status"] == "scored":
            assert p["damage"] == row["damage"] and p["damage_id"] == row["damage_id"]
            assert p["confidence"] == pytest.approx(row["confidence"], abs=1e-4)
            assert p["p"][p["damage_id"]] == pytest.approx(row["confidence"], abs=1e-4)
        else:
            assert p["damage"] is None and p["damage_id"] == -1
        # the same place as the vector output (longitude/latitude, rounded to 1e-7 degrees)
        drawn = np.asarray(f["geometry"]["coordinates"][0])
        np.testing.assert_allclose(drawn, np.asarray(row.geometry.exterior.coords), atol=2e-7)


def test_map_leaves_the_other_outputs_alone(scene_map):
    with_map = json.loads((scene_map / "with.geojson").read_text())
    without = json.loads((scene_map / "without.geojson").read_text())
    assert with_map == without


def test_map_imagery_lies_under_the_buildings(scene_map, synthetic_scene):
    """Each building's roof colour in the pre imagery is found in the pre tiles where the map
    draws the building: decode the finest tile under its centroid."""
    import rasterio
    import shapely
    from rasterio.warp import transform as warp_points

    from app.scoring.map_tiles import MERCATOR_WIDTH, TILE
    from app.scoring.webmap import read_map_data

    data = read_map_data(scene_map / "scene.html")
    layer = data["layers"]["pre"]
    z = layer["maxZoom"]
    res = MERCATOR_WIDTH / (TILE * 2**z)
    checked = 0
    with rasterio.open(synthetic_scene.pre[0]) as ds:
        image = ds.read()
        for f in data["buildings"]["features"][:12]:
            c = shapely.geometry.shape(f["geometry"]).centroid
            (x,), (y,) = warp_points("EPSG:4326", "EPSG:3857", [c.x], [c.y])
            px, py = (x + MERCATOR_WIDTH / 2) / res, (MERCATOR_WIDTH / 2 - y) / res
            key = f"{z}/{int(px // TILE)}/{int(py // TILE)}"
            (sx,), (sy,) = warp_points("EPSG:4326", ds.crs, [c.x], [c.y])
            r, col = ds.index(sx, sy)
            if key not in layer["tiles"] or not (0 <= r < ds.height and 0 <= col < ds.width):
                continue
            tile = _decode(layer["tiles"][key])
            got = tile[int(py % TILE), int(px % TILE)]
            assert got[3] == 255  # imagery there
            want = image[:3, r, col]
            assert np.abs(got[2::-1].astype(int) - want.astype(int)).max() <= 40, f["properties"]
            checked += 1
    assert checked >= 3


def test_pixel_pyramid_levels_and_content():
    from app.scoring.map_tiles import TILE, pixel_pyramids

    rng = np.random.default_rng(0)
    image = np.zeros((600, 1000, 3), np.uint8)
    image[:300, :500] = (200, 30, 30)
    image[300:, 500:] = rng.integers(0, 255, (300, 500, 3))
    (pyramid,) = pixel_pyramids([image])
    assert (pyramid.min_zoom, pyramid.max_zoom) == (-2, 0)
    levels = {}
    for key in pyramid.tiles:
        z, x, y = map(int, key.split("/"))
        levels.setdefault(z, set()).add((x, y))
    assert levels[0] == {(x, y) for x in range(4) for y in range(3)}
    assert levels[-1] == {(0, 0), (1, 0), (0, 1), (1, 1)} and levels[-2] == {(0, 0)}
    top = _decode(pyramid.tiles["0/0/0"])
    assert top.shape == (TILE, TILE, 4) and (top[..., 3] == 255).all()
    assert np.abs(top[..., 2::-1].astype(int) - (200, 30, 30)).max() <= 8
    edge = _decode(pyramid.tiles["0/3/2"])  # columns 768-1023, rows 512-767: the image ends
    assert (edge[: 600 - 512, : 1000 - 768, 3] == 255).all() and (edge[100:, :, 3] == 0).all()
    assert (edge[:, 240:, 3] == 0).all()


def test_mercator_pyramid_places_the_image(tmp_path):
    """A red square in a UTM image is found in the Web Mercator tile where its centre lies."""
    from affine import Affine
    from rasterio.warp import transform as warp_points

    from app.scoring.map_tiles import MERCATOR_WIDTH, TILE, array_pyramids, mercator_frame

    image = np.full((512, 512, 3), (20, 160, 40), np.uint8)
    image[200:260, 300:360] = (230, 20, 20)
    transform = Affine(0.5, 0, 362000.0, 0, -0.5, 4102000.0)
    frame = mercator_frame("EPSG:32615", transform, 512, 512)
    # 0.5 m at 37 degrees north is about 0.63 m of Web Mercator: zoom 18 (0.60 m) is nearest
    assert frame.zoom == 18
    assert mercator_frame("EPSG:32615", transform, 512, 512, max_side=300).zoom == 17
    (pyramid,) = array_pyramids([image], "EPSG:32615", transform)
    cx, cy = transform @ (330, 230)
    (x,), (y,) = warp_points("EPSG:32615", "EPSG:3857", [cx], [cy])
    res = MERCATOR_WIDTH / (TILE * 2**18)
    px, py = (x + MERCATOR_WIDTH / 2) / res, (MERCATOR_WIDTH / 2 - y) / res
    tile = _decode(pyramid.tiles[f"18/{int(px // TILE)}/{int(py // TILE)}"])
    got = tile[int(py % TILE), int(px % TILE)]
    assert got[3] == 255 and np.abs(got[2::-1].astype(int) - (230, 20, 20)).max() <= 30
    assert min(int(k.split("/")[0]) for k in pyramid.tiles) == pyramid.min_zoom


def test_post_shift_is_applied_in_web_mercator():
    from affine import Affine

    from app.scoring.map_tiles import _shift_vector
    from data_prep.grid import Grid

    grid = Grid("EPSG:32615", Affine(0.5, 0, 362000.0, 0, -0.5, 4102000.0), 1000, 1000)
    dx, dy = _shift_vector(grid, (4.0, 0.0))  # 4 px = 2 m east on the ground
    lat = np.radians(37.05)
    assert dx == pytest.approx(2.0 / np.cos(lat), rel=0.02) and abs(dy) < 0.05


def test_xbd_map_in_image_pixels(tmp_path, synthetic_xbd, score_model):
    from app.scoring.webmap import read_map_data
    from data_prep.synthetic import tile_name

    name = tile_name(0)
    images, labels = synthetic_xbd / "images", synthetic_xbd / "labels"
    rc = run_cli(
        "score", "--pre", images / f"{name}_pre_disaster.png",
        "--post", images / f"{name}_post_disaster.png",
        "--labels", labels / f"{name}_post_disaster.json", "--model", score_model,
        "--out", tmp_path / "t.gpkg", "--map", tmp_path / "t.html", "--quiet",
    )  # fmt: skip
    assert rc == 0
    data = read_map_data(tmp_path / "t.html")
    assert data["georeferenced"] is False and data["basemap"] is None
    label = json.loads((labels / f"{name}_post_disaster.json").read_text())
    xy = label["features"]["xy"]
    import geopandas as gpd
    import shapely

    df = gpd.read_file(tmp_path / "t.gpkg")  # pixel polygons; the one with broken WKT has none
    assert len(data["buildings"]["features"]) == df.geometry.notna().sum() == len(xy) - 1
    first = data["buildings"]["features"][0]
    assert first["properties"]["n"] == 0
    want = np.asarray(shapely.from_wkt(xy[0]["wkt"]).exterior.coords) * (1, -1)  # row down
    np.testing.assert_allclose(first["geometry"]["coordinates"][0], want, atol=0.01)
    assert data["bounds"][1] > 0 and data["bounds"][3] == 0  # (0, height, width, 0)


def test_map_path_is_checked_before_any_work(tmp_path, synthetic_scene, score_model, capsys):
    s = synthetic_scene
    rc = run_cli(
        "score", "--pre", *s.pre, "--post", *s.post, "--buildings", s.buildings,
        "--model", score_model, "--out", tmp_path / "o.geojson", "--map", tmp_path / "m.png",
    )  # fmt: skip
    assert rc == 2
    assert (
        "m.png: the map is written as one HTML file; give a .html path" in capsys.readouterr().err
    )
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_score_batch_map_and_resume(tmp_path, synthetic_scene, score_model):
    s = synthetic_scene
    csv = tmp_path / "scenes.csv"
    csv.write_text(
        "name,pre,post,buildings\n"
        f"one,{';'.join(map(str, s.pre))},{';'.join(map(str, s.post))},{s.buildings}\n"
    )
    argv = ["score-batch", "--scenes", csv, "--out", tmp_path / "out", "--model", score_model]
    assert run_cli(*argv, "--quiet") == 0
    assert not (tmp_path / "out" / "one.html").exists()
    # resumed with --map: the scene's outputs are not all there, so it is scored again
    assert run_cli(*argv, "--map", "--resume", "--quiet") == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    (entry,) = summary["scenes"]
    assert entry["status"] == "scored" and entry["outputs"]["map"].endswith("one.html")
    from app.scoring.webmap import read_map_data

    data = read_map_data(Path(entry["outputs"]["map"]))
    assert len(data["buildings"]["features"]) == s.n_buildings
    assert run_cli(*argv, "--map", "--resume", "--quiet") == 0
    (entry,) = json.loads((tmp_path / "out" / "summary.json").read_text())["scenes"]
    assert entry["status"] == "done"
