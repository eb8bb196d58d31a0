"""The web app's Adapt and Suggest, as functions: corrections of assessed tiles -> an adapted
model in the app's work folder, and the tile's uncorrected buildings ranked to correct next.

Real parts only: the tiny exported model of the ``score_model`` fixture run by ONNX Runtime,
the synthetic xBD tiles it was trained on (tiles 0 and 2 are of event ``synthetic-flood``,
tile 1 of ``synthetic-wildfire``), assessed and corrected by the app's own functions.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data_prep.spec import CLASS_NAMES


def _tile(score_model, index: int) -> tuple[Path, Path, Path]:
    from data_prep.synthetic import tile_name

    xbd = score_model.parent / "xbd"
    name = tile_name(index)
    label = xbd / "labels" / f"{name}_post_disaster.json"
    pre = next((xbd / "images").glob(f"{name}_pre_disaster.*"))
    post = next((xbd / "images").glob(f"{name}_post_disaster.*"))
    return pre, post, label


def _true_labels(label: Path) -> dict[str, str]:
    """uid -> the xBD subtype of every building of a label file."""
    features = json.loads(label.read_text())["features"]["xy"]
    return {f["properties"]["uid"]: f["properties"].get("subtype", "") for f in features}


def _assess(predictor, score_model, index: int, work: Path, n: int):
    from app.web.app import assess_tile

    pre, post, label = _tile(score_model, index)
    return assess_tile(predictor, pre, post, label, work / "sessions" / f"20260101-0000{n:02d}")


def _correct_all(result, label: Path, limit: int | None = None) -> dict[int, str]:
    """Save the true class of the scored buildings of an assessment (the first ``limit``)."""
    from app.web.app import save_correction

    truth = _true_labels(label)
    rows = [
        r["#"]
        for r in result.rows
        if r["status"] == "scored" and truth.get(r["uid"]) in CLASS_NAMES
    ][:limit]
    for row in rows:
        save_correction(result.session, row, truth[result.rows[row]["uid"]])
    return {row: truth[result.rows[row]["uid"]] for row in rows}


@pytest.mark.slow
def test_adapt_writes_an_offered_model_that_reproduces_the_corrections(
    predictor, score_model, tmp_path
):
    from app.web.adapt_panel import adapt_to_event, event_labels
    from app.web.app import assess_tile, model_choices
    from runtime.predictor import Predictor

    work = tmp_path / "work"
    result = _assess(predictor, score_model, 0, work, 1)
    corrected = _correct_all(result, _tile(score_model, 0)[2])
    assert len(set(corrected.values())) >= 2, "the tile needs buildings of two classes"

    done = adapt_to_event(predictor, work, result.session)
    assert done.model == work / "models" / "synthetic-flood-adapted-1.onnx"
    assert done.model.is_file() and not list((work / "models").glob(".*"))
    assert str(done.model.resolve()) in model_choices(tmp_path / "none", str(score_model), work)

    block = Predictor(done.model).metadata["adaptation"]
    assert block["labels"]["n"] == len(corrected)
    assert block["labels"]["per_class"] == {
        name: list(corrected.values()).count(name) for name in CLASS_NAMES
    }
    assert block["labels"]["events"] == {"synthetic-flood": len(corrected)}
    assert block["base_model"]["file"] == score_model.name
    assert any(str(result.session) in s for s in block["labels"]["sources"])
    status = done.status()
    r = block["recalibration"]
    assert f"{len(corrected)} corrected buildings of event **synthetic-flood**" in status
    assert f"head: **{block['method']}**" in status and "base model" in status
    assert "few corrections" in status  # fewer than 20
    assert ("probabilities recalibrated" in status) == r["kept"]
    assert ("probabilities kept as they were" in status) != r["kept"]
    base_row = block["cv"]["candidates"]["base"]
    # the log-loss a head must beat: the base model's recalibrated on the other folds
    assert f"recalibrated {base_row['nll_recalibrated']:.3f}: the one to beat" in status
    assert ("labels of 1 tile or scene only" in status) == (
        block["method"] != "base" and len(block["labels"]["tiles"]) == 1
    )

    # the adapted model grades the corrected buildings as corrected more often, and more surely
    labels = event_labels(predictor, work, "synthetic-flood").buildings
    y = labels.labels
    old = predictor.predict(labels.pre, labels.post).probabilities
    new = Predictor(done.model).predict(labels.pre, labels.post).probabilities

    def nll(p):
        return float(-np.log(np.clip(p[np.arange(len(y)), y], 1e-12, 1)).mean())

    # never worse: a head replaces the base model only when it beats it clearly on the
    # cross-validation of these few corrections; otherwise the base model is written as it was
    # (at the temperature recalibrated on the corrections, when one was kept)
    if block["method"] == "base":
        tempered = old ** (1.0 / (r["temperature"] if r["kept"] else 1.0))
        np.testing.assert_allclose(new, tempered / tempered.sum(1, keepdims=True), atol=1e-5)
        assert not any(c["clear"] for c in block["cv"]["candidates"].values())
    else:
        assert block["cv"]["candidates"][block["method"]]["clear"]
        assert nll(new) < nll(old)
    assert np.mean(new.argmax(1) == y) >= np.mean(old.argmax(1) == y)

    # the tile graded again with the adapted model: the new assessment records it
    again = assess_tile(
        Predictor(done.model), *_tile(score_model, 0), work / "sessions" / "20260101-000002"
    )
    assert json.loads((again.session / "session.json").read_text())["model"] == str(done.model)
    assert again.model == "synthetic-flood-adapted-1"
    # a second Adapt writes the next name, on the adapted model as base: its original base kept
    second = adapt_to_event(Predictor(done.model), work, result.session)
    assert second.model.name == "synthetic-flood-adapted-2.onnx"
    assert second.block["base_model"]["file"] == score_model.name


@pytest.mark.slow
def test_corrections_accumulate_over_an_event_and_count_once(predictor, score_model, tmp_path):
    from app.web.adapt_panel import adapt_to_event, event_labels, event_sessions
    from app.web.app import assess_tile, save_correction
    from app.web.sessions import carry_corrections, set_event

    work = tmp_path / "work"
    flood0 = _assess(predictor, score_model, 0, work, 1)
    wildfire = _assess(predictor, score_model, 1, work, 2)
    flood2 = _assess(predictor, score_model, 2, work, 3)
    a = _correct_all(flood0, _tile(score_model, 0)[2], 3)
    b = _correct_all(flood2, _tile(score_model, 2)[2], 4)
    _correct_all(wildfire, _tile(score_model, 1)[2], 5)

    assert event_sessions(work, "synthetic-flood") == [flood0.session, flood2.session]
    got = event_labels(predictor, work, "synthetic-flood")
    assert len(got.buildings) == len(a) + len(b)
    assert set(got.buildings.events) == {"synthetic-flood"}
    uids = {i.split(":", 1)[1] for i in got.buildings.ids}
    assert uids == {flood0.rows[r]["uid"] for r in a} | {flood2.rows[r]["uid"] for r in b}
    assert len(event_labels(predictor, work, "synthetic-wildfire").buildings) == 5

    # tile 0 graded again (as after Adapt): its corrections carried over, then one changed;
    # each building counts once, with its latest class
    again = assess_tile(predictor, *_tile(score_model, 0), work / "sessions" / "20260101-000004")
    assert carry_corrections(flood0.session, again.session) == len(a)
    row = next(iter(a))
    changed = next(c for c in CLASS_NAMES if c != a[row])
    save_correction(again.session, row, changed)
    got = event_labels(predictor, work, "synthetic-flood")
    assert len(got.buildings) == len(a) + len(b)
    i = [k.split(":", 1)[1] for k in got.buildings.ids].index(flood0.rows[row]["uid"])
    assert CLASS_NAMES[got.buildings.labels[i]] == changed

    # the analyst names the event: the wildfire tile's corrections join another event's
    set_event(wildfire.session, "my event")
    done = adapt_to_event(predictor, work, flood2.session, "my event")
    assert done.labels.event == "my_event" and done.model.name == "my_event-adapted-1.onnx"
    assert done.block["labels"]["n"] == len(b) + 5
    assert done.block["labels"]["events"] == {"my_event": len(b) + 5}
    assert event_sessions(work, "synthetic-wildfire") == []


def test_adapt_refuses_with_clear_messages_and_writes_nothing(predictor, score_model, tmp_path):
    from app.web.adapt_panel import adapt_to_event
    from app.web.app import AppError, save_correction

    work = tmp_path / "work"
    with pytest.raises(AppError, match="assess a tile first"):
        adapt_to_event(predictor, work, work / "sessions" / "none")
    result = _assess(predictor, score_model, 0, work, 1)
    with pytest.raises(AppError, match="no corrections saved for event synthetic-flood yet"):
        adapt_to_event(predictor, work, result.session)
    rows = [r["#"] for r in result.rows if r["status"] == "scored"][:2]
    save_correction(result.session, rows[0], "destroyed")
    with pytest.raises(AppError, match="has 1 correction: adapting needs at least two"):
        adapt_to_event(predictor, work, result.session)
    with pytest.raises(AppError, match="event name is empty"):
        from app.web.sessions import set_event

        set_event(result.session, "  ")
    assert not (work / "models").exists()
    # two corrections of one grade: no head to fit; the base model, or its discount of the
    # other grades when the base model called one of the two so, judged on the two labels
    save_correction(result.session, rows[1], "destroyed")
    done = adapt_to_event(predictor, work, result.session)
    assert done.block["method"] in ("base", "base+discount")
    assert set(done.block["cv"]["candidates"]) <= {"base", "base+discount"}
    assert set(done.block["unlabelled_classes"]) == {"no-damage", "minor-damage", "major-damage"}
    if done.block["method"] == "base+discount":
        assert "discounted" in done.status()
    assert done.model.is_file()


def test_suggest_ranks_only_uncorrected_buildings(predictor, score_model, tmp_path):
    from app.adapt.suggest import id_order
    from app.web.adapt_panel import suggest_next
    from app.web.app import AppError, save_correction

    work = tmp_path / "work"
    result = _assess(predictor, score_model, 0, work, 1)
    scored = [r["#"] for r in result.rows if r["status"] == "scored"]
    corrected = _correct_all(result, _tile(score_model, 0)[2], 3)
    rows = suggest_next(predictor, result.session, 5, work)
    assert [r["rank"] for r in rows] == [1, 2, 3, 4, 5]
    picked = [r["#"] for r in rows]
    assert len(set(picked)) == 5 and set(picked) <= set(scored) - set(corrected)
    for r in rows:
        assert r["uid"] == result.rows[r["#"]]["uid"]
        assert r["damage"] in CLASS_NAMES and 0 < r["confidence"] <= 1
    # the model is not adapted: the first of the uncorrected buildings' random order by id,
    # which correcting one of them leaves as it was for the others
    from app.adapt.corrections import from_session

    every = from_session(result.session, predictor.spec, predictor.class_names)
    pool = every.subset(~every.labelled)
    assert predictor.head is None
    order = id_order(pool.ids)[:5]
    assert [r["uid"] for r in rows] == [pool.ids[i].split(":")[-1] for i in order]
    save_correction(result.session, rows[0]["#"], "no-damage")
    again = suggest_next(predictor, result.session, 4, work)
    assert [r["uid"] for r in again] == [r["uid"] for r in rows[1:]]

    # everything corrected: nothing left to suggest
    for row in scored:
        save_correction(result.session, row, "no-damage")
    with pytest.raises(AppError, match="corrected already"):
        suggest_next(predictor, result.session, 5, work)


def test_adapt_and_suggest_on_a_georeferenced_tile(predictor, synthetic_scene, tmp_path):
    from app.web.adapt_panel import adapt_to_event, suggest_next
    from app.web.app import assess_tile, save_correction

    s = synthetic_scene
    work = tmp_path / "work"
    result = assess_tile(predictor, s.pre[0], s.post[0], s.buildings, work / "sessions" / "a")
    scored = [r["#"] for r in result.rows if r["status"] == "scored"]
    save_correction(result.session, scored[0], "destroyed")
    save_correction(result.session, scored[1], "no-damage")
    done = adapt_to_event(predictor, work, result.session, "scene flood")
    assert done.model.name == "scene_flood-adapted-1.onnx"
    assert done.block["labels"]["per_class"]["destroyed"] == 1
    assert done.block["labels"]["events"] == {"scene_flood": 2}
    rows = suggest_next(predictor, result.session, 3, work)
    assert len(rows) == 3 and not {r["#"] for r in rows} & set(scored[:2])
    assert {r["#"] for r in rows} <= set(scored)


def test_the_app_modules_import_no_torch():
    import subprocess
    import sys

    from tests.conftest import REPO

    code = (
        "import sys\n"
        "import app.web.app, app.web.adapt_panel, app.web.sessions, app.web.model_card\n"
        "from app.web.app import AppError, card_markdown, save_correction\n"
        "assert 'torch' not in sys.modules, 'the app imported torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
