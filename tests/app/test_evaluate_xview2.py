"""xView2 targets drawn from label polygons, and `local-damage evaluate xview2` end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from cli.main import main
from data_prep.xview2 import XVIEW2_VALUES, XView2Counts, rasterize_values, xview2_targets


def _label(path: Path, features: list[tuple[str, str | None]]) -> Path:
    xy = [
        {
            "properties": {"feature_type": "building", "uid": f"b{i}", "subtype": subtype},
            "wkt": wkt,
        }
        for i, (wkt, subtype) in enumerate(features)
    ]
    path.write_text(json.dumps({"features": {"xy": xy, "lng_lat": []}, "metadata": {}}))
    return path


def _square(x0: float, y0: float, side: float) -> str:
    x1, y1 = x0 + side, y0 + side
    return f"POLYGON (({x0} {y0}, {x1} {y0}, {x1} {y1}, {x0} {y1}, {x0} {y0}))"


# ---------------------------------------------------------------------------------- targets


def test_targets_pixel_counts(tmp_path):
    label = _label(
        tmp_path / "t_post_disaster.json",
        [
            (_square(2, 2, 4), "minor-damage"),  # pixels 2-5 x 2-5: 16
            (_square(4, 4, 4), "destroyed"),  # 4-7 x 4-7: 16, over the first's 4-5 x 4-5
            (_square(10, 0, 2), "un-classified"),  # 4 pixels, drawn as no-damage
            (_square(14, 14, 4), "major-damage"),  # 14-17 x 14-17, clipped to 14-15: 4
            ("POLYGON ((1 1, 2", "no-damage"),  # invalid WKT
        ],
    )
    t = xview2_targets(label, (16, 16))
    assert t.damage.dtype == np.uint8 and t.damage.shape == (16, 16)
    counts = {v: int((t.damage == v).sum()) for v in range(5)}
    assert counts == {0: 256 - 12 - 16 - 4 - 4, 1: 4, 2: 12, 3: 4, 4: 16}
    assert t.damage[4:6, 4:6].tolist() == [[4, 4], [4, 4]]  # the later polygon wins
    assert t.damage[2, 2] == 2 and t.damage[0, 10] == 1 and t.damage[15, 15] == 3
    assert t.localization.sum() == 36 and set(np.unique(t.localization)) == {0, 1}
    assert (t.buildings, t.unclassified) == (4, 1)
    assert t.skipped == [("b4", "invalid or empty polygon WKT")]


def test_targets_follow_pixel_centres():
    # a half-pixel square holds one pixel centre, a square between centres holds none
    from shapely import wkt

    tiny = rasterize_values([wkt.loads(_square(3.2, 3.2, 0.6))], [4], (8, 8))
    assert tiny.sum() == 4 and tiny[3, 3] == 4
    none = rasterize_values([wkt.loads(_square(3.6, 3.6, 0.8))], [4], (8, 8))
    assert none.sum() == 0
    assert rasterize_values([], [], (3, 5)).shape == (3, 5)


def test_targets_refuse_labels_without_damage(tmp_path):
    pre = _label(tmp_path / "t_pre_disaster.json", [(_square(0, 0, 2), None)])
    with pytest.raises(ValueError, match="no damage subtype"):
        xview2_targets(pre, (4, 4))
    odd = _label(tmp_path / "odd.json", [(_square(0, 0, 2), "flooded")])
    with pytest.raises(ValueError, match="'flooded'"):
        xview2_targets(odd, (4, 4))
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(ValueError, match="not an xBD label"):
        xview2_targets(bad, (4, 4))
    assert XVIEW2_VALUES["un-classified"] == XVIEW2_VALUES["no-damage"] == 1


# ------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def scored(tmp_path_factory, synthetic_xbd, score_model):
    out = tmp_path_factory.mktemp("xview2") / "out"
    args = ["evaluate", "xview2", "--root", str(synthetic_xbd), "--model", str(score_model)]
    rc = main([*args, "--out", str(out), "--pngs", "--quiet"])
    return rc, out


def test_end_to_end(scored, synthetic_xbd, capsys):
    import geopandas as gpd

    rc, out = scored
    assert rc == 0
    m = json.loads((out / "metrics.json").read_text())
    g = m["modes"]["given"]
    assert g["tiles"] == 3 and len(m["tiles"]) == 3 and m["failed"] == []
    assert g["localization_f1"] == 1.0  # the given footprints are the target's buildings
    # damage F1 by hand from the per-class pixel counts (the reference scorer's formula): the
    # harmonic mean of the four class F1s, each 2 TP / (2 TP + FP + FN), 1e-6 added to each
    assert sorted(g["damage"]) == sorted(["no-damage", "minor-damage", "major-damage", "destroyed"])
    f1s = [
        2 * d["tp"] / (2 * d["tp"] + d["fp"] + d["fn"]) if d["tp"] else 0.0
        for d in g["damage"].values()
    ]
    assert g["damage_f1"] == pytest.approx(4 / sum(1 / (f + 1e-6) for f in f1s), rel=1e-9)
    # every target building pixel counts once, as a hit or a miss of its class
    assert sum(d["tp"] + d["fn"] for d in g["damage"].values()) == g["localization"]["tp"]
    assert g["score"] == pytest.approx(0.3 + 0.7 * g["damage_f1"])
    assert m["targets"]["unclassified"] == 1 and m["targets"]["skipped"] == 1
    assert g["graded"] < g["buildings"]  # the invalid-WKT building is not graded

    pooled = XView2Counts()
    for row in m["tiles"]:
        tile, i = row["tile"], row["id"]
        label = synthetic_xbd / "labels" / f"{tile}_post_disaster.json"
        png = out / "xview2"
        import cv2

        read = lambda p: cv2.imread(str(p), cv2.IMREAD_UNCHANGED)  # noqa: E731
        dt = read(png / "targets" / f"test_damage_{i}_target.png")
        lt = read(png / "targets" / f"test_localization_{i}_target.png")
        dp = read(png / "predictions_given" / f"test_damage_{i}_prediction.png")
        lp = read(png / "predictions_given" / f"test_localization_{i}_prediction.png")
        targets = xview2_targets(label, dt.shape)
        assert (dt == targets.damage).all() and (lt == targets.localization).all()
        # the damage prediction is each graded building's class id + 1 under its footprint
        buildings = gpd.read_file(out / "given" / f"{tile}.gpkg")
        graded = buildings[buildings["status"] == "scored"]
        want = rasterize_values(list(graded.geometry), graded["damage_id"] + 1, dt.shape)
        assert (dp == want).all()
        assert row["modes"]["given"]["graded"] == len(graded)
        one = XView2Counts()
        one.add(lp, dp, lt, dt)
        assert one.loc.tolist() == row["modes"]["given"]["localization"]
        assert one.damage.tolist() == row["modes"]["given"]["damage"]
        pooled += one
    s = pooled.scores()
    assert s["damage_f1"] == pytest.approx(g["damage_f1"])
    assert s["score"] == pytest.approx(g["score"])


def test_tiles_of_a_fold(tmp_path, synthetic_xbd, score_model, capsys):
    from data_prep.synthetic import tile_name

    chips = tmp_path / "chips"
    chips.mkdir()
    rows = ["chip_id,tile,event,fold"] + [
        f"{tile_name(t)}:b,{tile_name(t)},{tile_name(t).rsplit('_', 1)[0]},{t % 2}"
        for t in range(3)
    ]
    (chips / "splits.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    args = ["evaluate", "xview2", "--root", str(synthetic_xbd), "--model", str(score_model)]
    assert main([*args, "--chips", str(chips), "--fold", "1", "--out", str(out), "--quiet"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert [r["tile"] for r in m["tiles"]] == [tile_name(1)]
    assert "fold 1" in m["selection"] and "fold 1" in capsys.readouterr().out
    assert main([*args, "--tiles", tile_name(2), "--out", str(out), "--quiet"]) == 0
    assert [r["tile"] for r in json.loads((out / "metrics.json").read_text())["tiles"]] == [
        tile_name(2)
    ]


def test_tiles_of_a_fold_across_two_roots(tmp_path, synthetic_xbd, score_model):
    """Repeated ``--xbd``: a fold's tiles found in whichever folder holds them."""
    from data_prep.synthetic import tile_name

    roots = [tmp_path / "a", tmp_path / "b"]
    for i, root in enumerate(roots):
        for sub in ("images", "labels"):
            (root / sub).mkdir(parents=True)
            for f in (synthetic_xbd / sub).glob(f"{tile_name(2 * i)}_*"):
                shutil.copy(f, root / sub / f.name)
    chips = tmp_path / "chips"
    chips.mkdir()
    rows = ["chip_id,tile,event,fold"] + [
        f"{tile_name(t)}:b,{tile_name(t)},{tile_name(t).rsplit('_', 1)[0]},0" for t in (0, 2)
    ]
    (chips / "splits.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    args = ["evaluate", "xview2", "--xbd", str(roots[0]), "--xbd", str(roots[1])]
    args += ["--model", str(score_model), "--chips", str(chips), "--fold", "0"]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert [r["tile"] for r in m["tiles"]] == [tile_name(0), tile_name(2)]
    assert m["source"]["root"] == [str(r) for r in roots]
    # one folder alone misses the other's tile, and the message names the folder
    from app.scoring.xview2 import XView2EvaluationError, select_tiles

    with pytest.raises(
        XView2EvaluationError, match=rf"{roots[0]}: tile\(s\) not found: {tile_name(2)}"
    ):
        select_tiles(roots[0], chips=chips, fold=0)


def test_detected_footprints_are_graded_as_given_ones(tmp_path, synthetic_xbd, score_model):
    import shapely

    from app.scoring.xview2 import (
        XView2EvaluationError,
        predict_detected,
        predict_given,
    )
    from data_prep.synthetic import tile_name
    from data_prep.xbd_tiles import find_tiles
    from runtime.predictor import Predictor

    tile = next(t for t in find_tiles(synthetic_xbd)[0] if t.name == tile_name(0))
    xy = json.loads(tile.label.read_text())["features"]["xy"]
    polygons = [shapely.from_wkt(f["wkt"], on_invalid="ignore") for f in xy]
    targets = xview2_targets(tile.label, (256, 256))
    predictor = Predictor(score_model)
    given = predict_given(predictor, tile, targets.localization, tmp_path / "given")
    # a localiser that finds exactly the label's buildings grades exactly as the given footprints
    found = predict_detected(predictor, tile, targets.localization, polygons, tmp_path / "det")
    assert (found.loc_pred == given.loc_pred).all()
    assert (found.damage_pred == given.damage_pred).all()
    assert (found.buildings, found.graded) == (given.buildings - 1, given.graded)
    # nothing found: no building, no grade
    none = predict_detected(predictor, tile, np.zeros((256, 256)), [], tmp_path / "none")
    assert none.loc_pred.sum() == 0 and none.damage_pred.sum() == 0 and none.buildings == 0
    with pytest.raises(XView2EvaluationError, match="128x128 px, the image 256x256"):
        predict_detected(predictor, tile, np.zeros((128, 128)), [], tmp_path / "none")


@pytest.mark.slow
def test_both_modes_with_a_localiser(tmp_path, synthetic_xbd, score_model, monkeypatch, capsys):
    """The command with --localizer scores both modes; here the localiser is a stand-in that
    finds the left half of every label building (the runtime's own tests cover the real one)."""
    import shapely

    from app.scoring import xview2 as ev

    def half(localizer, tile):
        xy = json.loads(tile.label.read_text())["features"]["xy"]
        polygons = [shapely.from_wkt(f["wkt"], on_invalid="ignore") for f in xy]
        targets = xview2_targets(tile.label, ev._image_shape(tile.pre))
        mask = targets.localization.copy()
        mask[:, mask.shape[1] // 2 :] = 0
        return mask, polygons

    monkeypatch.setattr(ev, "load_localizer", lambda path: object())
    monkeypatch.setattr(ev, "detect_buildings", half)
    out = tmp_path / "out"
    stand_in = tmp_path / "loc.onnx"
    stand_in.write_bytes(b"")  # a file, as --localizer must name; never opened here
    args = ["evaluate", "xview2", "--root", str(synthetic_xbd), "--model", str(score_model)]
    assert main([*args, "--localizer", str(stand_in), "--out", str(out), "--quiet"]) == 0
    assert "detected (3 tiles" in capsys.readouterr().out
    m = json.loads((out / "metrics.json").read_text())
    given, detected = m["modes"]["given"], m["modes"]["detected"]
    assert detected["localization"]["fp"] == 0 and detected["localization"]["fn"] > 0
    assert detected["localization"]["precision"] == 1.0 and detected["localization_f1"] < 1
    # grades are the same; only the pixels outside the mask turn into misses
    for name, d in detected["damage"].items():
        g = given["damage"][name]
        assert d["tp"] <= g["tp"] and d["fp"] <= g["fp"]
        assert d["tp"] + d["fn"] == g["tp"] + g["fn"]
    assert m["source"]["localizer"] == str(stand_in)


def test_detected_with_the_localiser_runtime(tmp_path, synthetic_xbd, score_model):
    """--localizer runs runtime.localizer.Localizer: its mask is the localisation prediction."""
    from data_prep.imagery import read_rgb
    from data_prep.synthetic import tile_name
    from runtime.localizer import Localizer
    from tests.app.rects import make_localizer

    loc = make_localizer(tmp_path / "localizer.onnx", level=100.0)
    out = tmp_path / "out"
    args = ["evaluate", "xview2", "--root", str(synthetic_xbd), "--model", str(score_model)]
    rc = main([*args, "--tiles", tile_name(0), "--localizer", str(loc), "--out", str(out)])
    assert rc == 0
    m = json.loads((out / "metrics.json").read_text())
    detected = m["modes"]["detected"]
    assert not (out / "xview2").exists()  # no --pngs
    mask = Localizer(loc).mask(
        read_rgb(synthetic_xbd / "images" / f"{tile_name(0)}_pre_disaster.png")
    )
    tp, fn, fp = m["tiles"][0]["modes"]["detected"]["localization"]
    assert tp + fp == int(mask.sum())
    assert detected["buildings"] >= 1 and (out / "detected" / f"{tile_name(0)}.gpkg").is_file()


def test_clear_errors(tmp_path, synthetic_xbd, score_model, capsys):
    from data_prep.synthetic import tile_name

    def error(*args: str) -> str:
        assert main(["evaluate", "xview2", *args, "--out", str(tmp_path / "out")]) == 2
        return capsys.readouterr().err

    model = ["--model", str(score_model)]
    root = ["--root", str(synthetic_xbd)]
    assert "does not exist" in error("--root", str(tmp_path / "nowhere"), *model)
    assert "model file not found" in error(*root, "--model", str(tmp_path / "none.onnx"))
    assert "needs --chips" in error(*root, *model, "--fold", "0")
    assert "no fold 7" in error(*root, *model, "--fold", "7", "--chips", str(_store(tmp_path)))
    assert "not found: nope_00000001" in error(*root, *model, "--tiles", "nope_00000001")
    err = error(*root, *model, "--localizer", str(tmp_path / "loc.onnx"))
    assert "loc.onnx: localiser model file not found" in err
    # a tile whose label is missing
    unlabelled = tmp_path / "unlabelled"
    shutil.copytree(synthetic_xbd / "images", unlabelled / "images")
    (unlabelled / "labels").mkdir()
    err = error("--root", str(unlabelled), *model, "--tiles", tile_name(0))
    assert f"{tile_name(0)}_post_disaster.json" in err and "label not found" in err
    # the plain evaluate command still asks for its own options
    assert main(["evaluate", "--model", str(score_model)]) == 2
    assert "--chips or --xbd" in capsys.readouterr().err


def _store(tmp_path: Path) -> Path:
    chips = tmp_path / "store"
    chips.mkdir(exist_ok=True)
    (chips / "splits.csv").write_text("chip_id,tile,event,fold\nx:1,x,e,0\n")
    return chips


# ------------------------------------------------------------- the model's training tiles


def _tiles_by_training(score_model: Path) -> tuple[list[str], list[str]]:
    """``(trained, held_out)`` tiles of the synthetic xBD root for the test model, from the
    splits of the store it was trained on (validation fold 0), not from its metadata."""
    import pandas as pd

    splits = pd.read_csv(score_model.parent / "chips" / "splits.csv", dtype={"tile": str})
    trained = sorted(set(splits.loc[splits["fold"] != 0, "tile"]))
    held_out = sorted(set(splits.loc[splits["fold"] == 0, "tile"]))
    assert trained and held_out
    return trained, held_out


def test_export_records_the_training_tiles(score_model):
    from runtime.predictor import Predictor

    trained, _ = _tiles_by_training(score_model)
    info = Predictor(score_model).metadata["training_data"]
    assert info["train_tiles"] == trained
    assert info["validation_fold"] == 0


def test_training_tiles_are_marked_and_kept_from_published_figures(
    tmp_path, synthetic_xbd, score_model, capsys
):
    trained, held_out = _tiles_by_training(score_model)
    args = ["evaluate", "xview2", "--xbd", str(synthetic_xbd), "--model", str(score_model)]

    # tiles the model trained on: the row is marked, no published row beside it
    assert main([*args, "--tiles", *trained, "--out", str(tmp_path / "in"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("given ("))
    assert "graded) *" in row
    assert "in the model's training data" in printed
    assert "MambaBDA" not in printed and "xView2 baseline" not in printed
    assert "published figures left out" in printed
    m = json.loads((tmp_path / "in" / "metrics.json").read_text())
    assert m["training_data"]["given"]["tiles_in_training"] == trained
    assert [r["modes"]["given"]["in_training_data"] for r in m["tiles"]] == [True] * len(trained)
    assert m["held_out"] == {}

    # held-out tiles: not marked, and compared with the published figures
    assert main([*args, "--tiles", *held_out, "--out", str(tmp_path / "out"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("given ("))
    assert "*" not in row and "MambaBDA" in printed
    assert f"none of the {len(held_out)} tiles is in the model's training data" in printed
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert m["training_data"]["given"]["tiles_in_training"] == []
    assert {r["modes"]["given"]["in_training_data"] for r in m["tiles"]} == {False}


def test_a_mix_gives_the_held_out_tiles_apart(tmp_path, synthetic_xbd, score_model, capsys):
    trained, held_out = _tiles_by_training(score_model)
    out = tmp_path / "mix"
    args = ["evaluate", "xview2", "--xbd", str(synthetic_xbd), "--model", str(score_model)]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out.splitlines()
    pooled = next(line for line in printed if line.startswith("given ("))
    apart = next(line for line in printed if line.startswith("given, held-out tiles only"))
    assert "*" in pooled and "*" not in apart
    assert any(line.startswith("MambaBDA") for line in printed)
    assert any("published rows compare with the unmarked rows only" in line for line in printed)
    m = json.loads((out / "metrics.json").read_text())
    # the held-out row is the pooled counts of the held-out tiles alone
    pooled_counts = XView2Counts()
    for row in m["tiles"]:
        if row["tile"] in held_out:
            one = XView2Counts()
            one.loc = np.array(row["modes"]["given"]["localization"])
            one.damage = np.array(row["modes"]["given"]["damage"])
            one.tiles = 1
            pooled_counts += one
    h = m["held_out"]["given"]
    assert h["tiles"] == len(held_out)
    assert h["damage_f1"] == pytest.approx(pooled_counts.scores()["damage_f1"])
    assert f"{h['damage_f1']:.3f}" in apart


def test_unknown_training_tiles_are_said(tmp_path, synthetic_xbd, score_model, capsys):
    import onnx

    from runtime.contract import read_metadata, save_onnx, set_metadata

    proto = onnx.load(str(score_model))
    info = read_metadata(proto)["training_data"]
    info = {k: v for k, v in info.items() if k not in ("train_tiles", "chips")}
    set_metadata(proto, {"training_data": info})
    model = save_onnx(proto, tmp_path / "old.onnx")
    args = ["evaluate", "xview2", "--xbd", str(synthetic_xbd), "--model", str(model)]
    assert main([*args, "--out", str(tmp_path / "o"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "training tiles unknown" in printed and "does not list its training tiles" in printed
    m = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert m["training_data"]["given"]["known"] is False
    assert {r["modes"]["given"]["in_training_data"] for r in m["tiles"]} == {None}


@pytest.mark.slow
def test_an_adapted_models_labels_count_as_training_data(
    tmp_path, synthetic_xbd, score_model, capsys
):
    """Adapted to the labels of the held-out fold, the model has trained on those tiles too."""
    from runtime.predictor import Predictor

    _, held_out = _tiles_by_training(score_model)
    adapted = tmp_path / "adapted.onnx"
    chips = score_model.parent / "chips"
    adapt = ["adapt", "--model", str(score_model), "--chips", str(chips), "--fold", "0"]
    assert main([*adapt, "--out", str(adapted), "--quiet"]) == 0
    assert Predictor(adapted).metadata["adaptation"]["labels"]["tiles"] == held_out
    args = ["evaluate", "xview2", "--xbd", str(synthetic_xbd), "--model", str(adapted)]
    assert main([*args, "--tiles", *held_out, "--out", str(tmp_path / "o"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "graded) *" in printed and "MambaBDA" not in printed
    m = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert m["training_data"]["given"]["tiles_in_training"] == held_out
