"""`local-damage bench fewshot`: the leave-one-event-out few-shot report on a 2-event store.

The store is the synthetic xBD generator's (6 tiles, 2 events of about 32 labelled buildings);
the base models are tiny (``TINY_TRAIN``: resnet18 at 32 px, 1 epoch), so the figures mean
nothing; what is checked is that the report measures what it says it measures.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from data_prep.spec import CLASS_NAMES, ChipSpec
from tests.conftest import TINY_TRAIN, run_cli

EVENTS = ("synthetic-flood", "synthetic-wildfire")
KS = (0, 4, 8)
REPEATS = 2
ARMS = ("adapt-random", "adapt-suggested", "finetune", "semi")


def tiny(*extra: str) -> list[str]:
    out = []
    for item in (*TINY_TRAIN, *extra):
        out += ["--set", item]
    return out


@pytest.fixture(scope="module")
def chips(tmp_path_factory) -> Path:
    from data_prep.synthetic import make_xbd
    from data_prep.xbd import prepare_xbd

    root = tmp_path_factory.mktemp("fewshot")
    make_xbd(root / "xbd", seed=0, n_tiles=6)
    prepare_xbd([root / "xbd"], root / "chips", ChipSpec(chip_size=64, min_size=48), progress=False)
    return root / "chips"


def report_args(chips: Path, out: Path, ks=KS, repeats=REPEATS, finetune=1) -> list:
    return [
        "bench",
        "fewshot",
        "--chips",
        chips,
        "--out",
        out,
        *tiny(),
        "--k",
        ",".join(map(str, ks)),
        "--repeats",
        repeats,
        "--finetune-epochs",
        finetune,
        "--min-eval",
        10,
        "--quiet",
    ]


@pytest.fixture(scope="module")
def report(chips, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fewshot_out") / "report"
    assert run_cli(*report_args(chips, out)) == 0
    return out


@pytest.fixture
def copy(report, tmp_path) -> Path:
    """A copy of the finished report (times kept), for reruns that change it."""
    out = tmp_path / "report"
    shutil.copytree(report, out)
    return out


def _labelled(chips: Path, event: str) -> dict[str, int]:
    from data_prep.store import read_manifest

    m = read_manifest(chips)
    m = m[(m["event"] == event) & (m["label"] >= 0)]
    return dict(zip(m["chip_id"], m["label"], strict=True))


def _load(out: Path) -> dict:
    return json.loads((out / "fewshot.json").read_text())


# --------------------------------------------------------------------------------------------
# the report


@pytest.mark.slow
def test_report_writes_every_measurement_the_tables_and_the_plot(report, chips):
    results = _load(report)
    assert sorted(results["events"]) == list(EVENTS)
    assert results["skipped"] == []
    assert results["settings"]["k"] == list(KS) and results["settings"]["repeats"] == REPEATS
    rows = results["measurements"]
    # every event x repeat x k x arm, once
    keys = {(r["event"], r["repeat"], r["k"], r["arm"]) for r in rows}
    assert len(keys) == len(rows) == len(EVENTS) * REPEATS * len(KS) * len(ARMS)
    for event in EVENTS:
        labels = _labelled(chips, event)
        info = results["events"][event]
        assert info["n"] == len(labels) and info["pool"] + info["eval"] == len(labels)
        assert info["base"] == "trained"
        assert (report / event / "base" / "best.safetensors").is_file()
        for split in results["splits"][event]:
            pool, ev = split["pool"], split["eval"]
            assert len(pool) == info["pool"] and len(ev) == info["eval"]
            assert not set(pool) & set(ev) and set(pool) | set(ev) == set(labels)
            sel = [r for r in rows if r["event"] == event and r["repeat"] == split["repeat"]]
            base = {(r["accuracy"], r["macro_f1"]) for r in sel if r["k"] == 0}
            assert len(base) == 1  # k = 0 is the base model, the same for every arm
            for r in sel:
                assert r["n_eval"] == len(ev)  # every arm scored on the same buildings
                assert len(r["labelled"]) == r["k"] and set(r["labelled"]) <= set(pool)
                counts = np.bincount([labels[c] for c in r["labelled"]], minlength=4)
                assert r["labels_per_class"] == dict(zip(CLASS_NAMES, counts.tolist(), strict=True))
                assert 0 <= r["accuracy"] <= 1 and 0 <= r["macro_f1"] <= 1
                if r["arm"] in ("adapt-random", "finetune", "semi"):  # the pool's order
                    assert r["labelled"] == pool[: r["k"]]
                if r["arm"] in ("finetune", "semi") and r["k"]:
                    # the network fine-tuned (adapt --finetune / --semi), or the base kept
                    assert r["model"] in (r["arm"], "base"), r
                    if r["model"] == "base":
                        assert (r["accuracy"], r["macro_f1"]) in base
        assert (report / event / "base.safetensors").is_file()  # what fine-tuning starts from

    # the tables are the mean +- sd of these rows
    md = (report / "fewshot.md").read_text()
    summary = results["summary"]
    for event in EVENTS:
        for arm in ARMS:
            for k in KS:
                vals = [
                    r["macro_f1"] for r in rows if (r["event"], r["arm"], r["k"]) == (event, arm, k)
                ]
                cell = summary["events"][event][arm][str(k)]["macro_f1"]
                assert cell["mean"] == pytest.approx(np.mean(vals))
                assert cell["sd"] == pytest.approx(np.std(vals, ddof=1))
            line = next(x for x in md.splitlines() if x.startswith(f"| {event} | {arm} |"))
            cells = summary["events"][event][arm]
            assert line.endswith(
                f"{cells['8']['macro_f1']['mean']:.3f} +- {cells['8']['macro_f1']['sd']:.3f} |"
            )
    for arm in ARMS:
        means = [summary["events"][e][arm]["4"]["accuracy"]["mean"] for e in EVENTS]
        assert summary["mean"][arm]["4"]["accuracy"]["mean"] == pytest.approx(np.mean(means))
    assert "## Macro-F1" in md and "## Accuracy" in md and "**mean over events**" in md
    # the share of draws worse than the base model of the same repeat, per arm and k
    for arm in ARMS:
        for k in KS[1:]:
            base_of = {(r["event"], r["repeat"]): r["macro_f1"] for r in rows if r["k"] == 0}
            d = [
                r["macro_f1"] - base_of[(r["event"], r["repeat"])]
                for r in rows
                if r["arm"] == arm and r["k"] == k
            ]
            cell = summary["worse"][arm][str(k)]
            assert cell["n"] == len(d) == len(EVENTS) * REPEATS
            assert cell["share"] == pytest.approx(np.mean(np.asarray(d) < -0.01))
    assert "made it worse" in md
    gain = next(g for g in results["goals"] if g["arm"] == "adapt-random")
    assert gain["passed"] is None  # k = 20 was not measured
    order = results["goals"][-1]
    diffs = {
        int(k): summary["mean"]["adapt-suggested"][str(k)]["macro_f1"]["mean"]
        - summary["mean"]["adapt-random"][str(k)]["macro_f1"]["mean"]
        for k in KS[1:]
    }
    assert {int(k): v for k, v in order["value"].items()} == pytest.approx(diffs)
    assert order["passed"] == all(d >= 0 for d in diffs.values())
    assert (report / "fewshot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p.name for p in report.iterdir() if p.name.startswith(".")]  # no temporaries


@pytest.mark.slow
def test_adapt_arms_are_what_local_damage_adapt_gives(report, chips, tmp_path):
    """The report's figures of an adapted head equal those of the model `adapt` writes for the
    same labels, and the suggested labels come in rounds: the first ranked with the base model,
    the next with the model adapted to the first round's labels."""
    from app.adapt.labelled import Buildings, from_chip_store
    from app.adapt.model import adapt_model
    from app.adapt.suggest import suggestion_order
    from runtime.metrics import classification_metrics
    from runtime.predictor import Predictor

    results = _load(report)
    event = EVENTS[1]
    base = Predictor(report / event / "base.onnx")
    assert base.temperature is not None  # calibrated on the validation slice
    store = from_chip_store(chips, base.class_names, event=event)
    where = {c: i for i, c in enumerate(store.ids)}
    split = results["splits"][event][0]
    ev = [where[c] for c in split["eval"]]
    pool = [where[c] for c in split["pool"]]
    pred = base.predict(store.pre[pool], store.post[pool])
    first, _ = suggestion_order(
        pred.probabilities, pred.embedding, KS[1], order=np.arange(len(pool))
    )
    assert first.tolist() == list(range(KS[1]))  # the first round: the random arm's draw
    rows = {
        (r["arm"], r["k"]): r
        for r in results["measurements"]
        if r["event"] == event and r["repeat"] == 0
    }
    assert rows["adapt-suggested", KS[1]]["labelled"] == [split["pool"][i] for i in first]
    checked = 0
    for r in rows.values():
        if r["k"] == 0 or r["arm"] in ("finetune", "semi"):
            continue
        if r.get("note", "").startswith("adapt refused"):
            continue
        pick = [where[c] for c in r["labelled"]]  # in the order the report gave them
        given = Buildings(
            r["labelled"],
            [event] * len(pick),
            store.labels[pick],
            store.pre[pick],
            store.post[pick],
        )
        out = adapt_model(base, given, tmp_path / f"{r['arm']}-{r['k']}.onnx")
        assert out.block["method"] == r["model"]
        adapted = Predictor(out.out)
        graded = adapted.predict(store.pre[ev], store.post[ev]).probabilities
        m = classification_metrics(store.labels[ev], graded.argmax(1), base.class_names)
        assert m["accuracy"] == pytest.approx(r["accuracy"], abs=1e-6)
        assert m["macro_f1"] == pytest.approx(r["macro_f1"], abs=1e-6)
        checked += 1
        if r["arm"] == "adapt-suggested" and r["k"] == KS[1]:
            # the second round: the rest of the pool ranked by the model adapted to the first
            given_ids = set(r["labelled"])
            rest = [i for i, c in zip(pool, split["pool"], strict=True) if c not in given_ids]
            mine = adapted.predict(store.pre[rest], store.post[rest])
            more, _ = suggestion_order(
                mine.probabilities,
                mine.embedding,
                KS[2] - KS[1],
                adapted.predict(given.pre, given.post).embedding,
                adapted=True,
                order=np.arange(len(rest)),  # the random share: the rest of the pool's order
            )
            second = rows["adapt-suggested", KS[2]]["labelled"]
            assert second == r["labelled"] + [store.ids[rest[i]] for i in more]
            checked += 10
    assert checked >= 12  # the second round was checked too


@pytest.mark.slow
def test_rerun_reuses_the_base_runs(copy, chips, capsys):
    runs = {e: copy / e / "base" / "best.safetensors" for e in EVENTS}
    models = {e: copy / e / "base.onnx" for e in EVENTS}
    before = {p: p.stat().st_mtime_ns for p in [*runs.values(), *models.values()]}
    # other settings: the measurements are made again, the base models are not retrained
    assert run_cli(*report_args(chips, copy, ks=(0, 4), repeats=1, finetune=0)) == 0
    err = capsys.readouterr().err
    for event in EVENTS:
        assert f"[{event}] base reused" in err
        assert f"[{event}] measurements reused" not in err
    assert {p: p.stat().st_mtime_ns for p in before} == before
    results = _load(copy)
    assert {r["arm"] for r in results["measurements"]} == {"adapt-random", "adapt-suggested"}
    assert {r["k"] for r in results["measurements"]} == {0, 4}
    assert all(v["base"] == "reused" for v in results["events"].values())
    # the same settings again: the measurements are reused too
    assert run_cli(*report_args(chips, copy, ks=(0, 4), repeats=1, finetune=0)) == 0
    err = capsys.readouterr().err
    assert all(f"[{e}] measurements reused" in err for e in EVENTS)
    assert _load(copy)["measurements"] == results["measurements"]


@pytest.mark.slow
def test_k_zero_alone_measures_the_base_model(copy, chips):
    assert run_cli(*report_args(chips, copy, ks=(0,), repeats=1)) == 0
    rows = _load(copy)["measurements"]
    assert {r["k"] for r in rows} == {0} and {r["model"] for r in rows} == {"base"}


@pytest.mark.slow
def test_an_event_too_small_is_skipped_and_listed(copy, chips, capsys):
    sizes = {e: len(_labelled(chips, e)) for e in EVENTS}
    small, large = sorted(EVENTS, key=sizes.get)
    assert sizes[small] < sizes[large]
    k = sizes[large] - 10  # the larger event just fits (k + --min-eval 10), the smaller not
    assert run_cli(*report_args(chips, copy, ks=(0, k), repeats=1, finetune=0)) == 0
    err = capsys.readouterr().err
    assert f"not measured: {small}: {sizes[small]} labelled buildings" in err
    results = _load(copy)
    assert list(results["events"]) == [large]
    assert [s["event"] for s in results["skipped"]] == [small]
    assert f"- {small}: {sizes[small]} labelled buildings" in (copy / "fewshot.md").read_text()


# --------------------------------------------------------------------------------------------
# bad input


def _manifest_with_events(chips: Path, tmp_path: Path, events) -> Path:
    import pandas as pd

    out = tmp_path / "store"
    shutil.copytree(chips, out)
    m = pd.read_csv(out / "manifest.csv", dtype=str, keep_default_na=False)
    m["event"] = events(m)
    m.to_csv(out / "manifest.csv", index=False)
    return out


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no events", "no labelled chip with an event name"),
        ("one event", "the report needs at least 2 events"),
        ("unknown event", "no labelled chip of event(s) no-such-event; its events are"),
        ("no manifest", "manifest.csv: no manifest"),
        ("too small", "no event can be measured"),
        ("negative k", "--k must list numbers of labels >= 0"),
        ("missing config", "config file not found"),
    ],
)
def test_bad_input_is_a_clear_error(case, message, chips, tmp_path, capsys):
    store, extra = chips, []
    if case == "no events":
        store = _manifest_with_events(chips, tmp_path, lambda m: "")
    elif case == "one event":
        store = _manifest_with_events(chips, tmp_path, lambda m: "only-event")
    elif case == "unknown event":
        extra = ["--events", "no-such-event"]
    elif case == "no manifest":
        store = tmp_path / "empty"
        store.mkdir()
    elif case == "too small":
        extra = ["--k", "0,50"]
    elif case == "negative k":
        extra = ["--k", "0,-5"]
    elif case == "missing config":
        extra = ["--config", tmp_path / "nope.yaml"]
    out = tmp_path / "out"
    assert run_cli(*report_args(store, out), *extra) == 2
    err = capsys.readouterr().err
    assert message in err
    if case in ("no events", "one event", "no manifest"):
        assert str(store / "manifest.csv") in err
    if case == "too small":
        assert all(f"{e}: " in err for e in EVENTS)
    assert not out.exists()  # nothing trained, nothing written


@pytest.mark.slow
def test_a_base_folder_of_another_config_is_refused(copy, chips, capsys):
    assert run_cli(*report_args(chips, copy), "--set", "train.epochs=2") == 2
    err = capsys.readouterr().err
    assert str(copy / EVENTS[0] / "base") in err and "another config" in err


def test_area_draws_keep_every_block_on_one_side():
    """`--draw area`: the pool is whole spatial blocks (at least n_pool buildings), the graded
    buildings the other blocks; an event of one block cannot be split."""
    from studies.fewshot_measure import area_split
    from studies.fewshot_settings import FewShotError

    blocks = np.repeat(np.array(["a", "b", "c", "d", "e"]), [10, 30, 5, 20, 15])
    rng = np.random.default_rng(3)
    pool, graded = area_split(blocks, rng.permutation(len(blocks)), 25, rng)
    assert len(pool) >= 25 and len(graded) > 0
    assert not set(blocks[pool]) & set(blocks[graded])
    assert sorted(np.concatenate([pool, graded]).tolist()) == list(range(len(blocks)))
    with pytest.raises(FewShotError, match="takes them all"):
        area_split(np.array(["a"] * 40), np.arange(40), 20, rng)


def test_scores_count_the_intact_buildings_called_damaged():
    from studies.fewshot_measure import _scores

    y = np.array([0, 0, 0, 0, 1, 3])
    pred = np.array([0, 1, 3, 0, 1, 3])  # two of the four intact called damaged
    s = _scores(y, pred, list(CLASS_NAMES))
    assert s["intact_damaged"] == 0.5 and s["accuracy"] == pytest.approx(4 / 6, abs=1e-6)
    assert _scores(np.array([1, 3]), np.array([1, 3]), list(CLASS_NAMES))["intact_damaged"] is None


def test_a_draw_that_loses_accuracy_counts_as_worse():
    """Worse: macro-F1 below the same repeat's base by more than 0.01, or accuracy by more than
    0.02; a draw level on macro-F1 but 0.03 lower in accuracy is counted."""
    from studies.fewshot_report import worse_shares

    base = {"event": "e", "k": 0, "arm": "finetune", "macro_f1": 0.40, "accuracy": 0.60}
    rows = [{**base, "repeat": r} for r in range(3)] + [
        {**base, "repeat": 0, "k": 100, "macro_f1": 0.40, "accuracy": 0.57},  # accuracy -0.03
        {**base, "repeat": 1, "k": 100, "macro_f1": 0.385, "accuracy": 0.60},  # macro-F1 -0.015
        {**base, "repeat": 2, "k": 100, "macro_f1": 0.395, "accuracy": 0.585},  # within both
    ]
    share = worse_shares(rows, ["finetune"], [0, 100])["finetune"]["100"]
    assert share == {"share": pytest.approx(2 / 3), "n": 3}
