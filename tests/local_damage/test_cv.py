"""`local-damage cv`: train and evaluate configs over folds, and the tables built from them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cli.main import main
from data_prep.spec import CLASS_NAMES, ChipSpec

TINY_YAML = """\
model:
  encoder: resnet18
  proj_hidden: 32
  cls_hidden: 32
  embed_dim: 16
  latent_size: 4
loss:
  method: {method}
data:
  input_size: {size}
train:
  batch_size: {batch}
  epochs: 1
  max_steps_per_epoch: 2
"""


@pytest.fixture(scope="module")
def store(synthetic_xbd, tmp_path_factory) -> Path:
    from data_prep.split import make_splits
    from data_prep.xbd import prepare_xbd

    out = tmp_path_factory.mktemp("cv_chips")
    prepare_xbd([synthetic_xbd], out, spec=ChipSpec(chip_size=64, min_size=48), progress=False)
    make_splits(out, folds=3, seed=0, verbose=False)
    return out


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cv_configs")
    out = {}
    # "toolarge": a batch bigger than the training set, so each of its folds fails at once
    for name, method, size, batch in (
        ("local", "local", 32, 4),
        ("ce", "ce", 32, 2),
        ("toolarge", "ce", 32, 64),
    ):
        path = root / f"{name}.yaml"
        path.write_text(TINY_YAML.format(method=method, size=size, batch=batch))
        out[name] = path
    return out


@pytest.fixture(scope="module")
def cv_run(store, configs, tmp_path_factory):
    """2 working configs (and 1 failing) x folds 0 and 2, through the CLI."""
    out = tmp_path_factory.mktemp("cv_out")
    args = ["cv", "--config", *map(str, configs.values()), "--chips", str(store)]
    rc = main([*args, "--out", str(out), "--folds", "0,2", "--quiet", "--views", "1"])
    return out, rc


def _stats(values: list[float]) -> tuple[float, float, float]:
    return float(np.mean(values)), float(np.min(values)), float(np.max(values))


@pytest.mark.slow
def test_cv_tables_equal_the_fold_metrics(cv_run, store, configs):
    out, rc = cv_run
    assert rc == 1  # the "toolarge" config failed on both folds; the others still ran
    results = json.loads((out / "cv_results.json").read_text())
    assert results["folds"] == [0, 2]
    assert [m["name"] for m in results["methods"]] == ["local", "ce", "toolarge"]
    assert {(f["method"], f["fold"]) for f in results["failed"]} == {
        ("toolarge", 0),
        ("toolarge", 2),
    }
    assert all("fewer than one batch" in f["error"] for f in results["failed"])

    table2 = pd.read_csv(out / "table2.csv").set_index("method")
    table3 = pd.read_csv(out / "table3.csv").set_index("class")
    md2, md3 = (out / "table2.md").read_text(), (out / "table3.md").read_text()
    for method in results["methods"][:2]:
        name = method["name"]
        assert set(method["folds"]) == {"0", "2"}
        per_fold = []
        for fold in (0, 2):
            written = json.loads((out / name / f"fold{fold}" / "metrics.json").read_text())
            assert method["folds"][str(fold)] == written
            assert written["source"]["fold"] == fold
            assert (out / name / f"fold{fold}" / "best.safetensors").is_file()
            per_fold.append(written)
        acc = _stats([m["accuracy"] for m in per_fold])
        f1 = _stats([m["macro_f1"] for m in per_fold])
        row = table2.loc[name]
        assert (row["accuracy_mean"], row["accuracy_min"], row["accuracy_max"]) == pytest.approx(
            acc
        )
        assert (row["macro_f1_mean"], row["macro_f1_min"], row["macro_f1_max"]) == pytest.approx(f1)
        assert row["batch_size"] == {"local": 4, "ce": 2}[name]  # from the config
        assert row["input_size"] == 32
        assert f"{100 * acc[0]:.2f} ({100 * acc[1]:.2f}-{100 * acc[2]:.2f})" in md2
        for cls in CLASS_NAMES:
            present = [
                m["per_class"][cls]["f1"] for m in per_fold if cls not in m["absent_classes"]
            ]
            assert table3.loc[cls, name] == pytest.approx(np.mean(present))
        assert table3.loc["f1-macro", name] == pytest.approx(f1[0])
        assert table3.loc["accuracy", name] == pytest.approx(acc[0])
        assert f"{100 * f1[0]:.2f} / {100 * acc[0]:.2f}" in md3
    assert "| toolarge | ce | 64 | 32x32 | 0 | n/a | n/a |" in md2

    # prevalence: class shares among the labelled chips of folds 0 and 2
    splits = pd.read_csv(store / "splits.csv", dtype={"chip_id": str})
    manifest = pd.read_csv(store / "manifest.csv", dtype={"chip_id": str}, keep_default_na=False)
    ids = set(splits.loc[splits["fold"].isin([0, 2]), "chip_id"])
    labels = manifest.loc[manifest["chip_id"].isin(ids), "label"].to_numpy()
    shares = np.bincount(labels, minlength=len(CLASS_NAMES)) / len(labels)
    assert results["prevalence"]["n"] == len(labels)
    for c, cls in enumerate(CLASS_NAMES):
        assert table3.loc[cls, "prevalence"] == pytest.approx(shares[c])
        assert f"| {cls} | {100 * shares[c]:.2f}% |" in md3
    assert sum(m["n"] for m in results["methods"][0]["folds"].values()) == len(labels)


@pytest.mark.slow
def test_cv_resumes_and_reuses_finished_folds(cv_run, store, configs, capsys):
    out, _ = cv_run
    before = json.loads((out / "cv_results.json").read_text())
    run = out / "local" / "fold2"
    (run / "metrics.json").unlink()  # trained but not evaluated
    (out / "ce" / "fold0" / "metrics.json").unlink()
    (out / "ce" / "fold0" / "summary.json").unlink()  # interrupted after its last checkpoint
    args = ["cv", "--config", str(configs["local"]), str(configs["ce"]), "--chips", str(store)]
    assert main([*args, "--out", str(out), "--folds", "0,2", "--quiet", "--views", "1"]) == 0
    err = capsys.readouterr().err
    assert "[local fold 0] reused" in err
    assert "[local fold 2] evaluated" in err
    assert "[ce fold 0] resumed" in err
    assert "[ce fold 2] reused" in err
    after = json.loads((out / "cv_results.json").read_text())
    for old, new in zip(before["methods"][:2], after["methods"], strict=True):
        for fold in ("0", "2"):
            assert new["folds"][fold]["accuracy"] == pytest.approx(old["folds"][fold]["accuracy"])
            assert new["folds"][fold]["confusion_matrix"] == old["folds"][fold]["confusion_matrix"]
    assert [m["name"] for m in after["methods"]] == ["local", "ce"] and not after["failed"]


@pytest.mark.slow
def test_cv_refuses_a_folder_of_another_config(cv_run, store, configs, capsys):
    out, _ = cv_run
    args = ["cv", "--config", str(configs["local"]), "--chips", str(store), "--out", str(out)]
    assert main([*args, "--folds", "0", "--set", "model.embed_dim=8"]) == 2
    err = capsys.readouterr().err
    assert str(out / "local" / "fold0") in err and "model.embed_dim" in err


def test_cv_argument_errors(store, configs, tmp_path, capsys):
    out = str(tmp_path / "out")
    local, ce = str(configs["local"]), str(configs["ce"])

    def error(*args: str) -> str:
        assert main(["cv", *args, "--chips", str(store), "--out", out]) == 2
        return capsys.readouterr().err

    assert "used twice" in error("--config", local, local)
    assert "one per config" in error("--config", local, ce, "--name", "a")
    assert "no fold(s) 9" in error("--config", local, "--folds", "0,9")
    missing = tmp_path / "missing.yaml"
    assert str(missing) in error("--config", str(missing))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochz: 1\n")
    assert "epochz" in error("--config", str(bad))
    unsplit = tmp_path / "unsplit"
    shutil.copytree(store, unsplit)
    (unsplit / "splits.csv").unlink()
    assert main(["cv", "--config", local, "--chips", str(unsplit), "--out", out]) == 2
    assert "local-damage split" in capsys.readouterr().err
    assert not Path(out).exists()


def test_pooled_metrics_score_every_fold_as_one_set():
    from local_damage.experiments.cv import pooled_metrics, summarise_method
    from runtime.metrics import classification_metrics

    names = list(CLASS_NAMES)
    # fold A holds the only minor-damage buildings; fold B none of them
    a_true, a_pred = [0, 0, 1, 1, 1, 3], [0, 1, 1, 1, 0, 3]
    b_true, b_pred = [0, 0, 2, 3, 3], [0, 3, 2, 3, 3]
    folds = {
        "0": classification_metrics(a_true, a_pred, names),
        "1": classification_metrics(b_true, b_pred, names),
    }
    pooled = pooled_metrics(folds, names)
    direct = classification_metrics(a_true + b_true, a_pred + b_pred, names)
    assert pooled["confusion_matrix"] == direct["confusion_matrix"]
    assert pooled["macro_f1"] == pytest.approx(direct["macro_f1"])
    assert pooled["accuracy"] == pytest.approx(8 / 11)
    # minor damage: 2 of 3 found, 1 false alarm -> F1 2/3 in the pooled set
    assert pooled["per_class"]["minor-damage"]["f1"] == pytest.approx(2 / 3)
    summary = summarise_method(folds, names)
    assert summary["pooled"]["macro_f1"] == pytest.approx(direct["macro_f1"])
    assert summary["max_abs_cos"]["mean"] is None  # no representation metrics in these folds
    assert pooled_metrics({}, names) is None


@pytest.mark.slow
def test_cv_holdout_fold_is_never_trained_on(store, configs, tmp_path, capsys):
    out = tmp_path / "held"
    args = ["cv", "--config", str(configs["ce"]), "--chips", str(store), "--out", str(out)]
    assert main([*args, "--holdout", "1", "--quiet", "--views", "1"]) == 0
    results = json.loads((out / "cv_results.json").read_text())
    assert results["folds"] == [0, 2] and results["holdout"] == 1
    splits = pd.read_csv(store / "splits.csv", dtype={"chip_id": str})
    held = int((splits["fold"] == 1).sum())
    for fold in (0, 2):
        summary = json.loads((out / "ce" / f"fold{fold}" / "summary.json").read_text())
        assert summary["holdout"] == 1
        others = int((splits["fold"] == (2 if fold == 0 else 0)).sum())
        assert summary["train_chips"] <= others < len(splits) - held
    assert "pooled" in results["methods"][0]["summary"]
    capsys.readouterr()
    # the same folder without the holdout would mix two protocols: refused
    assert main([*args, "--folds", "0", "--quiet", "--views", "1"]) == 2
    assert "holdout" in capsys.readouterr().err
    assert main([*args, "--holdout", "7"]) == 2
    assert "no fold 7" in capsys.readouterr().err
