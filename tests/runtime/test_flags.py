"""Abstain flags: the checks on small made-up chips, the ood prototypes through a real model's
metadata and ONNX Runtime, and the flags column of a real `score` run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from bench.flags import cloud_overlay, haze_veil
from cli.main import main
from runtime.flags import (
    Flagger,
    OodCheck,
    class_prototypes,
    flags_text,
    ood_block,
    pair_flags,
    parse_flags,
    sky_stats,
)


def _textured(seed: int = 0, size: int = 64) -> np.ndarray:
    """A chip with roof-like texture: blocks of varied grey plus pixel noise, mid brightness."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(60, 190, (size // 8, size // 8, 3)).repeat(8, 0).repeat(8, 1)
    noise = rng.normal(0, 12, (size, size, 3))
    return np.clip(blocks + noise, 0, 255).astype(np.uint8)


def test_normal_textured_pair_has_no_flags():
    pre, post = _textured(0), _textured(1)
    assert pair_flags(pre, post) == []
    assert pair_flags(pre, pre.copy()) == []


@pytest.mark.parametrize("which", ["pre", "post", "both"])
def test_blank_chip_is_flagged_blank_alone(which):
    pre, post = _textured(0), _textured(1)
    if which in ("pre", "both"):
        pre = np.zeros_like(pre)
    if which in ("post", "both"):
        post = np.full_like(post, 17)  # a constant nodata fill
    # blank wins over everything else: the pair is not scored
    assert pair_flags(pre, post, shift_px=10.0) == ["blank"]


def test_bright_flat_overlay_is_cloud():
    pre, post = _textured(0), _textured(1)
    cloudy = cloud_overlay(post, np.random.default_rng(3))
    assert sky_stats(pre, cloudy).bright_flat > 0.6
    assert pair_flags(pre, cloudy) == ["cloud"]
    # a bright but textured post (no cloud) is not
    bright = np.clip(post.astype(int) + 60, 0, 255).astype(np.uint8)
    assert pair_flags(pre, bright) == []
    # a cloud over the pre image hides the building as much: cloud too
    cloudy_pre = cloud_overlay(pre, np.random.default_rng(3))
    s = sky_stats(cloudy_pre, post)
    assert s.bright_flat_pre > 0.6 and s.bright_flat < 0.6
    assert pair_flags(cloudy_pre, post) == ["cloud"]
    assert pair_flags(np.clip(pre.astype(int) + 60, 0, 255).astype(np.uint8), post) == []


def test_contrast_collapse_under_a_veil_is_haze():
    pre = _textured(0)
    # a grey veil that keeps the post under the cloud brightness but flattens its texture
    post = np.clip(0.2 * pre.astype(float) + 0.8 * 165, 0, 255).astype(np.uint8)
    s = sky_stats(pre, post)
    assert s.contrast_ratio < 0.35 and s.brightening > 25 and s.bright_flat < 0.6
    assert pair_flags(pre, post) == ["haze"]
    # the same flattening of a pair that was just as flat before is no haze
    assert pair_flags(post, post.copy()) == []
    # the bench's haze veil is caught as haze or cloud
    veiled = haze_veil(_textured(1), np.random.default_rng(0))
    assert pair_flags(pre, veiled) in (["haze"], ["cloud"])


def test_misaligned_only_from_a_measured_shift():
    pre, post = _textured(0), _textured(1)
    assert pair_flags(pre, post, shift_px=1.0) == []
    assert pair_flags(pre, post, shift_px=6.0) == ["misaligned"]
    assert Flagger(measure_shift=lambda a, b: 9.0).pair(pre, post) == ["misaligned"]
    assert "misaligned" in Flagger().checks  # the alignment check of data_prep by default
    # a shift measured around the building (source pixels) has its own limit and wins over
    # the chips' own measurement
    flagger = Flagger(measure_shift=lambda a, b: 9.0)
    assert flagger.pair(pre, post, context_px=5.0) == []
    assert flagger.pair(pre, post, context_px=float("nan")) == []
    assert Flagger().pair(pre, post, context_px=7.0) == ["misaligned"]
    assert flagger.batch(np.stack([pre, pre]), np.stack([post, post]), context_px=[7.0, None]) == [
        ["misaligned"],
        ["misaligned"],
    ]
    assert flagger.batch(np.stack([pre]), np.stack([post]), context_px=[1.0]) == [[]]


def _ood_metadata(threshold: float = 0.5) -> dict:
    protos = np.eye(4, 8)  # four orthogonal class directions in 8 dimensions
    block = ood_block(protos, threshold, ["a", "b", "c", "d"], 0.01, {}, {})
    return {"ood": json.loads(json.dumps(block))}  # as a model file carries it


def test_embedding_far_from_every_prototype_is_ood():
    pre, post = _textured(0), _textured(1)
    md = _ood_metadata()
    near = np.array([0.9, 0.1, 0, 0, 0.3, 0, 0, 0])  # cosine 0.94 to class a
    far = np.array([0.2, 0.2, 0, 0, 1, 1, 0, 0])  # largest cosine 0.14
    assert pair_flags(pre, post, near, md) == []
    assert pair_flags(pre, post, far, md) == ["ood"]
    assert pair_flags(pre, post, np.zeros(8), md) == ["ood"]  # no direction at all
    flagger = Flagger(md)
    got = flagger.batch(np.stack([pre, pre]), np.stack([post, post]), np.stack([near, far]))
    assert got == [[], ["ood"]]
    # a model without prototypes never flags ood
    assert pair_flags(pre, post, far, {}) == []
    assert "ood" not in Flagger({}).checks and "ood" in flagger.checks


def test_class_prototypes_are_normalised_class_means():
    z = np.array([[1, 0, 0], [0.6, 0.8, 0], [0, 0, 1], [0, 0, 2.0]])
    protos, classes = class_prototypes(z, np.array([0, 0, 2, 2]), 3)
    assert classes == [0, 2]  # class 1 has no example: no prototype
    np.testing.assert_allclose(protos[0], np.array([0.8, 0.4, 0]) / np.hypot(0.8, 0.4))
    np.testing.assert_allclose(protos[1], [0, 0, 1])


def test_flags_text_order_and_parsing():
    assert flags_text([]) == ""
    assert flags_text(["ood", "cloud", "misaligned"]) == "cloud;misaligned;ood"
    assert parse_flags("cloud;ood") == ["cloud", "ood"] and parse_flags(None) == []
    with pytest.raises(ValueError, match="unknown flag"):
        flags_text(["smoke"])


def test_bad_ood_metadata_is_refused():
    with pytest.raises(ValueError, match="prototypes"):
        OodCheck.from_metadata({"ood": {"threshold": 0.2}})


# --------------------------------------------------------------------------------------------
# prototypes and threshold stored by `calibrate`, read through ONNX Runtime


@pytest.fixture(scope="module")
def with_ood(score_model, chips, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("flags") / "tiny.ood.onnx"
    args = ["calibrate", "--model", str(score_model), "--chips", str(chips), "--fold", "0"]
    assert main([*args, "--prototype-folds", "1,2", "--out", str(out), "--quiet"]) == 0
    return out


def _fold_pairs(chips: Path, folds: list[int]):
    from data_prep.split import fold_indices
    from data_prep.store import ChipReader, read_manifest

    ids = set()
    for f in folds:
        ids |= set(fold_indices(chips, f)[1])
    frame = read_manifest(chips)
    records = frame[frame["chip_id"].isin(ids) & (frame["label"] >= 0)].to_dict("records")
    reader = ChipReader(chips)
    pairs = [reader.pair(r) for r in records]
    labels = np.array([r["label"] for r in records])
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs]), labels


@pytest.mark.slow
def test_prototypes_and_threshold_round_trip_through_the_model(score_model, with_ood, chips):
    from runtime.predictor import Predictor

    model = Predictor(with_ood)
    check = OodCheck.from_metadata(model.metadata)
    assert check is not None and OodCheck.from_metadata(Predictor(score_model).metadata) is None
    block = model.metadata["ood"]
    assert block["prototypes_from"]["folds"] == [1, 2] and block["threshold_from"]["fold"] == 0
    assert model.card()["ood"]["threshold"] == block["threshold"]
    assert "prototypes" not in model.card()["ood"]

    # the stored prototypes are the normalised class means of folds 1 and 2, computed here
    pre, post, labels = _fold_pairs(chips, [1, 2])
    z = model.predict(pre, post).embedding
    protos, classes = class_prototypes(z, labels, len(model.class_names))
    assert block["class_names"] == [model.class_names[c] for c in classes]
    np.testing.assert_allclose(check.prototypes, protos, atol=1e-5)

    # the threshold is the 1% quantile of fold 0's largest cosine to a prototype
    pre0, post0, _ = _fold_pairs(chips, [0])
    scores = check.scores(model.predict(pre0, post0).embedding)
    assert check.threshold == pytest.approx(np.quantile(scores, 0.01), abs=1e-5)
    assert block["threshold_from"]["n"] == len(scores)
    flagged = Flagger(model.metadata).batch(pre0, post0, model.predict(pre0, post0).embedding)
    assert sum("ood" in f for f in flagged) == int(np.sum(scores < check.threshold))

    # the temperature is stored beside it, and --no-ood leaves the block as it was
    assert model.temperature is not None
    again = with_ood.parent / "again.onnx"
    shutil.copy(with_ood, again)
    args = ["calibrate", "--model", str(again), "--chips", str(chips), "--fold", "0"]
    assert main([*args, "--no-ood", "--out", str(again), "--quiet"]) == 0
    assert Predictor(again).metadata["ood"] == block


def test_prototype_folds_must_not_hold_the_calibration_fold(score_model, chips, tmp_path, capsys):
    args = ["calibrate", "--model", str(score_model), "--chips", str(chips), "--fold", "0"]
    out = tmp_path / "m.onnx"
    assert main([*args, "--prototype-folds", "0,1", "--out", str(out), "--quiet"]) == 2
    assert "calibration fold 0" in capsys.readouterr().err and not out.exists()
    assert main([*args, "--prototype-folds", "7", "--out", str(out), "--quiet"]) == 2
    assert "not usable" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# the flags column of a real scoring run


def _tile(root: Path, name: str = "synthetic-flood_00000000"):
    return (
        root / "images" / f"{name}_pre_disaster.png",
        root / "images" / f"{name}_post_disaster.png",
        root / "labels" / f"{name}_post_disaster.json",
    )


def test_score_writes_flags_blank_not_scored_and_cloud(tmp_path, synthetic_xbd, with_ood):
    import cv2
    import geopandas as gpd

    from data_prep.report import PrepareReport
    from data_prep.windows import chip_window
    from data_prep.xbd_tiles import parse_buildings
    from runtime.predictor import Predictor

    pre, post, labels = _tile(synthetic_xbd)
    spec = Predictor(with_ood).spec
    buildings = parse_buildings(labels, PrepareReport(), ignore_labels=True)[1]
    assert len(buildings) >= 3
    pre_img, post_img = cv2.imread(str(pre)), cv2.imread(str(post))
    h, w = pre_img.shape[:2]

    def window(b):
        win = chip_window(b.centroid, b.bbox, spec)
        r0, c0 = max(win.row_off - 2, 0), max(win.col_off - 2, 0)
        return slice(r0, min(win.row_off + win.size + 2, h)), slice(
            c0, min(win.col_off + win.size + 2, w)
        )

    blank_b, cloud_b = buildings[0], buildings[-1]
    pre_img[window(blank_b)] = 0  # a nodata hole in the pre image under the first building
    rows, cols = window(cloud_b)
    patch = cv2.cvtColor(post_img[rows, cols], cv2.COLOR_BGR2RGB)
    cloudy = np.full_like(patch, 245)  # an opaque cloud, barely textured, over the last one
    cloudy = np.clip(cloudy + np.random.default_rng(0).normal(0, 1, cloudy.shape), 0, 255)
    post_img[rows, cols] = cv2.cvtColor(cloudy.astype(np.uint8), cv2.COLOR_RGB2BGR)
    (tmp_path / "images").mkdir()
    (tmp_path / "labels").mkdir()
    mine_pre, mine_post, mine_labels = _tile(tmp_path)
    cv2.imwrite(str(mine_pre), pre_img)
    cv2.imwrite(str(mine_post), post_img)
    shutil.copy(labels, mine_labels)

    for suffix in (".geojson", ".gpkg"):
        out = tmp_path / f"tile{suffix}"
        argv = ["score", "--pre", str(mine_pre), "--post", str(mine_post)]
        argv += ["--labels", str(mine_labels), "--model", str(with_ood), "--out", str(out)]
        overlay = tmp_path / f"tile{suffix}.png"
        assert main([*argv, "--overlay", str(overlay), "--quiet"]) == 0
        df = gpd.read_file(out).set_index("uid")
        assert "flags" in df.columns
        blank = df.loc[blank_b.uid]
        assert blank["flags"] == "blank" and blank["status"].startswith("skipped: blank imagery")
        assert blank["damage"] is None or blank["damage"] != blank["damage"]  # null: not scored
        cloud = df.loc[cloud_b.uid]
        assert cloud["status"] == "scored" and "cloud" in parse_flags(cloud["flags"])
        scored = df[df["status"] == "scored"]
        assert scored["damage"].notna().all()
        # flags hold only known names, and most untouched buildings have none
        for text in df["flags"]:
            flags_text(parse_flags(text))
        untouched = scored.drop(index=[cloud_b.uid], errors="ignore")
        assert (untouched["flags"].fillna("") == "").mean() >= 0.5
        # the tile part of the overlay (above the legend) shows the flagged outline (magenta)
        image = cv2.cvtColor(cv2.imread(str(overlay)), cv2.COLOR_BGR2RGB)[:h]
        magenta = (image[..., 0] > 200) & (image[..., 1] < 40) & (image[..., 2] > 200)
        assert magenta.sum() > 20
