"""Cross-validated figures beyond accuracy (`cv`'s cv_table.md and oof_predictions.csv) and the
recipe choice on inner folds (`cv --inner K`)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from cli.main import main
from data_prep.spec import CLASS_NAMES, ChipSpec
from data_prep.store import read_manifest, write_manifest
from local_damage.experiments.cv_report import (
    OOF_CSV,
    OOF_METRICS,
    false_alarms,
    intact_tiles,
    protocol_summary,
    protocol_table,
)
from local_damage.export.options import ExportError
from runtime.metrics import macro_f1_present
from runtime.metrics.calibration import expected_calibration_error

# tile, event, labels, predictions (one building each)
TILES = [
    ("quiet-1", "fire", [0, 0, 0, 0], [0, 3, 0, 1]),  # intact: 2 of 4 called damaged, 1 destroyed
    ("burnt-1", "fire", [0, 3, 3, 3], [0, 3, 3, 0]),
    ("quiet-2", "flood", [0, 0, 0], [0, 0, 0]),  # intact, no false alarm
    ("mixed-2", "flood", [1, 2, 0, -1], [1, 1, 0, 0]),  # -1: unlabelled, never evaluated
]
FOLD_OF = {"quiet-1": 0, "burnt-1": 0, "quiet-2": 1, "mixed-2": 1}


@pytest.fixture()
def fake_cv(tmp_path):
    """A manifest and two folds' predictions.csv as `evaluate` writes them."""
    rows, preds = [], {0: [], 1: []}
    rng = np.random.default_rng(0)
    for tile, event, labels, predicted in TILES:
        for i, (y, p) in enumerate(zip(labels, predicted, strict=True)):
            chip = f"{tile}:{i}"
            name = CLASS_NAMES[y] if y >= 0 else ""
            rows.append(
                {"chip_id": chip, "event": event, "tile": tile, "uid": str(i), "label": y,
                 "label_name": name, "index": i}
            )  # fmt: skip
            if y < 0:
                continue
            logits = rng.normal(size=len(CLASS_NAMES))
            logits[p] += 3.0
            prob = np.exp(logits) / np.exp(logits).sum()
            preds[FOLD_OF[tile]].append(
                {"chip_id": chip, "label": y, "pred": p}
                | {f"p_{c}": prob[k] for k, c in enumerate(CLASS_NAMES)}
                | {f"logit_{c}": logits[k] for k, c in enumerate(CLASS_NAMES)}
            )
    chips = tmp_path / "chips"
    write_manifest(chips, rows)
    runs = {}
    for fold, items in preds.items():
        run = tmp_path / "m" / f"fold{fold}"
        run.mkdir(parents=True)
        pd.DataFrame(items).to_csv(run / "predictions.csv", index=False)
        runs[fold] = run
    return chips, runs, tmp_path / "m"


def test_intact_tiles_are_those_with_only_no_damage(fake_cv):
    chips, _, _ = fake_cv
    assert intact_tiles(read_manifest(chips)) == {"quiet-1", "quiet-2"}


def test_protocol_summary_counts_false_alarms_ece_and_events(fake_cv, tmp_path):
    chips, runs, out = fake_cv
    names = list(CLASS_NAMES)
    summary = protocol_summary(runs, chips, names, out)
    oof = pd.read_csv(out / OOF_CSV, dtype={"chip_id": str})
    # every labelled chip once, with its fold, tile, event and intact flag
    assert len(oof) == 14 and oof["chip_id"].is_unique
    assert set(oof.loc[oof["fold"] == 1, "tile"]) == {"quiet-2", "mixed-2"}
    assert oof.loc[oof["tile"] == "quiet-1", "intact_tile"].all()
    assert not oof.loc[oof["tile"] == "burnt-1", "intact_tile"].any()
    assert {f"logit_{c}" for c in names} <= set(oof.columns)

    f0, f1 = summary["folds"][0], summary["folds"][1]
    assert f0["false_alarms"] == {"n": 4, "damaged": 2, "destroyed": 1, "share": 0.5}
    assert f1["false_alarms"] == {"n": 3, "damaged": 0, "destroyed": 0, "share": 0.0}
    assert summary["pooled"]["false_alarms"]["share"] == pytest.approx(2 / 7)
    assert summary["over_folds"]["false_alarm_share"] == {"mean": 0.25, "min": 0.0, "max": 0.5}
    assert f0["accuracy"] == pytest.approx(5 / 8)
    assert f1["accuracy"] == pytest.approx(5 / 6)
    # ECE per fold and on its intact tiles, from the probabilities
    part = oof[oof["fold"] == 0]
    probs = part[[f"p_{c}" for c in names]].to_numpy()
    assert f0["ece"] == pytest.approx(expected_calibration_error(probs, part["label"].to_numpy()))
    quiet = part[part["intact_tile"]]
    assert f0["ece_intact"] == pytest.approx(
        expected_calibration_error(
            quiet[[f"p_{c}" for c in names]].to_numpy(), quiet["label"].to_numpy()
        )
    )
    # per event, pooled: absent classes have no F1 and stay out of the macro-F1
    flood = summary["per_event"]["flood"]
    assert flood["n"] == 6 and flood["per_class_f1"]["destroyed"] is None
    assert flood["per_class_f1"]["major-damage"] == 0.0
    assert flood["macro_f1"] == pytest.approx(np.mean([1.0, 2 / 3, 0.0]))
    text = protocol_table([{"name": "m", "protocol": summary}], names)
    assert "| m | 0 |" in text and "50.0% (2/4; 1 destroyed)" in text
    assert "| m | flood | 6 |" in text

    # the pooled figures as a metrics.json that `export --test-metrics` reads, marked as the
    # recipe's cross-validation (every intact building, not only those of intact tiles)
    from local_damage.export.provenance import summarize_test_metrics

    tested = summarize_test_metrics(out / OOF_METRICS)
    pooled = summary["pooled"]
    assert tested["accuracy"] == pooled["accuracy"] == pytest.approx(10 / 14)
    assert tested["macro_f1"] == pooled["macro_f1"] and tested["n"] == 14
    assert tested["f1"] == pooled["per_class_f1"]
    assert tested["tiles"] == sorted(oof["tile"].unique())
    cv = tested["cross_validation"]
    assert cv["folds"] == [0, 1] and cv["ece"] == pytest.approx(pooled["ece"])
    intact = oof[oof["label"] == 0]
    assert cv["intact_called_damaged"] == pytest.approx(float(np.mean(intact["pred"] != 0)))

    # for a model graded under its own false-alarm cost, the same figures graded under it
    from runtime.grading import grades

    strict = summarize_test_metrics(out / OOF_METRICS, names, 100.0)
    graded = grades(oof[[f"p_{c}" for c in names]].to_numpy(), names, 100.0)
    labels = oof["label"].to_numpy()
    assert (graded != oof["pred"].to_numpy()).any()  # the cost changes grades here
    assert strict["accuracy"] == pytest.approx(float(np.mean(graded == labels)))
    assert strict["macro_f1"] == pytest.approx(macro_f1_present(labels, graded, names))
    assert strict["cross_validation"]["false_alarm_cost"] == 100.0
    assert strict["cross_validation"]["intact_called_damaged"] == pytest.approx(
        float(np.mean(graded[labels == 0] != 0))
    )
    assert strict["cross_validation"]["ece"] == cv["ece"] and strict["n"] == 14
    assert summarize_test_metrics(out / OOF_METRICS, names, 1.0) == tested
    # the predictions are found beside the metrics when the folder has moved
    moved = tmp_path / "moved"
    out.rename(moved)
    assert (
        summarize_test_metrics(moved / OOF_METRICS, names, 100.0)["accuracy"] == strict["accuracy"]
    )
    (moved / OOF_CSV).unlink()
    with pytest.raises(ExportError, match="cannot be read"):
        summarize_test_metrics(moved / OOF_METRICS, names, 100.0)


def test_false_alarms_without_intact_tiles_are_none():
    frame = pd.DataFrame({"intact_tile": [False, False], "pred": [0, 3]})
    assert false_alarms(frame, list(CLASS_NAMES)) is None


TINY = """\
model: {{encoder: resnet18, proj_hidden: 16, cls_hidden: 16, embed_dim: 8, latent_size: 4}}
loss: {{method: {method}}}
data: {{input_size: 32}}
train: {{batch_size: 2, epochs: 1, max_steps_per_epoch: 1, patience: 0, keep: last}}
"""


def _two_folds_two_recipes(synthetic_xbd, tmp_path):
    """A chip store of the synthetic xBD in two folds, and two tiny recipes (LOCAL and CE)."""
    from data_prep.split import make_splits
    from data_prep.xbd import prepare_xbd

    chips = tmp_path / "chips"
    prepare_xbd([synthetic_xbd], chips, spec=ChipSpec(chip_size=64, min_size=48), progress=False)
    make_splits(chips, folds=2, seed=0, stratify="event", verbose=False)
    configs = []
    for name in ("local", "ce"):
        path = tmp_path / f"{name}.yaml"
        path.write_text(TINY.format(method=name))
        configs.append(str(path))
    return chips, configs


@pytest.mark.slow
def test_cv_inner_chooses_on_inner_folds_only(synthetic_xbd, tmp_path):
    from data_prep.split import load_splits

    chips, configs = _two_folds_two_recipes(synthetic_xbd, tmp_path)
    out = tmp_path / "cv"
    argv = ["cv", "--config", *configs, "--chips", str(chips), "--out", str(out)]
    assert main([*argv, "--folds", "0", "--inner", "2", "--views", "1", "--quiet"]) == 0
    results = json.loads((out / "cv_results.json").read_text())
    assert [m["name"] for m in results["methods"]] == ["selected"]
    selection = json.loads((out / "inner" / "outer0" / "selection.json").read_text())
    means = {n: c["mean"] for n, c in selection["candidates"].items()}
    order = ["local", "ce"]  # ties go to the config given first
    assert selection["chosen"] == max(order, key=lambda n: (means[n], -order.index(n)))
    assert results["methods"][0]["recipes"] == {"0": selection["chosen"]}
    # the inner folds hold only training tiles of outer fold 0
    splits = load_splits(chips)
    test_tiles = set(splits.loc[splits["fold"] == 0, "tile"])
    inner_tiles = {t for tiles in selection["tiles"].values() for t in tiles}
    assert inner_tiles and not inner_tiles & test_tiles
    for name in ("local", "ce"):
        for j in (0, 1):
            evaluated = json.loads(
                (out / "inner" / "outer0" / name / f"fold{j}" / "metrics.json").read_text()
            )
            assert not set(evaluated["source"]["tiles"]) & test_tiles
    # the selected recipe was scored on the test fold, and its table written
    assert (out / "selected" / "fold0" / "metrics.json").is_file()
    assert (out / "selected" / OOF_CSV).is_file()
    assert "| selected |" in (out / "cv_table.md").read_text()
    assert main([*argv, "--inner", "1"]) != 0
    # every candidate's intact false alarms are recorded beside its macro-F1
    for name in ("local", "ce"):
        alarm = selection["candidates"][name]["false_alarm"]
        assert alarm is None or 0.0 <= alarm <= 1.0
    assert selection["max_false_alarm"] is None and "macro-F1" in selection["rule"]
    # a ceiling needs --inner and must be a share
    assert main([*argv, "--max-false-alarm", "0.1"]) != 0
    assert main([*argv, "--inner", "2", "--max-false-alarm", "1.5"]) != 0
    assert main([*argv, "--costs", "1,2"]) != 0  # costs are tried on inner folds only

    # --costs: each inner model graded again under every cost (the same weights: the inner runs
    # are reused), and the chosen cost becomes the outer run's grade rule
    import shutil

    from runtime.grading import grades

    out2 = tmp_path / "cv-costs"
    shutil.copytree(out / "inner", out2 / "inner")
    argv2 = ["cv", "--config", *configs, "--chips", str(chips), "--out", str(out2)]
    argv2 += ["--folds", "0", "--inner", "2", "--views", "1", "--quiet"]
    assert main([*argv2, "--costs", "1,1000", "--max-false-alarm", "0"]) == 0
    costed = json.loads((out2 / "inner" / "outer0" / "selection.json").read_text())
    found = costed["candidates"]
    assert sorted(found) == sorted(f"{n}@cost{c}" for n in order for c in (1, 1000))
    for name in order:  # graded again at cost 1: the figures `evaluate` wrote
        assert found[f"{name}@cost1"]["mean"] == pytest.approx(means[name])
        assert (found[f"{name}@cost1000"]["false_alarm"] or 0) <= (
            found[f"{name}@cost1"]["false_alarm"] or 0
        )
    chosen = found[costed["chosen"]]
    assert costed["costs"] == [1.0, 1000.0]
    run = out2 / "selected" / "fold0"
    import yaml

    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["grade"]["false_alarm_cost"] == chosen["false_alarm_cost"]
    assert saved["loss"]["method"] == chosen["recipe"]
    graded = json.loads((run / "metrics.json").read_text())
    assert graded["grade_rule"]["false_alarm_cost"] == chosen["false_alarm_cost"]
    frame = pd.read_csv(run / "predictions.csv")
    p = frame[[f"p_{c}" for c in CLASS_NAMES]].to_numpy(float)
    want = grades(p, CLASS_NAMES, chosen["false_alarm_cost"])
    assert list(frame["pred"]) == list(want)


def test_a_run_is_reused_under_another_grade_rule_or_machine_only(tmp_path):
    """The grade rule, the device and the loader's workers do not change the weights: a finished
    run is reused under another cost (and evaluated again) or on another machine, never under
    another training setting."""
    from local_damage.config import save_yaml
    from local_damage.experiments.cv import CrossValidationError, check_run_config
    from local_damage.experiments.nested import with_cost
    from local_damage.train.config import Config

    cfg = Config()
    save_yaml(cfg, tmp_path / "config.yaml")
    check_run_config(tmp_path, with_cost(cfg, 3.0))
    elsewhere = Config()
    elsewhere.train.device, elsewhere.data.num_workers = "cpu", cfg.data.num_workers + 2
    check_run_config(tmp_path, elsewhere)
    longer = Config()
    longer.train.epochs = cfg.train.epochs + 1
    with pytest.raises(CrossValidationError, match="train.epochs"):
        check_run_config(tmp_path, longer)
    with pytest.raises(ValueError, match="false-alarm cost"):
        with_cost(cfg, 0.0)


def scores(**named):
    return {n: {"mean": f1, "false_alarm": fa} for n, (f1, fa) in named.items()}


def test_pick_with_a_false_alarm_ceiling():
    from local_damage.experiments.nested import pick

    found = scores(eager=(0.57, 0.24), careful=(0.46, 0.08), timid=(0.40, 0.02))
    assert pick(found)[0] == "eager"  # macro-F1 alone
    chosen, rule = pick(found, max_false_alarm=0.10)
    assert chosen == "careful" and "10%" in rule  # the best macro-F1 under the ceiling
    assert pick(found, max_false_alarm=0.25)[0] == "eager"
    chosen, rule = pick(found, max_false_alarm=0.01)
    assert chosen == "timid" and "fewest" in rule  # none under it: the fewest false alarms
    # ties go to the candidate given first, with or without a ceiling
    tied = scores(first=(0.5, 0.05), second=(0.5, 0.05))
    assert pick(tied)[0] == "first" and pick(tied, 0.1)[0] == "first"
    assert pick(tied, 0.0)[0] == "first"


def test_intact_called_damaged_reads_the_intact_row():
    from local_damage.experiments.nested import intact_called_damaged

    cm = [[80, 15, 4, 1], [10, 5, 0, 0], [0, 0, 3, 0], [0, 0, 0, 2]]
    assert intact_called_damaged({"confusion_matrix": cm}) == pytest.approx(0.20)
    cm[0] = [0, 0, 0, 0]
    assert intact_called_damaged({"confusion_matrix": cm}) is None


@pytest.mark.slow
def test_cv_inner_by_event_chooses_on_events_left_out(synthetic_xbd, tmp_path):
    """`cv --inner K --inner-by event`: each inner fold holds out one whole training event (the
    K largest), the inner runs live apart from the inner folds by area, and the choice records
    which events were left out."""
    from data_prep.split import load_splits

    chips, configs = _two_folds_two_recipes(synthetic_xbd, tmp_path)
    out = tmp_path / "cv"
    argv = ["cv", "--config", *configs, "--chips", str(chips), "--out", str(out), "--quiet"]
    assert main([*argv, "--inner-by", "event"]) != 0  # it goes with --inner
    assert main([*argv, "--folds", "0", "--inner", "2", "--inner-by", "event", "--views", "1"]) == 0
    selection = json.loads((out / "inner-event" / "outer0" / "selection.json").read_text())
    assert selection["inner_by"] == "event" and not (out / "inner").exists()
    held = [selection["events"][str(j)] for j in (0, 1)]
    assert all(len(events) == 1 for events in held) and held[0] != held[1]
    splits = load_splits(chips)
    test_tiles = set(splits.loc[splits["fold"] == 0, "tile"])
    for name in ("local", "ce"):
        for j in (0, 1):
            run = out / "inner-event" / "outer0" / name / f"fold{j}"
            evaluated = json.loads((run / "metrics.json").read_text())
            assert not set(evaluated["source"]["tiles"]) & test_tiles
            frame = pd.read_csv(run / "predictions.csv")
            manifest = read_manifest(chips).set_index("chip_id")
            assert set(manifest.loc[frame["chip_id"], "event"]) == set(held[j])
    assert (out / "selected" / "fold0" / "metrics.json").is_file()
