"""`local-damage adapt --finetune` and `--semi`: the network's last block and classifier
fine-tuned on the labels (epochs chosen by cross-validation, the base network kept unless beaten
clearly), FixMatch on unlabelled buildings, and the clear error without PyTorch.

The base model is the tiny exported model of the ``score_model`` fixture with its fp16 weights
beside it (``export --weights``), run by ONNX Runtime after fine-tuning as any model is.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_cli


@pytest.fixture(scope="module")
def base(score_model, tmp_path_factory) -> Path:
    """The fixture model with its fine-tuning weights beside it (NAME.safetensors)."""
    from local_damage.export.weights import export_weights

    folder = tmp_path_factory.mktemp("finetune-base")
    shutil.copy(score_model, folder / "base.onnx")
    export_weights(score_model.parent / "run", folder / "base.safetensors")
    return folder / "base.onnx"


def _nll(p: np.ndarray, y: np.ndarray) -> float:
    return float(-np.log(np.clip(p[np.arange(len(y)), y], 1e-12, 1)).mean())


@pytest.mark.slow
def test_finetune_writes_a_model_that_grades_the_labels_better(base, chips, store, tmp_path):
    """The written model is a real ONNX file with the adaptation block; the cross-validation
    kept some epochs, and the model grades the labelled chips with a lower log-loss than the
    base model (the fixture's model trained one epoch: much to learn)."""
    from runtime.predictor import Predictor

    out = tmp_path / "tuned.onnx"
    assert run_cli("adapt", "--model", base, "--chips", chips, "--finetune", "--out", out) == 0
    tuned = Predictor(out)
    block = tuned.metadata["adaptation"]
    assert block["method"] == "finetune", block["cv"]
    choice = block["finetune"]["choice"]
    assert block["finetune"]["epochs"] >= 1 and choice["clear"]
    # kept only with an out-of-fold macro-F1 gain clear of its bootstrap spread
    assert choice["f1_gain"] > 2 * choice["f1_gain_se"] > 0
    assert "bootstrap standard errors" in block["selection"]
    curve = block["cv"]["curve"]
    assert len(curve) == block["finetune"]["max_epochs"] + 1
    assert curve[block["finetune"]["epochs"]]["nll"] < curve[0]["nll"]
    for row in curve:  # each fold's macro-F1, their mean the curve's
        assert row["macro_f1"] == pytest.approx(np.mean(row["macro_f1_folds"]), abs=1e-5)
        assert len(row["macro_f1_folds"]) == int(block["cv"]["scheme"].split("-")[0])
    assert block["labels"]["n"] == int(store.labelled.sum())
    # the recalibration was fitted on the kept epoch's out-of-fold logits of every label
    r = block["recalibration"]
    assert r["n"] == block["labels"]["n"]
    assert tuned.metadata["calibration"]["temperature"] == (r["temperature"] if r["kept"] else 1.0)
    assert "ood" not in tuned.metadata  # the base network's prototypes do not describe it
    y = store.labels
    before = Predictor(base).predict(store.pre, store.post).probabilities
    after = tuned.predict(store.pre, store.post).probabilities
    assert _nll(after, y) < _nll(before, y) - 0.05


@pytest.mark.slow
def test_labels_that_say_nothing_keep_the_base_network(base, store, tmp_path):
    """Labels shuffled at random: no number of epochs beats the base network clearly on the
    cross-validation, so the written model grades exactly as the base model."""
    from app.adapt.labelled import Buildings
    from cli.adapt import finetune_model
    from runtime.predictor import Predictor

    rng = np.random.default_rng(0)
    n = len(store)
    pick = rng.permutation(n)
    noise = Buildings(
        [store.ids[i] for i in pick],
        [store.events[i] for i in pick],
        rng.integers(0, 4, n),
        store.pre[pick],
        store.post[pick],
    )
    out = tmp_path / "kept.onnx"
    result = finetune_model(Predictor(base), noise, out)
    assert result.block["finetune"]["epochs"] == 0, result.block["cv"]
    assert result.block["method"] == "base"
    a = Predictor(base).predict(store.pre, store.post).probabilities
    b = Predictor(out).predict(store.pre, store.post).probabilities
    np.testing.assert_array_equal(a.argmax(1), b.argmax(1))
    # the probabilities are the base's, at the temperature recalibrated on the labels if kept
    r = result.block["recalibration"]
    assert r["n"] == n
    t = r["temperature"] if r["kept"] else 1.0
    expected = np.exp(np.log(a) / t)
    np.testing.assert_allclose(expected / expected.sum(1, keepdims=True), b, atol=1e-5)


@pytest.mark.slow
def test_semi_learns_from_the_unlabelled_buildings(base, store, tmp_path):
    """Half the store's labels hidden: ``--semi`` uses the hidden half as unlabelled pairs and
    records how many, and the FixMatch figures when it trains."""
    from app.adapt.labelled import Buildings
    from cli.adapt import finetune_model
    from runtime.predictor import Predictor

    hidden = np.arange(len(store)) % 2 == 1
    half = Buildings(
        store.ids, store.events, np.where(hidden, -1, store.labels), store.pre, store.post
    )
    out = tmp_path / "semi.onnx"
    result = finetune_model(Predictor(base), half, out, semi=True)
    details = result.block["finetune"]
    assert details["unlabelled"] == int(hidden.sum())
    assert result.block["method"] in ("semi", "base")
    if result.block["method"] == "semi":
        assert 0.0 <= details["fixmatch"]["confident_share"] <= 1.0
        assert details["fixmatch"]["confidence"] == 0.95
    Predictor(out)  # a readable model either way


def test_semi_without_unlabelled_buildings_is_refused(base, store, tmp_path):
    from cli.adapt import finetune_model
    from local_damage.adapt.network import FinetuneError
    from runtime.predictor import Predictor

    with pytest.raises(FinetuneError, match="unlabelled buildings"):
        finetune_model(Predictor(base), store, tmp_path / "x.onnx", semi=True)
    assert not (tmp_path / "x.onnx").exists()


def test_fixmatch_keeps_only_confident_pseudo_labels(base):
    """The pseudo-label loss is 0 when no weak prediction reaches the threshold, and positive
    with every one kept; the strong view cuts the same square out of pre and post."""
    import torch

    from local_damage.adapt.network import load_network, split_network
    from local_damage.adapt.semi import Unlabelled, strong_view

    net, _ = load_network(base.with_suffix(".safetensors"))
    trunk, top, _ = split_network(net, 1)
    rng = np.random.default_rng(0)
    chips = rng.integers(0, 255, (6, 64, 64, 3), dtype=np.uint8)
    unl = Unlabelled(trunk, chips, chips[::-1].copy(), 32)
    gen = torch.Generator().manual_seed(0)
    loss, share = unl.loss(net, top, 8, gen, confidence=1.01)
    assert share == 0.0 and float(loss.detach()) == 0.0
    loss, share = unl.loss(net, top, 8, gen, confidence=0.0)
    assert share == 1.0 and float(loss.detach()) > 0.0
    x = torch.ones(3, 3, 16, 16) * 5.0
    s_pre, s_post = strong_view(x, x.clone(), torch.Generator().manual_seed(1))
    assert torch.equal(s_pre == 0, s_post == 0) and bool((s_pre == 0).any())
    assert not torch.allclose(s_pre, x)


def test_without_torch_the_error_says_how_to_install(base, chips, tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec

    def no_torch(name, *args, **kwargs):
        return None if name.split(".")[0] == "torch" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", no_torch)
    out = tmp_path / "x.onnx"
    assert run_cli("adapt", "--model", base, "--chips", chips, "--finetune", "--out", out) == 2
    err = capsys.readouterr().err
    assert "needs PyTorch" in err and "pip install" in err and "torch>=2.4" in err
    assert not out.exists()

    from cli.score import finetuner

    assert finetuner() is None  # the app greys the box out and says how to install


def test_the_app_fine_tunes_through_the_function_the_command_gives_it():
    """`local-damage app` hands the app :func:`cli.adapt.finetune_model` when PyTorch is here;
    the app's packages never import torch or local_damage themselves (test_architecture)."""
    from cli.adapt import finetune_model
    from cli.score import finetuner

    assert finetuner() is finetune_model


@pytest.mark.slow
def test_finetune_tells_the_analyst_what_happened(base, chips, tmp_path, capsys):
    """`adapt --finetune` prints the heads' summary (candidates, what was kept), the held-out
    curve over epochs with the reason, and the same block as JSON with --json."""
    import json

    out = tmp_path / "told.onnx"
    argv = ["adapt", "--model", base, "--chips", chips, "--finetune", "--out", out, "--json"]
    assert run_cli(*argv) == 0
    captured = capsys.readouterr()
    block = json.loads(captured.out)
    assert block["method"] in ("finetune", "base") and "curve" in block["cv"]
    err = captured.err
    assert "cross-validation (" in err and "<- chosen" in err
    assert "held-out curve over epochs" in err and "epoch  0" in err
    assert "kept:" in err and f"wrote {out}" in err
    if block.get("finetune", {}).get("choice", {}).get("best_epoch"):
        # the macro-F1 gain over the labels and its spread, which the rule weighed
        assert "out-of-fold macro-F1" in err and "bootstrap se" in err
    assert "probabilities recalibrated on the labels" in err or "probabilities kept as" in err
    assert len([ln for ln in err.splitlines() if ln.strip().startswith("epoch ")]) == len(
        block["cv"]["curve"]
    )


@pytest.fixture(scope="module")
def many(base, tmp_path_factory):
    """A few hundred labelled buildings of new synthetic tiles (another seed): a new tile set of
    the event the base model saw a few dozen buildings of."""
    from app.adapt.labelled import from_chip_store
    from data_prep.spec import ChipSpec
    from data_prep.synthetic import make_xbd
    from data_prep.xbd import prepare_xbd
    from runtime.predictor import Predictor

    root = tmp_path_factory.mktemp("many")
    make_xbd(root / "xbd", seed=7, n_tiles=6, size=512)
    spec = ChipSpec(chip_size=64, min_size=32)
    prepare_xbd([root / "xbd"], root / "chips", spec=spec, progress=False)
    return from_chip_store(root / "chips", Predictor(base).class_names)


@pytest.mark.slow
def test_a_few_hundred_labels_do_not_make_the_others_worse(base, many):
    """Half of a few hundred labelled buildings fine-tune the network (linear probing, then the
    block at a tenth of the head's rate on a cosine decay, plain cross-entropy); the other half,
    never seen, is graded no worse than by the base network."""
    from sklearn.metrics import f1_score

    from local_damage.adapt.finetune import finetune, input_size, weights_beside
    from local_damage.adapt.network import predict
    from runtime.predictor import Predictor

    store = many
    rng = np.random.default_rng(1)
    rows = rng.permutation(np.flatnonzero(store.labelled))
    tr, te = rows[: len(rows) // 2], rows[len(rows) // 2 :]
    assert len(tr) >= 100, f"{len(rows)} labelled buildings: too few for this test"
    r = finetune(weights_beside(base), store.pre[tr], store.post[tr], store.labels[tr])
    y = store.labels[te]
    old = Predictor(base).predict(store.pre[te], store.post[te]).logits.argmax(1)
    new = predict(r.net, store.pre[te], store.post[te], input_size(r.config, 64)).argmax(1)
    assert np.mean(new == y) >= np.mean(old == y) - 0.01
    assert f1_score(y, new, average="macro") >= f1_score(y, old, average="macro") - 0.01
    # the curve the epochs were chosen on: no swing below the base network's accuracy
    kept = r.curve[r.epochs]
    assert kept["accuracy"] >= r.curve[0]["accuracy"]


@pytest.mark.slow
def test_the_block_has_its_own_rate(base, store):
    """The classifier trains at ``lr`` and the encoder block at ``lr * encoder_lr``: with a
    block rate of 0 only the classifier moves."""
    import torch

    from local_damage.adapt.finetune import FinetuneOptions, input_size, train_top
    from local_damage.adapt.network import (
        load_network,
        prepare_chips,
        split_network,
        trunk_features,
    )

    net, config = load_network(base.with_suffix(".safetensors"))
    trunk, _, _ = split_network(net, 1)
    before = {n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad}
    size = input_size(config, store.pre.shape[1])
    pre, post = prepare_chips(store.pre[:16], size), prepare_chips(store.post[:16], size)
    feats = trunk_features(trunk, pre, post)
    options = FinetuneOptions(blocks=1, probe_epochs=0, cosine=False, encoder_lr=0.0)
    train_top(net, feats, store.labels[:16], 1, options, 0)
    moved = {n for n, p in net.named_parameters() if n in before and not torch.equal(p, before[n])}
    assert moved and all(n.startswith("classifier") for n in moved)  # rate 0: the block stays


@pytest.mark.slow
def test_the_app_panel_says_what_fine_tuning_kept_and_why(base, score_model, tmp_path):
    """Adapt in the app with "Fine-tune the network": the panel says which network was kept
    and shows the held-out curve with the reason, as `adapt --finetune` prints them."""
    import json

    from app.web.adapt_panel import adapt_to_event
    from app.web.app import assess_tile, save_correction
    from cli.adapt import finetune_model
    from data_prep.synthetic import tile_name
    from runtime.predictor import Predictor

    predictor = Predictor(base)
    xbd = score_model.parent / "xbd"
    name = tile_name(0)
    label = xbd / "labels" / f"{name}_post_disaster.json"
    pre = next((xbd / "images").glob(f"{name}_pre_disaster.*"))
    post = next((xbd / "images").glob(f"{name}_post_disaster.*"))
    work = tmp_path / "work"
    result = assess_tile(predictor, pre, post, label, work / "sessions" / "20260101-000001")
    truth = {
        f["properties"]["uid"]: f["properties"].get("subtype", "")
        for f in json.loads(label.read_text())["features"]["xy"]
    }
    for r in result.rows:
        if r["status"] == "scored" and truth.get(r["uid"]) in predictor.class_names:
            save_correction(result.session, r["#"], truth[r["uid"]])

    done = adapt_to_event(predictor, work, result.session, finetuner=finetune_model)
    status, block = done.status(), done.block
    curve = block["cv"]["curve"]
    assert "held-out curve over epochs" in status and "kept:" in status
    assert len([ln for ln in status.splitlines() if ln.strip().startswith("epoch ")]) == len(curve)
    if block["finetune"]["epochs"]:
        assert f"network fine-tuned: **{block['finetune']['epochs']} epoch(s)**" in status
    else:
        assert "the base network was kept" in status and "0 epoch(s)" not in status


def test_threads_below_one_is_refused_before_any_work(base, chips, tmp_path, capsys):
    out = tmp_path / "x.onnx"
    argv = ["adapt", "--model", base, "--chips", chips, "--finetune", "--out", out]
    assert run_cli(*argv, "--threads", "0") == 2
    assert "--threads must be at least 1, got 0" in capsys.readouterr().err
    assert not out.exists()


def test_trunk_features_are_those_of_the_default_layout():
    """The frozen trunk runs channels-last for speed: its features are the default layout's (up
    to float rounding), and the network is left in the default layout."""
    import torch

    from local_damage.adapt.network import trunk_features

    torch.manual_seed(0)
    trunk = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3, stride=2)
    ).eval()
    pre, post = torch.rand(5, 3, 16, 16), torch.rand(5, 3, 16, 16)
    feats = trunk_features(trunk, pre, post, turns=range(2), batch=2)
    with torch.no_grad():
        expected = torch.stack([trunk(pre), trunk(post)])
    assert feats.shape == (2, 2, 5, 4, 7, 7)
    torch.testing.assert_close(feats[0], expected, rtol=1e-5, atol=1e-5)
    assert all(p.is_contiguous() for p in trunk.parameters())


@pytest.mark.slow
def test_finetuning_is_judged_under_the_models_own_rule(base, chips, store, tmp_path, capsys):
    """A base model whose card carries a grade rule has the fine-tuning's curve computed on the
    grades that rule gives: with a cost so high that every building is graded no-damage, the
    base network's cross-validated accuracy is the share of intact labels and its intact recall
    1, and the rule is kept in the model written."""
    import json

    import onnx

    from runtime.contract import save_onnx, set_metadata
    from runtime.predictor import Predictor

    plain = Predictor(base).predict(store.pre, store.post).probabilities.argmax(1)
    assert (plain != 0).any(), "the fixture model grades every label no-damage: nothing to test"
    proto = onnx.load(str(base))
    set_metadata(proto, {"grade_rule": {"false_alarm_cost": 1e6}})
    careful = save_onnx(proto, tmp_path / "careful.onnx")
    shutil.copy(base.with_suffix(".safetensors"), tmp_path / "careful.safetensors")
    out = tmp_path / "tuned.onnx"
    argv = ["adapt", "--model", careful, "--chips", chips, "--finetune", "--out", out, "--json"]
    assert run_cli(*argv) == 0
    block = json.loads(capsys.readouterr().out)
    first = block["cv"]["curve"][0]
    y = store.labels
    assert first["accuracy"] == pytest.approx(float(np.mean(y == 0)), abs=1e-6)
    assert first["intact_recall"] == 1.0
    assert Predictor(out).false_alarm_cost == 1e6
