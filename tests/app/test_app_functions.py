"""The functions behind the web app, called directly on synthetic data (no browser)."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from data_prep.spec import CLASS_NAMES


@pytest.fixture(scope="module")
def map_model(score_model, tmp_path_factory) -> Path:
    """The shared tiny run exported again with the latent change map as a third output."""
    from local_damage.export.model import export_run
    from local_damage.export.options import ExportOptions

    out = tmp_path_factory.mktemp("map_model") / "tiny_map.onnx"
    export_run(score_model.parent / "run", out, ExportOptions(parity_limit=16, change_map=True))
    return out


@pytest.fixture(scope="module")
def xbd_tile(synthetic_xbd):
    """(pre, post, label) of synthetic tile 0 (PNG) and its number of xy building features."""
    from data_prep.synthetic import tile_name

    name = tile_name(0)
    pre = synthetic_xbd / "images" / f"{name}_pre_disaster.png"
    post = synthetic_xbd / "images" / f"{name}_post_disaster.png"
    label = synthetic_xbd / "labels" / f"{name}_post_disaster.json"
    features = json.loads(label.read_text())["features"]["xy"]
    n = sum(1 for f in features if f["properties"].get("feature_type", "building") == "building")
    return pre, post, label, n


@pytest.fixture(scope="module")
def tile_result(predictor, xbd_tile, tmp_path_factory):
    from app.web.app import assess_tile

    pre, post, label, _ = xbd_tile
    return assess_tile(predictor, pre, post, label, tmp_path_factory.mktemp("session"))


def test_assess_tile_xbd_outputs_agree(tile_result, xbd_tile):
    import cv2
    from pyogrio.raw import read

    pre, _, _, n = xbd_tile
    r = tile_result
    assert r.mode == "xbd" and r.buildings == n
    meta, _, wkb, values = read(str(r.vector))
    assert len(wkb) == n
    status = np.asarray(values[list(meta["fields"]).index("status")])
    scored = int(np.sum(status == "scored"))
    assert 0 < scored <= n and sum(r.counts.values()) == scored
    damage = [row["damage"] for row in r.rows if row["status"] == "scored"]
    assert {k: damage.count(k) for k in r.counts} == r.counts
    for row in r.rows:
        if row["status"] == "scored":
            probs = [row["p_" + c.replace("-", "_")] for c in CLASS_NAMES]
            assert abs(sum(probs) - 1) < 1e-3 and row["confidence"] == pytest.approx(max(probs))
    with open(r.csv, newline="") as fh:
        lines = fh.read().strip().splitlines()
    assert len(lines) == n + 1
    # the table (and its CSV) say where each building came from, as the scoring output does
    assert {row["source"] for row in r.rows} == {"given"}
    assert lines[0].split(",")[-1] == "source"
    overlay = cv2.imread(str(r.overlay))
    width = cv2.imread(str(pre)).shape[1]
    assert overlay.shape[1] == width and overlay.shape[0] > width  # legend band below
    assert f"**{n} buildings**" in r.summary()


def test_assess_tile_pixel_only_labels_give_a_geopackage(predictor, xbd_tile, tmp_path):
    """A label file without lng_lat polygons cannot become RFC 7946 GeoJSON: a GeoPackage in
    pixel coordinates is written instead, in one scoring pass."""
    from pyogrio.raw import read

    from app.web.app import assess_tile

    pre, post, label, n = xbd_tile
    data = json.loads(label.read_text())
    data["features"]["lng_lat"] = []
    pixel_only = tmp_path / label.name
    pixel_only.write_text(json.dumps(data))
    r = assess_tile(predictor, pre, post, pixel_only, tmp_path / "out")
    assert r.vector.suffix == ".gpkg" and r.buildings == n
    assert len(read(str(r.vector))[2]) == n
    assert not list((tmp_path / "out").glob("*.geojson"))


def test_assess_tile_georeferenced_scene(predictor, synthetic_scene, tmp_path):
    from app.web.app import assess_tile

    s = synthetic_scene
    r = assess_tile(predictor, s.pre[0], s.post[0], s.buildings, tmp_path / "s")
    assert r.mode == "vector" and r.buildings == s.n_buildings
    scored = sum(r.counts.values())
    assert 0 < scored < s.covered  # only the west pre tile was given
    assert r.vector.suffix == ".geojson" and r.overlay.is_file()


def test_building_chips_xbd_and_scene(predictor, tile_result, synthetic_scene, tmp_path):
    from app.web.app import AppError, assess_tile, building_chips

    size = predictor.spec.chip_size
    destroyed = next(i for i, row in enumerate(tile_result.rows) if row["status"] == "scored")
    pre, post = building_chips(predictor, tile_result.session, destroyed)
    assert pre.shape == post.shape == (size, size, 3) and pre.dtype == np.uint8
    assert pre.std() > 0 and post.std() > 0
    with pytest.raises(AppError, match="does not exist"):
        building_chips(predictor, tile_result.session, len(tile_result.rows))

    s = synthetic_scene
    r = assess_tile(predictor, s.pre[0], s.post[0], s.buildings, tmp_path / "s")
    row = next(i for i, x in enumerate(r.rows) if x["status"] == "scored")
    pre, post = building_chips(predictor, r.session, row)
    assert pre.shape == (size, size, 3) and pre.std() > 0


def test_corrections_xbd_feed_prepare(predictor, xbd_tile, tmp_path):
    from app.web.app import AppError, assess_tile, save_correction
    from data_prep.report import PrepareReport
    from data_prep.xbd import prepare_xbd
    from data_prep.xbd_tiles import parse_buildings

    pre, post, label, _ = xbd_tile
    r = assess_tile(predictor, pre, post, label, tmp_path / "s")
    rows = [i for i, x in enumerate(r.rows) if x["status"] == "scored"][:2]
    save_correction(r.session, rows[0], "minor-damage")
    save_correction(r.session, rows[1], "major-damage")
    path = save_correction(r.session, rows[0], "destroyed")  # replaces the first correction
    with pytest.raises(AppError, match="unknown class"):
        save_correction(r.session, rows[0], "flattened")
    _, buildings = parse_buildings(path, PrepareReport())
    got = {b.uid: CLASS_NAMES[b.label] for b in buildings}
    assert got == {r.rows[rows[0]]["uid"]: "destroyed", r.rows[rows[1]]["uid"]: "major-damage"}
    prepare_xbd([r.session / "corrections"], tmp_path / "chips", progress=False)
    with open(tmp_path / "chips" / "manifest.csv") as fh:
        manifest = fh.read()
    assert "destroyed" in manifest and "major-damage" in manifest
    assert len(manifest.strip().splitlines()) == 3


def test_corrections_georeferenced_read_by_load_footprints(predictor, synthetic_scene, tmp_path):
    from app.web.app import assess_tile, save_correction
    from data_prep.footprints import load_footprints

    s = synthetic_scene
    r = assess_tile(predictor, s.pre[0], s.post[0], s.buildings, tmp_path / "s")
    path = save_correction(r.session, 2, "destroyed")
    fp = load_footprints(path, "EPSG:32615", label_field="damage")
    assert list(fp.uids) == [r.rows[2]["uid"]] and list(fp.labels) == [3]


def _png_header(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims ``width`` x ``height`` but that holds almost no data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
    data += chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")
    path.write_bytes(data)
    return path


def test_bad_inputs_give_clear_errors(predictor, xbd_tile, tmp_path):
    import cv2

    from app.web.app import AppError, assess_tile

    pre, post, label, _ = xbd_tile
    out = tmp_path / "s"
    text = tmp_path / "notes.png"
    text.write_text("not an image at all")
    with pytest.raises(AppError, match=r"pre tile notes\.png: not a readable image"):
        assess_tile(predictor, text, post, label, out)

    bomb = _png_header(tmp_path / "bomb.png", 100_000, 100_000)
    with pytest.raises(AppError, match=r"bomb\.png: 100000x100000 px is more than"):
        assess_tile(predictor, pre, bomb, label, out)

    tif = tmp_path / "corrupt.tif"
    tif.write_bytes(b"II*\x00" + b"\x13" * 200)
    with pytest.raises(AppError, match=r"corrupt\.tif"):
        assess_tile(predictor, tif, post, label, out)

    small = tmp_path / "small_post.png"
    cv2.imwrite(str(small), cv2.imread(str(post))[:128, :128])
    with pytest.raises(AppError, match=r"small_post\.png.*pixel-aligned"):
        assess_tile(predictor, pre, small, label, out)

    data = json.loads(label.read_text())
    for f in data["features"]["xy"]:
        f["wkt"] = "POLYGON ((5000 5000, 5010 5000, 5010 5010, 5000 5010, 5000 5000))"
    data["features"]["lng_lat"] = []
    far = tmp_path / "far_post_disaster.json"
    far.write_text(json.dumps(data))
    with pytest.raises(AppError, match=r"far_post_disaster\.json: none of the"):
        assess_tile(predictor, pre, post, far, out)

    table = tmp_path / "buildings.csv"
    table.write_text("uid,x,y\n1,2,3\n")
    with pytest.raises(AppError, match=r"footprints buildings\.csv: unsupported"):
        assess_tile(predictor, pre, post, table, out)


def test_vector_footprints_need_georeferenced_tiles(predictor, xbd_tile, synthetic_scene, tmp_path):
    from app.web.app import AppError, assess_tile

    pre, post, _, _ = xbd_tile
    with pytest.raises(AppError, match="not georeferenced"):
        assess_tile(predictor, pre, post, synthetic_scene.buildings, tmp_path / "s")


def test_model_cache_refuses_bad_and_unoffered_models(score_model, tmp_path):
    from app.web.app import AppError, ModelCache

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"definitely not protobuf")
    cache = ModelCache([str(bad), str(score_model)])
    with pytest.raises(AppError, match=r"model bad\.onnx: .*not a loadable ONNX model"):
        cache.get(str(bad))
    with pytest.raises(AppError, match="not one of the models"):
        cache.get(str(tmp_path / "other.onnx"))
    assert cache.get(str(score_model)) is cache.get(str(score_model))


@pytest.mark.slow
def test_change_map_output_matches_pytorch(map_model, score_model):
    import torch

    from local_damage.export.graph import uint8_model
    from local_damage.export.run import load_run
    from runtime.predictor import Predictor

    p = Predictor(map_model)
    assert p.has_change_map and p.metadata["outputs"] == ["logits", "embedding", "change_map"]
    assert not Predictor(score_model).has_change_map
    rng = np.random.default_rng(0)
    pre = rng.integers(0, 256, (3, 40, 40, 3), dtype=np.uint8)
    post = rng.integers(0, 256, (3, 40, 40, 3), dtype=np.uint8)
    got = p.predict(pre, post, change_map=True)
    plain = p.predict(pre, post)
    assert plain.change_map is None
    np.testing.assert_allclose(plain.logits, got.logits, atol=1e-6)
    model = load_run(score_model.parent / "run").model
    wrapper = uint8_model(model, change_map=True)
    from runtime.predictor import resize_chips

    size = p.input_size
    with torch.inference_mode():
        _, _, ref = wrapper(
            torch.from_numpy(resize_chips(pre, size)), torch.from_numpy(resize_chips(post, size))
        )
    side = model.cfg.latent_size
    assert got.change_map.shape == (3, 1, side, side)
    np.testing.assert_allclose(got.change_map, ref.numpy(), atol=1e-4)


def test_assess_chip_heatmap(map_model, score_model, xbd_tile, tmp_path):
    import cv2

    from app.web.app import DISPLAY_SIZE, AppError, assess_chip, make_examples
    from runtime.predictor import Predictor

    ex = make_examples(tmp_path / "ex")
    assert len(ex["chip"]) == 2 and len(ex["tile"]) == 1
    pre, post = ex["chip"][1]  # a destroyed building
    r = assess_chip(Predictor(map_model), pre, post)
    assert set(r.probabilities) == set(CLASS_NAMES)
    assert sum(r.probabilities.values()) == pytest.approx(1.0, abs=1e-5)
    assert r.damage == max(r.probabilities, key=r.probabilities.get)
    assert r.heatmap.shape == (DISPLAY_SIZE, DISPLAY_SIZE, 3) and r.change_map is not None
    chip = cv2.resize(cv2.cvtColor(cv2.imread(post), cv2.COLOR_BGR2RGB), (DISPLAY_SIZE,) * 2)
    assert np.abs(r.heatmap.astype(int) - chip).mean() > 5  # the heatmap is drawn over it

    plain = assess_chip(Predictor(score_model), pre, post)
    assert plain.change_map is None
    np.testing.assert_array_equal(plain.heatmap, chip)

    wide = tmp_path / "wide.png"
    cv2.imwrite(str(wide), np.zeros((32, 48, 3), np.uint8))
    with pytest.raises(AppError, match=r"wide\.png.*square"):
        assess_chip(Predictor(score_model), wide, wide)
    with pytest.raises(AppError, match="same window"):
        assess_chip(Predictor(score_model), pre, wide)


def test_card_and_cli_parser(score_model, tmp_path, capsys):
    from app.web.app import card_markdown, model_choices
    from cli.main import build_parser, main
    from runtime.predictor import Predictor

    text = card_markdown(Predictor(score_model))
    for name in CLASS_NAMES:
        assert name in text
    assert "training data:" in text and "licence:" in text and "validation:" in text
    assert model_choices(tmp_path / "none", str(score_model)) == [str(score_model.resolve())]

    args = build_parser().parse_args(["app", "--model", str(score_model)])
    assert (args.host, args.port, args.models) == ("127.0.0.1", 7860, None)
    assert main(["app", "--models", str(tmp_path / "empty")]) == 2
    assert "no .onnx model here" in capsys.readouterr().err
    bad = tmp_path / "bad.onnx"
    bad.write_text("nope")
    assert main(["app", "--model", str(bad)]) == 2


@pytest.mark.slow
def test_building_table_has_the_source_column(score_model, tmp_path):
    """The table the app shows has the columns the rows carry, ``source`` among them."""
    from app.web.app import build_app

    blocks, _ = build_app(score_model.parent, str(score_model), work_dir=tmp_path / "work")
    tables = [b for b in blocks.blocks.values() if getattr(b, "elem_id", None) == "buildings"]
    assert len(tables) == 1
    headers = list(tables[0].value["headers"])
    assert headers[-3:] == ["flags", "status", "source"]


def test_card_marks_test_figures_on_training_tiles(score_model, tmp_path):
    """Test figures on tiles the model trained on are not called held-out; on other tiles they
    are; a recipe's out-of-fold figures (the bundled model's) are called cross-validated."""
    import onnx
    import pandas as pd

    from app.web.app import card_markdown
    from runtime.contract import read_metadata, save_onnx, set_metadata
    from runtime.predictor import Predictor
    from tests.conftest import REPO

    predictor = Predictor(REPO / "models" / "default.onnx")
    bundled, md = card_markdown(predictor), predictor.metadata
    accuracy = f"accuracy {md['test_metrics']['accuracy']:.4f}"
    line = next(x for x in bundled.splitlines() if accuracy in x)
    # trained on every tile: its recipe's out-of-fold figures, on its training tiles, said so
    assert line.startswith("- its recipe cross-validated") and "held-out" not in line
    assert set(md["test_metrics"]["tiles"]) <= set(md["training_data"]["train_tiles"])
    assert f"on {len(md['training_data']['train_tiles'])} tiles" in bundled

    splits = pd.read_csv(score_model.parent / "chips" / "splits.csv", dtype={"tile": str})
    held_out = sorted(set(splits.loc[splits["fold"] == 0, "tile"]))
    trained = sorted(set(splits.loc[splits["fold"] != 0, "tile"]))
    for tiles, marked in ((held_out, False), (trained, True)):
        proto = onnx.load(str(score_model))
        figures = {"accuracy": 0.5, "macro_f1": 0.4, "n": 9, "tiles": tiles, "source": "m.json"}
        set_metadata(proto, {"test_metrics": figures})
        model = save_onnx(proto, tmp_path / f"tested-{marked}.onnx")
        assert read_metadata(onnx.load(str(model)))["test_metrics"]["tiles"] == tiles
        line = next(x for x in card_markdown(Predictor(model)).splitlines() if "0.4000" in x)
        assert ("in the model's training data**" in line) == marked
        assert line.startswith("- held-out test") != marked

    # a model trained on every tile carries its recipe's out-of-fold figures: on its own
    # training tiles, said to be the recipe's cross-validation, not held-out figures of it
    proto = onnx.load(str(score_model))
    cv = {"folds": [0, 1, 2], "ece": 0.05, "intact_called_damaged": 0.125}
    figures = {"accuracy": 0.5, "macro_f1": 0.4, "n": 9, "tiles": trained, "cross_validation": cv}
    set_metadata(proto, {"test_metrics": figures})
    model = save_onnx(proto, tmp_path / "cross-validated.onnx")
    line = next(x for x in card_markdown(Predictor(model)).splitlines() if "0.4000" in x)
    assert line.startswith("- its recipe cross-validated (9 buildings, ")
    assert "3 folds; each building graded by a model of the same recipe that never saw" in line
    assert line.endswith("ECE 0.0500, intact buildings called damaged 12.5%")
    assert "held-out" not in line and "training data**" not in line


def test_callbacks_are_plain_functions(score_model, xbd_tile, tmp_path):
    """The functions the app's events call, without Gradio: the tile graded, a building's chips
    at the page's chip size, a correction saved; the analyst's mistakes raise AppError."""
    from app.web.callbacks import AppContext, on_assess_tile, on_chips, on_correct, on_model
    from app.web.model_picker import ModelCache
    from app.web.sessions import AppError
    from app.web.tile_views import CHIP_VIEW_SIZE

    pre, post, label = (str(p) for p in xbd_tile[:3])  # Gradio passes paths as text
    n = xbd_tile[3]
    model = str(score_model.resolve())
    ctx = AppContext(ModelCache([model]), tmp_path / "work")
    assert "training data:" in on_model(ctx, model)
    assert on_model(ctx, None).startswith("**Model not usable:**")
    overlay, summary, table, files, session = on_assess_tile(ctx, model, pre, post, label)
    assert Path(overlay).is_file() and f"**{n} buildings**" in summary and len(table) == n
    assert len(files) == 2 and Path(session).parent == tmp_path / "work" / "sessions"
    chip_pre, chip_post = on_chips(ctx, session, model, 0)
    assert chip_pre.shape == chip_post.shape == (CHIP_VIEW_SIZE, CHIP_VIEW_SIZE, 3)
    message, path = on_correct(session, 0, "destroyed")
    assert "building #0 is **destroyed**" in message and Path(path).is_file()
    with pytest.raises(AppError, match="choose a building first"):
        on_correct(session, None, "destroyed")  # the # box empty (as after an assessment)
    with pytest.raises(AppError, match="upload the post file"):
        on_assess_tile(ctx, model, pre, None, label)
    with pytest.raises(AppError, match="assess a tile first"):
        on_chips(ctx, None, model, 0)


def test_false_alarm_cost_in_the_app(score_model, xbd_tile, tile_result, tmp_path):
    """The Tile tab's false-alarm cost: grades moved towards no-damage by the rule of
    runtime.grading, the probabilities kept, the summary saying so; a bad cost is refused."""
    from app.web.callbacks import AppContext, on_assess_tile
    from app.web.model_picker import ModelCache
    from app.web.sessions import AppError
    from runtime.grading import grades

    pre, post, label = (str(p) for p in xbd_tile[:3])
    model = str(score_model.resolve())
    ctx = AppContext(ModelCache([model]), tmp_path / "work")
    plain = [r for r in tile_result.rows if r.get("status") == "scored"]
    names = list(tile_result.class_names)
    cols = [c for c in plain[0] if c.startswith("p_")]
    p = np.array([[r[c] for c in cols] for r in plain], dtype=float)
    assert (p.argmax(axis=1) > 0).any(), "the tiny model grades no building damaged here"
    cost = 1e6
    _, summary, table, _, _ = on_assess_tile(ctx, model, pre, post, label, cost)
    assert "Grades: a damaged grade only where at least 1e+06 times" in summary
    scored = table[table["status"] == "scored"]
    assert np.allclose(scored[cols].to_numpy(float), p, atol=1e-6)
    want = [names[i] for i in grades(p, names, cost)]
    assert list(scored["damage"]) == want and set(want) == {"no-damage"}
    _, summary1, _, _, _ = on_assess_tile(ctx, model, pre, post, label, 1)
    assert "Grades:" not in summary1
    with pytest.raises(AppError, match="false-alarm cost must be a positive number"):
        on_assess_tile(ctx, model, pre, post, label, 0)
    with pytest.raises(AppError, match="false-alarm cost 'three'"):
        on_assess_tile(ctx, model, pre, post, label, "three")
    # a model with its own rule (metadata grade_rule) grades with it when the field is empty
    import onnx

    from runtime.contract import save_onnx, set_metadata

    proto = onnx.load(model)
    set_metadata(proto, {"grade_rule": {"false_alarm_cost": cost}})
    own = str(save_onnx(proto, tmp_path / "own.onnx"))
    ctx = AppContext(ModelCache([own]), tmp_path / "work-own")
    _, summary, table, _, _ = on_assess_tile(ctx, own, pre, post, label, None)
    assert "times as probable as no-damage (the model's own rule)" in summary
    assert set(table.loc[table["status"] == "scored", "damage"]) == {"no-damage"}
    from app.web.model_card import card_markdown
    from runtime.predictor import Predictor

    assert "- grades: a damaged grade only where at least 1e+06 times" in card_markdown(
        Predictor(own)
    )
    assert "- grades: the most probable grade" in card_markdown(Predictor(model))
    _, summary1, table1, _, _ = on_assess_tile(ctx, own, pre, post, label, 1)
    assert "Grades:" not in summary1
    assert list(table1.loc[table1["status"] == "scored", "damage"]) == [
        names[i] for i in p.argmax(axis=1)
    ]
