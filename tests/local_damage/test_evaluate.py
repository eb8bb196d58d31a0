"""`local-damage evaluate`: metrics, predictions and figures of a tiny trained run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cli.main import main
from data_prep.spec import CLASS_NAMES, ChipSpec
from tests.conftest import REPO, TINY_TRAIN

#: A chip spec other than the default, so that cutting with the run's spec is observable.
SPEC = ChipSpec(chip_size=64, context=2.0, min_size=48)
TINY = [*TINY_TRAIN, "train.max_steps_per_epoch=2"]


@pytest.fixture(scope="module")
def store(synthetic_xbd, tmp_path_factory) -> Path:
    from data_prep.split import make_splits
    from data_prep.xbd import prepare_xbd

    out = tmp_path_factory.mktemp("eval_chips")
    prepare_xbd([synthetic_xbd], out, spec=SPEC, progress=False)
    make_splits(out, folds=3, seed=0, verbose=False)
    return out


@pytest.fixture(scope="module")
def run(store, tmp_path_factory) -> Path:
    from local_damage.config import load_yaml
    from local_damage.train.config import Config
    from local_damage.train.loaders import ChipSplit
    from local_damage.train.loop import train

    out = tmp_path_factory.mktemp("eval_run") / "run"
    train(load_yaml(Config, None, TINY), store, out, ChipSplit(fold=0), progress=False)
    return out


@pytest.fixture(scope="module")
def all_chips(run, store, tmp_path_factory) -> Path:
    """The run evaluated on every labelled chip of the store (views 1, no t-SNE), via the CLI."""
    out = tmp_path_factory.mktemp("eval_all")
    args = ["evaluate", "--run", str(run), "--chips", str(store), "--out", str(out)]
    assert main([*args, "--views", "1", "--no-tsne", "--quiet"]) == 0
    return out


def _fold_ids(store: Path, fold: int) -> set[str]:
    splits = pd.read_csv(store / "splits.csv", dtype={"chip_id": str})
    return set(splits.loc[splits["fold"] == fold, "chip_id"])


def _fold_tiles(store: Path, fold: int) -> list[str]:
    splits = pd.read_csv(store / "splits.csv", dtype={"tile": str})
    return sorted(set(splits.loc[splits["fold"] == fold, "tile"]))


def _manifest(store: Path) -> pd.DataFrame:
    return pd.read_csv(store / "manifest.csv", dtype={"chip_id": str}, keep_default_na=False)


def _predictions(out: Path) -> pd.DataFrame:
    return pd.read_csv(out / "predictions.csv", dtype={"chip_id": str})


@pytest.mark.slow
def test_evaluate_run_on_its_validation_fold(run, store, tmp_path, capsys):
    out = tmp_path / "eval"
    rc = main(
        ["evaluate", "--run", str(run), "--chips", str(store), "--fold", "0", "--out", str(out)]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    k = len(CLASS_NAMES)
    for key in ("accuracy", "macro_f1", "xview2_damage_f1", "per_class", "confusion_matrix", "n"):
        assert key in metrics
    assert metrics["class_names"] == list(CLASS_NAMES)
    assert set(metrics["per_class"]) == set(CLASS_NAMES)
    assert set(metrics["per_class"]["destroyed"]) == {"precision", "recall", "f1", "support"}
    cm = np.array(metrics["confusion_matrix"])
    assert cm.shape == (k, k)
    assert cm.sum() == metrics["n"]
    assert metrics["source"] == {
        "run": str(run),
        "chips": str(store),
        "fold": 0,
        "input_size": 32,
        "selection": f"fold 0 of {store / 'splits.csv'}",
        "unlabelled_left_out": 0,
        "tiles": _fold_tiles(store, 0),
    }
    # the validation fold holds none of the run's training tiles: nothing is marked
    assert metrics["training_data"]["known"] is True
    assert metrics["training_data"]["chips_in_training"] == 0
    assert "none of these" in printed and "*" not in printed

    # predictions.csv: one row per chip of the fold, consistent with metrics.json
    preds = _predictions(out)
    assert set(preds["chip_id"]) == _fold_ids(store, 0)
    assert len(preds) == metrics["n"]
    probs = preds[[f"p_{c}" for c in CLASS_NAMES]].to_numpy()
    assert np.allclose(probs.sum(axis=1), 1.0, atol=1e-4)
    assert (probs.argmax(axis=1) == preds["pred"].to_numpy()).all()
    labels = _manifest(store).set_index("chip_id").loc[preds["chip_id"], "label"].to_numpy()
    assert (preds["label"].to_numpy() == labels).all()
    assert metrics["accuracy"] == pytest.approx(float((preds["pred"] == preds["label"]).mean()))
    assert np.array_equal(cm.sum(axis=1), np.bincount(labels, minlength=k))
    assert np.array_equal(cm.sum(axis=0), np.bincount(preds["pred"], minlength=k))
    for c, name in enumerate(CLASS_NAMES):
        assert metrics["per_class"][name]["support"] == int((labels == c).sum())

    # per event: the manifest's events of the fold, each scored on its own chips only
    events = _manifest(store).set_index("chip_id").loc[preds["chip_id"], "event"].to_numpy()
    assert set(metrics["per_event"]) == set(events)
    assert sum(e["n"] for e in metrics["per_event"].values()) == metrics["n"]
    for event, block in metrics["per_event"].items():
        rows = events == event
        right = (preds["pred"].to_numpy() == labels)[rows]
        assert block["accuracy"] == pytest.approx(float(right.mean()))
        for c, name in enumerate(CLASS_NAMES):
            assert block["support"][name] == int((labels[rows] == c).sum())
            assert (block["per_class_f1"][name] is None) == (block["support"][name] == 0)

    # the run's own validation of the same weights on the same fold agrees
    summary = json.loads((run / "summary.json").read_text())
    assert metrics["macro_f1"] == pytest.approx(summary["best_val_macro_f1"], abs=1e-9)

    rep = metrics["representation"]
    for key in ("saa", "sad", "cac", "cad", "gpu", "class_mean_gram", "max_offdiag_abs_cos"):
        assert key in rep
    assert 0.0 <= rep["saa"] <= 1.0 and 0.0 <= rep["sad"] <= 2.0
    # no-damage chips of the synthetic data have identical pre and post: z = 0, left out
    n_no_damage = int((labels == 0).sum())
    assert rep["zero_embeddings_left_out"] >= n_no_damage
    assert rep["n"] == metrics["n"] - rep["zero_embeddings_left_out"]
    assert np.array(rep["class_mean_gram"], dtype=float).shape == (k, k)

    for figure in ("confusion_matrix.png", "tsne_z.png", "tsne_e_post.png"):
        assert (out / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", figure
    assert "macro-F1" in printed and "SAA" in printed and "destroyed" in printed


@pytest.mark.slow
def test_chips_on_training_tiles_are_marked(run, store, tmp_path, capsys):
    """Every chip of the store: the run trained on folds 1 and 2, so the rows are in-sample,
    marked, and the figures of fold 0 alone are given apart."""
    out = tmp_path / "all"
    args = ["evaluate", "--run", str(run), "--chips", str(store), "--out", str(out)]
    assert main([*args, "--views", "1", "--no-tsne", "--quiet"]) == 0
    printed = capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    block = metrics["training_data"]
    trained = sorted(set(_fold_tiles(store, 1) + _fold_tiles(store, 2)))
    assert block["tiles_in_training"] == trained
    in_training = len(_fold_ids(store, 1) | _fold_ids(store, 2))
    assert block["chips_in_training"] == in_training and block["n"] == metrics["n"]
    assert block["held_out"]["n"] == metrics["n"] - in_training
    rows = [line for line in printed.splitlines() if line.startswith(tuple(CLASS_NAMES))]
    assert len(rows) == len(CLASS_NAMES) and all(row.endswith(" *") for row in rows)
    assert f"in the model's training data: {in_training} of {metrics['n']} buildings" in printed
    held = metrics["training_data"]["held_out"]
    assert f"held-out tiles only ({held['n']} buildings" in printed
    # the held-out figures are those of evaluating fold 0 alone
    fold0 = tmp_path / "fold0"
    assert main([*args[:-2], "--fold", "0", "--out", str(fold0), "--views", "1", "--no-tsne"]) == 0
    alone = json.loads((fold0 / "metrics.json").read_text())
    assert held["accuracy"] == pytest.approx(alone["accuracy"])
    assert held["macro_f1"] == pytest.approx(alone["macro_f1"])


@pytest.mark.slow
def test_perfect_labels_score_exactly_one(all_chips, store, run, tmp_path):
    """Rewrite a copy of the store's labels to the model's own predictions: every score is 1."""
    preds = _predictions(all_chips)
    labelled = _manifest(store)
    assert set(preds["chip_id"]) == set(labelled.loc[labelled["label"] >= 0, "chip_id"])
    metrics = json.loads((all_chips / "metrics.json").read_text())
    assert metrics["source"]["fold"] is None
    assert "no --fold given" in metrics["source"]["selection"]
    assert "saa" not in metrics["representation"] and metrics["views"] == 1
    assert not (all_chips / "tsne_z.png").exists()

    copy = tmp_path / "chips"
    shutil.copytree(store, copy)
    manifest = _manifest(copy)
    pred_of = dict(zip(preds["chip_id"], preds["pred"], strict=True))
    manifest["label"] = [pred_of[c] for c in manifest["chip_id"]]
    manifest["label_name"] = [CLASS_NAMES[p] for p in manifest["label"]]
    manifest.to_csv(copy / "manifest.csv", index=False)
    out = tmp_path / "perfect"
    args = ["evaluate", "--run", str(run), "--chips", str(copy), "--out", str(out)]
    assert main([*args, "--views", "1", "--no-tsne", "--quiet"]) == 0
    perfect = json.loads((out / "metrics.json").read_text())
    cm = np.array(perfect["confusion_matrix"])
    predicted = np.bincount(preds["pred"], minlength=len(CLASS_NAMES))
    assert np.array_equal(cm, np.diag(predicted))
    assert perfect["accuracy"] == 1.0 and perfect["macro_f1"] == 1.0
    assert perfect["xview2_damage_f1"] == 1.0
    absent = [CLASS_NAMES[c] for c in range(len(CLASS_NAMES)) if predicted[c] == 0]
    assert perfect["absent_classes"] == absent


def test_second_view_is_augmented_and_seeded(run, store):
    from local_damage.evaluation.torch_scorer import TorchScorer, augmented_view
    from runtime.evaluation.chips import select_chips

    scorer = TorchScorer(run)
    ids, _, _ = select_chips(store, fold=1)
    first = scorer.score(store, ids, views=2, batch_size=4, seed=3)
    again = scorer.score(store, ids, views=2, batch_size=16, seed=3)
    assert first.z_view2.shape == first.z.shape == (len(ids), 16)
    assert np.allclose(first.z_view2, again.z_view2, atol=1e-5)  # seeded, batch-independent
    assert np.allclose(first.logits, again.logits, atol=1e-5)
    assert not np.allclose(first.z_view2, first.z, atol=1e-3)
    seed3, seed4 = (augmented_view(store, ids, 32, seed) for seed in (3, 4))
    assert any(not np.array_equal(seed3[i][1], seed4[i][1]) for i in range(len(ids)))
    assert first.chip_ids == [c for c in _manifest(store)["chip_id"] if c in set(ids)]
    assert first.e_post.shape == (len(ids), 16)


def test_xbd_cuts_with_the_runs_chip_spec(run, all_chips, synthetic_xbd, tmp_path):
    out = tmp_path / "xbd"
    args = ["evaluate", "--run", str(run), "--xbd", str(synthetic_xbd), "--out", str(out)]
    assert main([*args, "--views", "1", "--no-tsne", "--quiet"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["source"]["chip_spec"] == SPEC.to_dict()
    assert metrics["source"]["xbd"] == [str(synthetic_xbd)]
    assert any("invalid WKT" in s["reason"] for s in metrics["source"]["skipped"])
    # the same chips as the store cut with SPEC, so the same predictions
    got = _predictions(out).set_index("chip_id").sort_index()
    want = _predictions(all_chips).set_index("chip_id").sort_index()
    assert list(got.index) == list(want.index)
    assert (got["pred"] == want["pred"]).all()
    assert np.allclose(got.to_numpy(float), want.to_numpy(float), atol=1e-5)


def test_clear_errors(run, store, tmp_path, capsys):
    def error(*args: str) -> str:
        assert main(["evaluate", *args, "--out", str(tmp_path / "out")]) == 2
        return capsys.readouterr().err

    not_a_run = tmp_path / "empty_run"
    not_a_run.mkdir()
    assert "no config.yaml" in error("--run", str(not_a_run), "--chips", str(store))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(run / "config.yaml", no_weights / "config.yaml")
    err = error("--run", str(no_weights), "--chips", str(store))
    assert str(no_weights) in err and "best.safetensors" in err
    missing = tmp_path / "missing.onnx"
    err = error("--model", str(missing), "--chips", str(store))
    assert str(missing) in err and "not found" in err
    err = error("--run", str(run), "--chips", str(store), "--tta", "d8")
    assert "export the run" in err and "--model" in err

    unsplit = tmp_path / "unsplit"
    shutil.copytree(store, unsplit)
    (unsplit / "splits.csv").unlink()
    err = error("--run", str(run), "--chips", str(unsplit), "--fold", "0")
    assert "splits.csv" in err and "local-damage split" in err
    assert "no fold 7" in error("--run", str(run), "--chips", str(store), "--fold", "7")

    manifest = _manifest(unsplit)
    manifest["label"], manifest["label_name"] = -1, ""
    manifest.to_csv(unsplit / "manifest.csv", index=False)
    err = error("--run", str(run), "--chips", str(unsplit))
    assert str(unsplit) in err and "no labelled chips" in err
    assert "--fold applies to --chips" in error(
        "--run", str(run), "--xbd", str(store), "--fold", "0"
    )
    assert not (tmp_path / "out" / "metrics.json").exists()


@pytest.mark.slow
def test_an_onnx_model_on_one_view_is_evaluated_without_torch(score_model, chips, tmp_path):
    """Everything of `evaluate` but the second, augmented view runs on ONNX Runtime alone."""
    out = tmp_path / "eval"
    code = (
        "import sys\n"
        "from cli.main import main\n"
        f"rc = main(['evaluate', '--model', {str(score_model)!r}, '--chips', {str(chips)!r}, "
        f"'--views', '1', '--no-tsne', '--out', {str(out)!r}, '--quiet'])\n"
        "assert rc == 0, rc\n"
        "assert 'torch' not in sys.modules, 'evaluate imported torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "metrics.json").read_text())["views"] == 1


@pytest.mark.slow
def test_onnx_model_scores_like_the_run(run, store, synthetic_xbd, tmp_path):
    from data_prep.xbd import prepare_xbd
    from local_damage.evaluation.torch_scorer import TorchScorer, augmented_view
    from local_damage.export.model import export_run
    from runtime.evaluation.chips import select_chips
    from runtime.evaluation.scorers import EvaluationError, OnnxScorer

    model = tmp_path / "model.onnx"
    export_run(run, model)
    out = tmp_path / "onnx_eval"
    args = ["evaluate", "--model", str(model), "--chips", str(store), "--fold", "0"]
    assert main([*args, "--out", str(out), "--quiet"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["source"]["model"] == str(model) and metrics["source"]["fold"] == 0
    # the exported model lists the run's training tiles, so evaluate knows them too
    summary = json.loads((run / "summary.json").read_text())
    assert OnnxScorer(model).training_tiles.tiles == frozenset(summary["train_tiles"])
    assert metrics["training_data"]["known"] and metrics["training_data"]["chips_in_training"] == 0
    assert "saa" in metrics["representation"]
    preds = _predictions(out)
    assert set(preds["chip_id"]) == _fold_ids(store, 0)
    assert metrics["accuracy"] == pytest.approx(float((preds["pred"] == preds["label"]).mean()))
    assert (out / "tsne_z.png").is_file() and not (out / "tsne_e_post.png").exists()

    # chips stored at the model's input size reach both models unresized: same outputs
    small = tmp_path / "chips32"
    prepare_xbd([synthetic_xbd], small, spec=ChipSpec(32, SPEC.context, SPEC.min_size))
    ids, _, _ = select_chips(small)
    with pytest.raises(EvaluationError, match="second view needs the training augmentation"):
        OnnxScorer(model).score(small, ids, views=2)
    onnx = OnnxScorer(model, second_view=augmented_view).score(
        small, ids, views=2, batch_size=8, seed=1
    )
    torch = TorchScorer(run).score(small, ids, views=2, batch_size=8, seed=1)
    assert onnx.chip_ids == torch.chip_ids
    assert np.array_equal(onnx.labels, torch.labels)
    assert np.allclose(onnx.logits, torch.logits, atol=1e-3)
    assert np.allclose(onnx.z, torch.z, atol=1e-3)
    assert np.allclose(onnx.z_view2, torch.z_view2, atol=1e-3)
    assert onnx.e_post is None


@pytest.mark.slow
def test_evaluate_grades_under_the_false_alarm_cost_given(run, store, tmp_path):
    """`evaluate --false-alarm-cost C` computes its figures on the grades of that rule (the
    probabilities unchanged), records the rule and prints it; without it, the most probable."""
    from runtime.grading import grades

    args = ["evaluate", "--run", str(run), "--chips", str(store), "--fold", "0", "--views", "1"]
    plain, costly = tmp_path / "plain", tmp_path / "costly"
    assert main([*args, "--no-tsne", "--out", str(plain), "--quiet"]) == 0
    assert (
        main([*args, "--no-tsne", "--out", str(costly), "--quiet", "--false-alarm-cost", "3"]) == 0
    )
    a, b = _predictions(plain), _predictions(costly)
    cols = [f"p_{c}" for c in CLASS_NAMES]
    np.testing.assert_allclose(a[cols].to_numpy(), b[cols].to_numpy(), atol=1e-6)
    assert list(b["pred"]) == list(grades(b[cols].to_numpy(), CLASS_NAMES, 3.0))
    metrics = json.loads((costly / "metrics.json").read_text())
    assert metrics["grade_rule"]["false_alarm_cost"] == 3.0
    assert metrics["accuracy"] == pytest.approx(float((b["pred"] == b["label"]).mean()))
    assert json.loads((plain / "metrics.json").read_text())["grade_rule"]["false_alarm_cost"] == 1.0
    assert (a["pred"] != b["pred"]).any(), "the tiny run has no grade that cost 3 moves"
    with pytest.raises(SystemExit):  # argparse: the cost must be a positive number
        main([*args, "--out", str(tmp_path / "bad"), "--false-alarm-cost", "0"])
