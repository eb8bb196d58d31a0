"""`local-damage adapt`: adapted heads, unchanged unlabelled classes, label errors, suggestions.

Every model here is a real ONNX file run by ONNX Runtime: the tiny exported model of the
``score_model`` fixture, calibrated (temperature and ``ood`` prototypes) by ``calibrate``, then
adapted to labels of its own synthetic chip store.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_cli


@pytest.fixture(scope="module")
def base(score_model, chips, tmp_path_factory) -> Path:
    """The fixture model with a temperature and ood prototypes (what adapt must carry over)."""
    out = tmp_path_factory.mktemp("adapt") / "base.onnx"
    args = ["calibrate", "--model", score_model, "--chips", chips, "--fold", "0", "--out", out]
    assert run_cli(*args, "--quiet") == 0
    return out


#: Wall time of the ``adapted`` fixture's `adapt` command (the fit it records happens inside it).
ADAPT_WALL_SECONDS: dict[str, float] = {}


@pytest.fixture(scope="module")
def adapted(base, chips, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("adapted") / "adapted.onnx"
    start = time.perf_counter()
    assert run_cli("adapt", "--model", base, "--chips", chips, "--out", out) == 0
    ADAPT_WALL_SECONDS[str(out)] = time.perf_counter() - start
    return out


def _nll(probabilities: np.ndarray, labels: np.ndarray) -> float:
    return float(-np.log(np.clip(probabilities[np.arange(len(labels)), labels], 1e-12, 1)).mean())


# --------------------------------------------------------------------------------------------
# the adapted model


@pytest.mark.slow
def test_adapted_model_reproduces_its_labels_better_than_the_base(base, adapted, store, capsys):
    from runtime.predictor import Predictor

    old = Predictor(base).predict(store.pre, store.post)
    new = Predictor(adapted).predict(store.pre, store.post)
    y = store.labels
    acc_old = float(np.mean(old.probabilities.argmax(1) == y))
    acc_new = float(np.mean(new.probabilities.argmax(1) == y))
    assert acc_new > acc_old
    assert _nll(new.probabilities, y) < _nll(old.probabilities, y)
    # the graph is the base model's: same raw logits and embedding
    np.testing.assert_allclose(new.raw_logits, old.raw_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new.embedding, old.embedding, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new.probabilities.sum(1), 1.0, atol=1e-5)


def test_metadata_records_base_labels_and_every_candidate(base, adapted, store):
    from app.adapt.fit import METHODS
    from runtime.predictor import Predictor

    md = Predictor(adapted).metadata
    block = md["adaptation"]
    assert block["base_model"]["file"] == "base.onnx"
    assert block["base_model"]["sha256"] == hashlib.sha256(base.read_bytes()).hexdigest()
    base_t = Predictor(base).temperature
    assert block["base_model"]["calibration"]["temperature"] == pytest.approx(base_t)
    assert block["head"]["base_temperature"] == pytest.approx(base_t)
    names = Predictor(base).class_names
    assert block["labels"]["n"] == len(store)
    assert block["labels"]["per_class"] == {
        n: int(np.sum(store.labels == i)) for i, n in enumerate(names)
    }
    assert sum(block["labels"]["events"].values()) == len(store)
    assert set(block["cv"]["candidates"]) == set(METHODS)
    best = min(v["nll"] for v in block["cv"]["candidates"].values())
    assert block["cv"]["candidates"][block["method"]]["nll"] == best
    # the fit's seconds: measured, and within the command that ran it
    assert 0 < block["fit_seconds"] < ADAPT_WALL_SECONDS[str(adapted)]
    # one temperature on the head's output, 1 as written; ood prototypes kept
    assert md["calibration"]["temperature"] == 1.0 and md["calibration"]["adapted"]
    assert md["ood"] == Predictor(base).metadata["ood"]


def test_model_card_shows_the_adaptation(adapted, base):
    from app.web.app import card_markdown
    from runtime.predictor import Predictor

    text = card_markdown(Predictor(adapted))
    line = next(x for x in text.splitlines() if x.startswith("- adapted to a new event"))
    assert "yes" in line and "base.onnx" in line and "labelled buildings" in line
    assert "- adapted to a new event: no" in card_markdown(Predictor(base))
    assert Predictor(adapted).card()["adaptation"]["method"]


@pytest.mark.slow
def test_adapting_an_adapted_model_refits_from_the_base(adapted, base, store, tmp_path):
    from app.adapt.model import adapt_model
    from runtime.predictor import Predictor

    again = adapt_model(Predictor(adapted), store, tmp_path / "again.onnx").block
    first = Predictor(adapted).metadata["adaptation"]
    assert again["base_model"]["sha256"] == first["base_model"]["sha256"]
    assert again["base_model"]["adapted_from"]["file"] == "adapted.onnx"
    assert again["head"]["base_temperature"] == pytest.approx(Predictor(base).temperature)
    a = Predictor(adapted).predict(store.pre, store.post).probabilities
    b = Predictor(tmp_path / "again.onnx").predict(store.pre, store.post).probabilities
    np.testing.assert_allclose(a, b, atol=1e-5)  # the same labels give the same head


# --------------------------------------------------------------------------------------------
# classes without labels


def test_classes_without_labels_keep_the_base_probabilities(base, store, tmp_path):
    """Labels of no-damage and destroyed only, ``--unlabelled keep``: for every building, p(minor)
    and p(major) are the base model's calibrated probabilities."""
    from app.adapt.labelled import Buildings
    from app.adapt.model import adapt_model
    from runtime.predictor import Predictor

    keep = np.isin(store.labels, [0, 3])
    partial = Buildings(
        store.ids, store.events, np.where(keep, store.labels, -1), store.pre, store.post
    )
    out = tmp_path / "partial.onnx"
    result = adapt_model(Predictor(base), partial, out, unlabelled="keep")
    assert result.block["unlabelled_classes"] == ["minor-damage", "major-damage"]
    assert result.block["unlabelled_discount"] == {"minor-damage": 1.0, "major-damage": 1.0}
    old = Predictor(base).predict(store.pre, store.post).probabilities
    new = Predictor(out).predict(store.pre, store.post).probabilities
    np.testing.assert_allclose(new[:, [1, 2]], old[:, [1, 2]], atol=1e-5)
    np.testing.assert_allclose(new[:, [0, 3]].sum(1), old[:, [0, 3]].sum(1), atol=1e-5)


@pytest.mark.slow
def test_classes_without_labels_are_discounted_by_the_labels_evidence(base, store, tmp_path):
    """The default rule: p(c) of a class without a label that the base model called on a
    labelled building is the base model's times ``1 / (1 + e_c)``, ``e_c`` the base model's
    expected count of c among the labelled buildings (a class called less keeps its
    probability); the labelled classes share the rest, and the model file says so."""
    from app.adapt.fit import UNLABELLED_MIN_EVIDENCE
    from app.adapt.labelled import Buildings
    from app.adapt.model import adapt_model, format_adaptation
    from runtime.predictor import Predictor

    keep = np.isin(store.labels, [0, 3])
    partial = Buildings(
        store.ids, store.events, np.where(keep, store.labels, -1), store.pre, store.post
    )
    out = tmp_path / "partial.onnx"
    result = adapt_model(Predictor(base), partial, out)
    old = Predictor(base).predict(store.pre, store.post).probabilities
    expected = old[keep][:, [1, 2]].sum(axis=0)
    called = np.bincount(old[keep].argmax(1), minlength=4)[[1, 2]]
    # evidence against a class: the base model called a labelled building so (wrongly)
    rho = np.where(called >= UNLABELLED_MIN_EVIDENCE, 1.0 / (1.0 + expected), 1.0)
    assert (rho < 1).any()
    assert result.block["method"].endswith("+discount")
    got = result.block["unlabelled_discount"]
    np.testing.assert_allclose([got["minor-damage"], got["major-damage"]], rho, rtol=1e-4)
    new = Predictor(out).predict(store.pre, store.post).probabilities
    np.testing.assert_allclose(new[:, [1, 2]], old[:, [1, 2]] * rho, atol=1e-5)
    np.testing.assert_allclose(new.sum(1), 1.0, atol=1e-5)
    assert "discounted" in format_adaptation(result.block)
    assert "A / (A + e)" in result.block["unlabelled_rule"]


def test_a_class_the_base_model_never_expects_keeps_its_probability():
    """Head arithmetic: labels on buildings where the base model gives class 2 almost nothing
    leave p(2) as it was elsewhere (rho near 1); labels on buildings it called 2 shrink it."""
    from app.adapt.fit import BaseModel, adapt_head
    from runtime.head import log_softmax

    rng = np.random.default_rng(3)
    z = rng.normal(size=(40, 8))
    y = rng.choice([0, 1, 3], size=40)
    raw = rng.normal(size=(40, 4))
    raw[:, 2] -= 20.0  # the base model never says 2 on these
    quiet = adapt_head(raw, z, y, BaseModel(4), methods=("logistic",)).head
    assert quiet.discount[2] == pytest.approx(1.0, abs=1e-6)
    raw[:, 2] += 40.0  # now it says 2 on every one of them, and every label disagrees
    loud = adapt_head(raw, z, y, BaseModel(4), methods=("logistic",)).head
    assert loud.discount[2] == pytest.approx(1.0 / 41.0, rel=1e-3)
    region = rng.normal(size=(50, 4))
    region[:, 2] += 4.0
    p_base = np.exp(log_softmax(region))
    zr = rng.normal(size=(50, 8))
    np.testing.assert_allclose(np.exp(quiet.log_probabilities(region, zr))[:, 2], p_base[:, 2])
    np.testing.assert_allclose(
        np.exp(loud.log_probabilities(region, zr))[:, 2], p_base[:, 2] / 41.0, rtol=1e-3
    )


def test_the_discount_prior_weight_is_read_when_called(monkeypatch):
    """``rho = A / (A + e)``: 40 labels all expected in class 2 give 1/41 with ``A`` = 1, and a
    study that sets the module's ``A`` to 5 gets 5/45 from the same call."""
    import app.adapt.fit as fit

    raw = np.zeros((40, 4))
    raw[:, 2] = 30.0
    assert fit.unlabelled_discount(raw, [0, 1], 4)[2] == pytest.approx(1.0 / 41.0, rel=1e-6)
    monkeypatch.setattr(fit, "UNLABELLED_PSEUDO_COUNT", 5.0)
    rho = fit.unlabelled_discount(raw, [0, 1], 4)
    assert rho[2] == pytest.approx(5.0 / 45.0, rel=1e-6)
    assert rho[0] == rho[1] == rho[3] == 1.0  # labelled, or never called: untouched
    assert fit.unlabelled_discount(raw, [0, 1], 4, pseudo_count=2.0)[2] == pytest.approx(2 / 42)


def test_an_unlabelled_class_region_keeps_its_grade():
    """Pure head arithmetic on inputs where the base model says class 2 with p > 0.5: the
    adapted argmax stays 2 and p(2) is unchanged, whatever the head does to classes 0, 1, 3."""
    from app.adapt.fit import BaseModel, adapt_head
    from runtime.head import log_softmax

    rng = np.random.default_rng(0)
    z = rng.normal(size=(60, 8))
    y = rng.choice([0, 1, 3], size=60)
    raw = rng.normal(size=(60, 4))
    ad = adapt_head(raw, z, y, BaseModel(4, 0.7), methods=("logistic",), unlabelled="keep")
    assert ad.head.classes == [0, 1, 3]
    region = rng.normal(size=(200, 4))
    region[:, 2] += 4.0
    p_base = np.exp(log_softmax(region / 0.7))
    inside = p_base[:, 2] > 0.5
    assert inside.sum() > 100
    p_new = np.exp(ad.head.log_probabilities(region, rng.normal(size=(200, 8))))
    np.testing.assert_allclose(p_new[:, 2], p_base[:, 2], atol=1e-12)
    assert (p_new[inside].argmax(1) == 2).all()


def test_single_class_labels_are_refused_when_kept_and_discount_otherwise():
    from app.adapt.fit import AdaptError, BaseModel, adapt_head

    raw = np.zeros((5, 4))
    with pytest.raises(AdaptError, match="at least two classes"):
        adapt_head(raw, np.ones((5, 3)), np.zeros(5, int), BaseModel(4), unlabelled="keep")
    with pytest.raises(AdaptError, match="at least two labels"):
        adapt_head(raw[:1], np.ones((1, 3)), np.zeros(1, int), BaseModel(4))
    with pytest.raises(AdaptError, match="unknown rule 'drop'.*discount, keep"):
        adapt_head(raw, np.ones((5, 3)), np.arange(5) % 2, BaseModel(4), unlabelled="drop")
    # the base model already calls all 5 no-damage: no evidence against any class, base kept
    one = adapt_head(raw, np.ones((5, 3)), np.zeros(5, int), BaseModel(4))
    assert one.head.method == "base" and set(one.cv["candidates"]) == {"base"}
    np.testing.assert_allclose(one.head.discount, 1.0)
    # it calls all 5 minor damage, and each is no-damage: minor damage discounted, by the
    # cross-validation's choice (leave-one-out: 4 wrong calls in every fold)
    raw[:, 1] = 2.0
    one = adapt_head(raw, np.ones((5, 3)), np.zeros(5, int), BaseModel(4))
    assert one.head.method == "base+discount", one.cv["candidates"]
    assert set(one.cv["candidates"]) == {"base", "base+discount"}
    p1 = np.exp(2.0) / (np.exp(2.0) + 3)
    np.testing.assert_allclose(one.head.discount, [1.0, 1 / (1 + 5 * p1), 1.0, 1.0])
    p = np.exp(one.head.log_probabilities(raw, np.ones((5, 3))))
    np.testing.assert_allclose(p[:, 1], p1 / (1 + 5 * p1))
    np.testing.assert_allclose(p.sum(1), 1.0)
    assert (p.argmax(1) == 0).all()


def test_a_thousand_labels_use_stratified_k_fold():
    """1,000 labels of 128-d embeddings: stratified 5-fold of every head, then the final fit
    (the fit time is printed by the command and measured in docs/adapt.md, not asserted)."""
    from app.adapt.fit import BaseModel, adapt_head
    from runtime.head import unit

    rng = np.random.default_rng(1)
    y = rng.integers(0, 4, 1000)
    z = unit(np.eye(4, 128)[y] + 0.2 * rng.normal(size=(1000, 128)))
    raw = rng.normal(size=(1000, 4))
    ad = adapt_head(raw, z, y, BaseModel(4))
    assert ad.cv["scheme"].startswith("stratified")
    assert ad.cv["candidates"][ad.head.method]["accuracy"] > 0.9


# --------------------------------------------------------------------------------------------
# the choice of head when the labels add nothing


def _labels_from_the_base(raw: np.ndarray, temperature: float, seed: int) -> np.ndarray:
    """One label per building drawn from the base model's own calibrated probabilities: labels
    that say nothing the base model does not already say."""
    from runtime.head import log_softmax

    rng = np.random.default_rng(seed)
    p = np.exp(log_softmax(raw / temperature))
    return (rng.random((len(p), 1)) > np.cumsum(p, axis=1)).sum(axis=1)


@pytest.mark.parametrize("n", [20, 120])  # leave-one-out, and k-fold
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_labels_that_add_nothing_keep_the_base_model(n, seed):
    """Labels drawn from the base model's own probabilities, embeddings of pure noise: no head
    can know more than the base model, and ``base`` is chosen (measured: the next best head's
    cross-validated NLL is 0.29-1.3 nats higher on these draws)."""
    from app.adapt.fit import BaseModel, adapt_head
    from runtime.head import unit

    rng = np.random.default_rng(100 + seed)
    raw = rng.normal(0.0, 2.0, (n, 4))
    z = unit(rng.normal(size=(n, 16)))
    y = _labels_from_the_base(raw, 1.5, seed)
    assert len(set(y.tolist())) >= 2
    ad = adapt_head(raw, z, y, BaseModel(4, 1.5))
    assert ad.head.method == "base", ad.cv["candidates"]
    candidates = ad.cv["candidates"]
    assert set(candidates) == {"base", "prototype", "logistic", "logistic+prior"}
    assert all(v["nll"] > candidates["base"]["nll"] for m, v in candidates.items() if m != "base")


@pytest.mark.parametrize("unlabelled", ["discount", "keep"])
def test_labels_that_add_nothing_and_miss_a_class_keep_the_base_model(unlabelled):
    """The same with a class (2) the base model almost never says, so no label has it: ``base``
    is chosen, and its probabilities are the base model's, class 2 kept exactly under either rule
    (the base model hardly ever calls it, so the labels are no evidence against it)."""
    from app.adapt.fit import UNLABELLED_MIN_EVIDENCE, BaseModel, adapt_head
    from runtime.head import log_softmax, unit

    rng = np.random.default_rng(7)
    raw = rng.normal(0.0, 2.0, (60, 4))
    raw[:, 2] -= 6.0
    z = unit(rng.normal(size=(60, 16)))
    y = _labels_from_the_base(raw, 1.5, 7)
    assert 2 not in y and len(set(y.tolist())) == 3
    ad = adapt_head(raw, z, y, BaseModel(4, 1.5), unlabelled=unlabelled)
    assert ad.head.method == "base", ad.cv["candidates"]
    assert ad.head.classes == [0, 1, 3]
    base_p = np.exp(log_softmax(raw / 1.5))
    # the base model calls 2 on fewer than 4 of the labels: no evidence against it, kept
    assert (base_p.argmax(1) == 2).sum() < UNLABELLED_MIN_EVIDENCE
    assert base_p[:, 2].sum() > 0.5  # the old rule would have discounted it
    rho = 1.0
    # new buildings, some of which the base model calls 2
    region = rng.normal(0.0, 2.0, (200, 4))
    region[:100, 2] += 6.0
    p_base = np.exp(log_softmax(region / 1.5))
    p = np.exp(ad.head.log_probabilities(region, unit(rng.normal(size=(200, 16)))))
    np.testing.assert_allclose(p[:, 2], rho * p_base[:, 2], rtol=1e-9, atol=1e-12)
    rest = (1 - rho * p_base[:, 2]) / (1 - p_base[:, 2])
    np.testing.assert_allclose(p[:, [0, 1, 3]], p_base[:, [0, 1, 3]] * rest[:, None], atol=1e-9)
    np.testing.assert_allclose(p, p_base, atol=1e-9)


def test_labels_from_the_model_itself_keep_it(base, store, tmp_path):
    """Through the model file: labels drawn from the calibrated base model's own probabilities on
    the store's 32 chips leave it as it is (``base`` chosen; every class labelled, so the adapted
    probabilities are the base model's). Measured on 12 draws: ``base`` chosen on each, the next
    best head 0.05-0.21 nats behind (0.15 on this one)."""
    from app.adapt.labelled import Buildings
    from app.adapt.model import adapt_model
    from runtime.predictor import Predictor

    predictor = Predictor(base)
    old = predictor.predict(store.pre, store.post)
    y = _labels_from_the_base(old.raw_logits, predictor.temperature, 0)
    assert set(y.tolist()) == {0, 1, 2, 3}
    drawn = Buildings(store.ids, store.events, y, store.pre, store.post)
    result = adapt_model(predictor, drawn, tmp_path / "same.onnx")
    assert result.block["method"] == "base", result.block["cv"]["candidates"]
    new = Predictor(tmp_path / "same.onnx").predict(store.pre, store.post)
    np.testing.assert_allclose(new.probabilities, old.probabilities, atol=1e-5)
    assert result.block["method"] == "base", result.block["cv"]["candidates"]


# --------------------------------------------------------------------------------------------
# labels from the scoring path and from the app's corrections


def test_adapted_model_scores_a_tile_and_flags(adapted, score_model, tmp_path):
    from app.scoring.common import ScoreOptions
    from app.scoring.xbd import score_xbd
    from runtime.flags import Flagger
    from runtime.predictor import Predictor

    xbd = score_model.parent / "xbd"
    label = sorted((xbd / "labels").glob("*_post_disaster.json"))[0]
    tile = label.name.replace("_post_disaster.json", "")
    pre = next((xbd / "images").glob(f"{tile}_pre_disaster.*"))
    post = next((xbd / "images").glob(f"{tile}_post_disaster.*"))
    predictor = Predictor(adapted)
    assert Flagger(predictor.metadata).ood is not None
    out = tmp_path / "scored.geojson"
    report = score_xbd(predictor, pre, post, label, out, options=ScoreOptions(progress=False))
    assert report.scored > 0
    data = json.loads(out.read_text())
    scored = [f["properties"] for f in data["features"] if f["properties"]["status"] == "scored"]
    total = [sum(v for k, v in p.items() if k.startswith("p_")) for p in scored]
    np.testing.assert_allclose(total, 1.0, atol=1e-4)
    assert all("flags" in p for p in scored)


@pytest.mark.slow
def test_adapt_from_xbd_labels_and_from_app_corrections(base, score_model, tmp_path, capsys):
    from app.adapt.corrections import from_corrections
    from app.adapt.labelled import concat, from_xbd
    from app.adapt.model import adapt_model
    from app.web.app import assess_tile, save_correction
    from runtime.predictor import Predictor

    predictor = Predictor(base)
    xbd = score_model.parent / "xbd"
    labels = sorted((xbd / "labels").glob("*_post_disaster.json"))
    parts = []
    for label in labels[:2]:
        tile = label.name.replace("_post_disaster.json", "")
        pre = next((xbd / "images").glob(f"{tile}_pre_disaster.*"))
        post = next((xbd / "images").glob(f"{tile}_post_disaster.*"))
        parts.append(from_xbd(pre, post, label, predictor.spec, predictor.class_names))
    assert all((p.labels >= 0).sum() > 5 for p in parts)  # un-classified ones are -1

    # the app: assess the third tile, correct three buildings, read the corrections back
    label = labels[2]
    tile = label.name.replace("_post_disaster.json", "")
    pre = next((xbd / "images").glob(f"{tile}_pre_disaster.*"))
    post = next((xbd / "images").glob(f"{tile}_post_disaster.*"))
    result = assess_tile(predictor, pre, post, label, tmp_path / "session")
    scored = [r["#"] for r in result.rows if r["status"] == "scored"][:3]
    for row, grade in zip(scored, ["destroyed", "no-damage", "destroyed"], strict=True):
        path = save_correction(result.session, row, grade)
    fixed = from_corrections(path, predictor.spec, predictor.class_names)
    assert len(fixed) == 3
    assert sorted(fixed.labels.tolist()) == [0, 3, 3]
    assert [i.split(":", 1)[1] for i in fixed.ids] == [result.rows[r]["uid"] for r in scored]

    # the whole tile for --suggest: the corrected buildings labelled, the others the pool
    from app.adapt.corrections import from_session
    from app.adapt.suggest import suggest

    tile_all = from_session(result.session, predictor.spec, predictor.class_names)
    assert len(tile_all) == sum(r["status"] == "scored" for r in result.rows)
    assert sorted(tile_all.labels[tile_all.labels >= 0].tolist()) == [0, 3, 3]
    picks = [r.key for r in suggest(predictor, tile_all, 4)]
    assert len(set(picks)) == 4 and not set(picks) & set(fixed.ids)

    # the command: an assessment without corrections is reported and left out
    empty = tmp_path / "empty-session"
    empty.mkdir()
    (empty / "session.json").write_text(json.dumps({"mode": "xbd", "scene": "t"}))
    args = ["adapt", "--model", base, "--corrections", result.session, empty]
    assert run_cli(*args, "--out", tmp_path / "fixed.onnx") == 0
    err = capsys.readouterr().err
    assert f"warning: left out: {empty}: no corrections saved" in err
    assert "on 3 labels" in err

    out = adapt_model(predictor, concat([*parts, fixed], 64), tmp_path / "mixed.onnx")
    assert out.block["labels"]["n"] == sum(int((p.labels >= 0).sum()) for p in parts) + 3
    assert any("app corrections" in s for s in out.block["labels"]["sources"])
    assert Predictor(out.out).head is not None


# --------------------------------------------------------------------------------------------
# bad label files


def _fails(capsys, *argv) -> str:
    assert run_cli("adapt", *argv) == 2
    return capsys.readouterr().err


def test_bad_label_inputs_name_the_file_and_the_problem(
    base, chips, score_model, synthetic_scene, tmp_path, capsys
):
    out = tmp_path / "x.onnx"
    common = ["--model", base, "--out", out]
    scene = ["--pre", *synthetic_scene.pre, "--post", *synthetic_scene.post]

    missing = tmp_path / "nowhere.geojson"
    err = _fails(capsys, *common, *scene, "--buildings", missing, "--label-field", "damage")
    assert str(missing) in err and "not found" in err

    err = _fails(
        capsys, *common, *scene, "--buildings", synthetic_scene.buildings, "--label-field", "grade"
    )
    assert str(synthetic_scene.buildings) in err and "'grade'" in err

    data = json.loads(synthetic_scene.buildings.read_text())
    data["features"][0]["properties"]["damage"] = "flattened"
    bad = tmp_path / "bad.geojson"
    bad.write_text(json.dumps(data))
    err = _fails(capsys, *common, *scene, "--buildings", bad, "--label-field", "damage")
    assert str(bad) in err and "flattened" in err

    for f in data["features"]:
        f["properties"]["damage"] = ""
    empty = tmp_path / "empty.geojson"
    empty.write_text(json.dumps(data))
    err = _fails(capsys, *common, *scene, "--buildings", empty, "--label-field", "damage")
    assert str(empty) in err and "no labelled building" in err

    xbd = score_model.parent / "xbd"
    label = sorted((xbd / "labels").glob("*_post_disaster.json"))[0]
    tile = label.name.replace("_post_disaster.json", "")
    data = json.loads(label.read_text())
    data["features"]["xy"][0]["properties"]["subtype"] = "flattened"
    bad_xbd = tmp_path / label.name
    bad_xbd.write_text(json.dumps(data))
    pair = [
        "--pre",
        next((xbd / "images").glob(f"{tile}_pre_disaster.*")),
        "--post",
        next((xbd / "images").glob(f"{tile}_post_disaster.*")),
    ]
    err = _fails(capsys, *common, *pair, "--labels", bad_xbd)
    assert str(bad_xbd) in err and "flattened" in err
    err = _fails(capsys, *common, *pair, "--labels", tmp_path / "none.json")
    assert str(tmp_path / "none.json") in err and "not found" in err

    err = _fails(capsys, *common, "--chips", tmp_path / "nostore")
    assert "manifest.csv" in err and "nostore" in err
    store = tmp_path / "store"
    shutil.copytree(chips, store)
    manifest = (store / "manifest.csv").read_text().splitlines()
    header = manifest[0].split(",")
    j = header.index("label")
    (store / "manifest.csv").write_text(
        "\n".join(",".join(c for i, c in enumerate(r.split(",")) if i != j) for r in manifest)
    )
    err = _fails(capsys, *common, "--chips", store)
    assert str(store / "manifest.csv") in err and "missing column(s) label" in err

    assert not out.exists()


def test_bad_corrections_name_the_file(base, tmp_path, capsys):
    session = tmp_path / "session"
    session.mkdir()
    err = _fails(capsys, "--model", base, "--out", tmp_path / "x.onnx", "--corrections", session)
    assert str(session) in err and "session.json" in err
    (session / "session.json").write_text(json.dumps({"mode": "xbd", "scene": "t"}))
    err = _fails(capsys, "--model", base, "--out", tmp_path / "x.onnx", "--corrections", session)
    assert str(session) in err and "no corrections" in err
    (session / "corrections.json").write_text(json.dumps({"3": {"uid": "a", "damage": "gone"}}))
    err = _fails(capsys, "--model", base, "--out", tmp_path / "x.onnx", "--corrections", session)
    assert str(session / "corrections.json") in err and "'gone'" in err and "row 3" in err


# --------------------------------------------------------------------------------------------
# what to label next


def test_rank_by_uncertainty_puts_the_most_uncertain_first_and_spreads_the_rest():
    from app.adapt.suggest import rank_buildings

    p = np.array(
        [[0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0], [0.55, 0.45, 0, 0], [0.9, 0.1, 0, 0], [1, 0, 0, 0]]
    )
    z = np.array([[1, 0], [1, 1e-4], [0, 1], [-1, 0], [0, -1]], dtype=float)
    order, dist = rank_buildings(p, z, 3, typical=0.0, uncertain=1.0)
    assert order[0] in (0, 1)
    assert order[1] == 2  # not the near-duplicate of the first pick
    assert len(set(order.tolist())) == 3
    plain, _ = rank_buildings(p, z, 5, diversity=0.0, typical=0.0, uncertain=1.0)
    margins = np.sort(p, 1)[:, -1] - np.sort(p, 1)[:, -2]
    assert np.all(np.diff(margins[plain]) >= 0)  # diversity 0: by margin alone


def test_rank_takes_typical_buildings_of_each_cluster_biggest_first():
    """Three clusters of 60, 30 and 10 buildings plus 5 outliers: the default ranking starts with
    a central building of the big cluster, then one of each other cluster, before any outlier or
    second building of a cluster."""
    from app.adapt.suggest import rank_buildings, typicality

    rng = np.random.default_rng(0)
    centres = np.eye(3, 16)
    sizes = (60, 30, 10)
    z = np.vstack(
        [c + 0.05 * rng.normal(size=(n, 16)) for c, n in zip(centres, sizes, strict=True)]
        + [rng.normal(size=(5, 16))]
    )
    cluster = np.repeat([0, 1, 2, 3], (*sizes, 5))
    p = np.full((len(z), 4), 0.25)
    order, _ = rank_buildings(p, z, 3)
    assert cluster[order].tolist() == [0, 1, 2]
    t = typicality(z)
    assert t.max() == 1.0 and t[cluster == 3].max() < t[cluster == 0].min()
    first = order[0]
    spread = np.linalg.norm(z[cluster == 0] - z[cluster == 0].mean(0), axis=1)
    assert np.linalg.norm(z[first] - z[cluster == 0].mean(0)) <= np.median(spread)


def test_suggestions_draw_at_random_before_adapting_then_mix_in_the_uncertain():
    """A model not adapted to the event gets the random order's first picks; an adapted one gets
    its most uncertain buildings and the random order's in turn, never one building twice."""
    from app.adapt.suggest import id_order, interleave, rank_buildings, suggestion_order

    rng = np.random.default_rng(1)
    z = rng.normal(size=(30, 12))
    p = rng.dirichlet(np.ones(4), size=30)
    order = rng.permutation(30)
    first, dist = suggestion_order(p, z, 7, order=order)
    assert first.tolist() == order[:7].tolist()
    assert dist[0] == 1.0 and np.all(dist[1:] > 0)
    mixed, _ = suggestion_order(p, z, 8, adapted=True, order=order)
    unsure, _ = rank_buildings(p, z, 8, uncertain=1.0)
    assert len(set(mixed.tolist())) == 8
    # every prefix is half random (rounded up), half uncertain: random, uncertain, random, ...
    assert mixed[0] == order[0] and mixed[2] in order[:3]
    assert mixed[1] in unsure[:2] and mixed[3] in unsure[:4]
    assert suggestion_order(p, z, 8, adapted=True, order=order, share=0.0)[0].tolist() == (
        unsure.tolist()
    )
    assert suggestion_order(p, z, 8, adapted=True, order=order, share=1.0)[0].tolist() == (
        order[:8].tolist()
    )
    with pytest.raises(ValueError, match="permutation"):
        suggestion_order(p, z, 3, order=[0, 0, 1])
    # a queue that runs out hands over to the other; shares other than a half spread evenly
    assert interleave([1, 2], [3, 4, 5, 6], 5, 0.5) == [3, 1, 4, 2, 5]
    assert interleave([1, 2, 3, 4], [5, 6, 7, 8], 8, 0.25) == [5, 1, 2, 3, 6, 4, 7, 8]
    assert interleave([1, 2], [2, 1], 3, 0.5) == [2, 1]
    # the order of ids is a fixed shuffle: labelling some leaves the others' order as it was
    ids = [f"tile:{i}" for i in range(40)]
    every = id_order(ids)
    assert sorted(every.tolist()) == list(range(40)) and every.tolist() != list(range(40))
    kept = [ids[i] for i in range(40) if i % 3]
    assert [kept[i] for i in id_order(kept)] == [ids[i] for i in every if i % 3]


@pytest.mark.slow
def test_suggest_returns_distinct_unlabelled_ids(adapted, chips, store, tmp_path, capsys):
    from app.adapt.labelled import Buildings
    from app.adapt.suggest import id_order, suggest, suggestion_order
    from runtime.predictor import Predictor

    hidden = np.arange(len(store)) % 2 == 0
    pool = Buildings(
        store.ids, store.events, np.where(hidden, -1, store.labels), store.pre, store.post
    )
    predictor = Predictor(adapted)
    rows = suggest(predictor, pool, 5)
    ids = [r.id for r in rows]
    unlabelled = {i for i, h in zip(store.ids, hidden, strict=True) if h}
    assert len(ids) == 5 == len(set(ids)) and set(ids) <= unlabelled
    # the ranking of the unlabelled buildings' outputs, kept away from the labelled ones
    mine = predictor.predict(pool.pre[hidden], pool.post[hidden])
    seen = predictor.predict(pool.pre[~hidden], pool.post[~hidden]).embedding
    assert predictor.head is not None  # adapted: its hesitation counts
    hidden_ids = np.asarray(store.ids)[hidden]
    order, dist = suggestion_order(
        mine.probabilities, mine.embedding, 5, seen, adapted=True, order=id_order(hidden_ids)
    )
    assert ids == [hidden_ids[i] for i in order]
    np.testing.assert_allclose([r.distance for r in rows], dist, atol=1e-5)
    assert min(dist) > 0  # no pick duplicates a labelled building or an earlier pick

    csv_path = tmp_path / "next.csv"
    # every chip of the store is labelled: the command says so
    err = _fails(capsys, "--model", adapted, "--chips", chips, "--suggest", "3")
    assert "every building is labelled" in err
    store_copy = tmp_path / "store"
    shutil.copytree(chips, store_copy)
    import pandas as pd

    frame = pd.read_csv(store_copy / "manifest.csv", dtype=str, keep_default_na=False)
    frame.loc[frame.index % 2 == 0, ["label", "label_name"]] = ["-1", ""]
    frame.to_csv(store_copy / "manifest.csv", index=False)
    args = ["adapt", "--model", adapted, "--chips", store_copy, "--out", tmp_path / "a.onnx"]
    assert run_cli(*args, "--suggest", "4", "--suggest-out", csv_path) == 0
    ranked = pd.read_csv(csv_path, dtype={"id": str})
    assert ranked["rank"].tolist() == [1, 2, 3, 4]
    assert ranked["id"].is_unique
    assert set(ranked["id"]) <= set(frame.loc[frame.index % 2 == 0, "chip_id"])
    assert "fit:" in capsys.readouterr().err


@pytest.mark.slow
def test_adapt_and_suggest_on_a_georeferenced_scene(base, synthetic_scene, tmp_path, capsys):
    import io

    import pandas as pd

    s = synthetic_scene
    scene = ["--pre", *s.pre, "--post", *s.post, "--buildings", s.buildings]
    out = tmp_path / "scene.onnx"
    assert (
        run_cli(
            "adapt",
            "--model",
            base,
            *scene,
            "--label-field",
            s.label_field,
            "--out",
            out,
            "--event",
            "test-event",
            "--json",
        )
        == 0
    )
    block = json.loads(capsys.readouterr().out)
    assert block["labels"]["n"] == s.covered
    assert {k: v for k, v in block["labels"]["per_class"].items() if v} == {
        k: v for k, v in s.per_class.items() if v
    }
    assert block["labels"]["events"] == {"test-event": s.covered}
    # without --label-field every building is a candidate; ids are the footprints' own uids
    assert run_cli("adapt", "--model", out, *scene, "--suggest", "4") == 0
    printed = capsys.readouterr().out
    ranked = pd.read_csv(io.StringIO(printed), dtype={"id": str})
    assert len(ranked) == 4 and ranked["id"].is_unique
    assert set(ranked["id"]) <= set(s.covered_uids)


def test_georeferenced_corrections_are_read_from_the_tile(base, synthetic_scene, tmp_path):
    from app.adapt.corrections import from_corrections, from_session
    from app.web.app import assess_tile, save_correction
    from runtime.predictor import Predictor

    s = synthetic_scene
    predictor = Predictor(base)
    result = assess_tile(predictor, s.pre[0], s.post[0], s.buildings, tmp_path / "s")
    rows = [r["#"] for r in result.rows if r["status"] == "scored"][:2]
    save_correction(result.session, rows[0], "major-damage")
    save_correction(result.session, rows[1], "no-damage")
    got = from_corrections(
        result.session / "corrections.json", predictor.spec, predictor.class_names
    )
    assert sorted(got.labels.tolist()) == [0, 2]
    assert {i.split(":", 1)[1] for i in got.ids} == {result.rows[r]["uid"] for r in rows}
    tile_all = from_session(result.session, predictor.spec, predictor.class_names)
    assert sorted(tile_all.labels[tile_all.labels >= 0].tolist()) == [0, 2]
    assert len(tile_all) == sum(r["status"] == "scored" for r in result.rows)


@pytest.mark.slow
def test_adapt_runs_without_torch(base, chips, tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO

    out = tmp_path / "m.onnx"
    code = (
        "import sys\n"
        "from cli.main import main\n"
        f"rc = main(['adapt', '--model', {str(base)!r}, '--chips', {str(chips)!r}, "
        f"'--out', {str(out)!r}])\n"
        "assert rc == 0, rc\n"
        "assert 'torch' not in sys.modules, 'adapt imported torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "fit: " in done.stderr and out.is_file()


def test_predictor_rejects_a_broken_head(adapted, tmp_path):
    import onnx

    from runtime.contract import ModelError
    from runtime.predictor import Predictor

    proto = onnx.load(str(adapted))
    for prop in proto.metadata_props:
        if prop.key == "adaptation":
            block = json.loads(prop.value)
            block["head"]["class_ids"] = [0, 9]
            prop.value = json.dumps(block)
    broken = tmp_path / "broken.onnx"
    onnx.save(proto, str(broken))
    with pytest.raises(ModelError, match=r"broken\.onnx: metadata adaptation: class_ids"):
        Predictor(broken)


def test_candidates_are_judged_on_the_grades_of_the_models_own_rule():
    """A base model with a false-alarm cost (its grade_rule) has its candidates' accuracy,
    macro-F1 and intact recall computed on the grades that rule gives, as the analyst sees
    them: intact buildings the base finds only slightly more likely minor damage are intact
    under cost 2 and damaged under cost 1."""
    from app.adapt.fit import BaseModel, adapt_head

    rng = np.random.default_rng(5)
    y = np.array([0] * 24 + [3] * 12)
    raw = np.zeros((len(y), 4))
    raw[y == 0, 1] = np.log(1.3)  # p(minor) = 1.3 p(no-damage): damaged at cost 1 only
    raw[y == 3, 3] = 5.0
    z = rng.normal(size=(len(y), 8))
    plain = adapt_head(raw, z, y, BaseModel(4), methods=("logistic",), unlabelled="keep")
    costly = adapt_head(
        raw, z, y, BaseModel(4, false_alarm_cost=2.0), methods=("logistic",), unlabelled="keep"
    )
    assert plain.train["base"]["intact_recall"] == 0.0
    assert plain.train["base"]["accuracy"] == pytest.approx(12 / 36)
    assert costly.train["base"]["intact_recall"] == 1.0
    assert costly.train["base"]["accuracy"] == 1.0
    assert costly.cv["candidates"]["base"]["macro_f1"] == 1.0
    assert plain.cv["candidates"]["base"]["macro_f1"] < 0.7


def test_grade_ids_is_grades_by_index():
    from runtime.grading import grade_ids, grades

    p = np.random.default_rng(2).dirichlet(np.ones(4), size=200)
    names = ["no-damage", "minor-damage", "major-damage", "destroyed"]
    for cost in (0.5, 1.0, 2.0, 5.0):
        np.testing.assert_array_equal(grade_ids(p, 0, cost), grades(p, names, cost))
    moved = ["minor-damage", "no-damage", "major-damage", "destroyed"]
    np.testing.assert_array_equal(
        grade_ids(p[:, [1, 0, 2, 3]], 1, 2.0), grades(p[:, [1, 0, 2, 3]], moved, 2.0)
    )


def test_base_model_carries_the_models_temperature_prototypes_and_grade_rule(base, tmp_path):
    """What `adapt` (and the studies replaying it) fit on: the calibrated fixture's temperature
    and ood prototypes, and the grade rule of its metadata (1 when it has none)."""
    import onnx

    from app.adapt.model import base_model
    from runtime.contract import save_onnx, set_metadata
    from runtime.predictor import Predictor

    plain = base_model(Predictor(base))
    md = Predictor(base).metadata
    assert plain.k == 4 and plain.false_alarm_cost == 1.0
    assert plain.temperature == pytest.approx(md["calibration"]["temperature"])
    names = list(Predictor(base).class_names)
    assert sorted(plain.prototypes) == sorted(names.index(n) for n in md["ood"]["class_names"])
    assert plain.prototypes  # the fixture's ood block has prototypes
    proto = onnx.load(str(base))
    set_metadata(proto, {"grade_rule": {"false_alarm_cost": 2.5}})
    ruled = base_model(Predictor(save_onnx(proto, tmp_path / "ruled.onnx")))
    assert ruled.false_alarm_cost == 2.5
    assert ruled.temperature == plain.temperature
