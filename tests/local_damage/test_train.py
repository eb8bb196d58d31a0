"""Training: config handling, determinism, exact resume, fine-tuning, run folder, DDP replicas."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from cli.main import main
from local_damage.config import ConfigError, load_yaml
from local_damage.train.config import Config
from local_damage.train.loaders import ChipSplit
from local_damage.train.loop import train
from tests.conftest import TINY_TRAIN

TINY = [*TINY_TRAIN, "train.max_steps_per_epoch=3", "optim.schedule=constant"]


@pytest.fixture(scope="module")
def chips(synthetic_xbd, tmp_path_factory) -> Path:
    from data_prep.split import make_splits
    from data_prep.xbd import prepare_xbd

    out = tmp_path_factory.mktemp("chips")
    prepare_xbd([synthetic_xbd], out, progress=False)
    make_splits(out, folds=3, seed=0, verbose=False)
    return out


def tiny(*extra: str) -> Config:
    return load_yaml(Config, None, [*TINY, *extra])


def test_yaml_unknown_key_and_bad_value_are_clear_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: 2\n  batch_sise: 8\n")
    with pytest.raises(ConfigError, match="batch_sise"):
        load_yaml(Config, bad)
    with pytest.raises(ConfigError, match="train.epochs"):
        load_yaml(Config, None, ["train.epochs=many"])
    with pytest.raises(ConfigError, match="unknown key"):
        load_yaml(Config, None, ["model.nope=1"])
    assert (
        main(
            ["train", "--config", str(bad), "--chips", str(tmp_path), "--out", str(tmp_path / "r")]
        )
        == 2
    )
    assert "batch_sise" in capsys.readouterr().err


@pytest.mark.slow
def test_run_folder_holds_what_later_steps_need(chips, tmp_path):
    run = tmp_path / "run"
    summary = train(tiny("train.epochs=2"), chips, run, ChipSplit(fold=0), progress=False)
    for name in ("config.yaml", "best.safetensors", "metrics.csv", "summary.json", "curves.png"):
        assert (run / name).is_file(), name
    assert (run / "checkpoints" / "last" / "model.safetensors").is_file()
    saved = load_yaml(Config, run / "config.yaml")
    assert saved.model.encoder == "resnet18" and saved.train.epochs == 2
    metrics = pd.read_csv(run / "metrics.csv")
    assert list(metrics["epoch"]) == [0, 1]
    assert metrics["val_macro_f1"].between(0, 1).all() and (metrics["peak_memory_mb"] > 0).all()
    assert np.isfinite(metrics["train_loss"]).all()
    geometry = [
        "train_max_abs_cos",
        "val_max_abs_cos",
        "train_mean_offdiag_cos",
        "val_mean_offdiag_cos",
    ]
    assert metrics[geometry].notna().all().all() and metrics[geometry].abs().le(1.0).all().all()
    assert (metrics[["train_max_abs_cos", "val_max_abs_cos"]] >= 0).all().all()
    assert summary["chip_spec"]["chip_size"] == 128
    on_disk = json.loads((run / "summary.json").read_text())
    assert on_disk["best_epoch"] == summary["best_epoch"]
    assert on_disk["best_val_macro_f1"] == pytest.approx(metrics["val_macro_f1"].max())


@pytest.mark.slow
def test_validation_geometry_is_that_of_the_kept_model(chips, tmp_path):
    # The last epoch's val_* geometry columns are the class-mean Gram of the validation chips'
    # embeddings under the weights that epoch ends with (kept as best.safetensors by "last").
    from data_prep.split import fold_indices
    from local_damage.evaluation.torch_scorer import TorchScorer
    from runtime.metrics import class_mean_gram, gram_summary, unit_rows

    run = tmp_path / "run"
    train(tiny("train.epochs=1", "train.keep=last"), chips, run, ChipSplit(fold=0), progress=False)
    last = pd.read_csv(run / "metrics.csv").iloc[-1]
    val_ids = fold_indices(chips, 0)[1]
    scored = TorchScorer(run, device="cpu").score(chips, val_ids)
    unit, directed = unit_rows(scored.z)
    keep = directed & (scored.labels >= 0)
    assert keep.sum() >= 2
    want = gram_summary(class_mean_gram(unit[keep], scored.labels[keep], 4)[0])
    assert last["val_max_abs_cos"] == pytest.approx(want["max_abs_cos"], abs=1e-4)
    assert last["val_mean_offdiag_cos"] == pytest.approx(want["mean_offdiag_cos"], abs=1e-4)


@pytest.mark.slow
def test_keep_last_evaluates_the_last_epoch_not_the_best(chips, tmp_path):
    # With a zero learning rate every epoch validates the same: "best" keeps the first epoch
    # (no strict improvement after it), "last" the final one, as a run without validation would.
    runs = {}
    for keep in ("best", "last"):
        run = tmp_path / keep
        runs[keep] = train(
            tiny("train.epochs=3", "optim.lr=0.0", f"train.keep={keep}"),
            chips,
            run,
            ChipSplit(fold=0),
            progress=False,
        )
    assert runs["best"]["best_epoch"] == 0
    assert runs["last"]["best_epoch"] == 2
    best = load_file(tmp_path / "last" / "best.safetensors")
    last = load_file(tmp_path / "last" / "checkpoints" / "last" / "model.safetensors")
    assert best.keys() == last.keys()
    assert all(torch.equal(best[k], last[k]) for k in best)
    with pytest.raises(ValueError, match="train.keep"):
        tiny("train.keep=first")


@pytest.mark.slow
def test_holdout_chips_are_left_out_of_training(chips, tmp_path, capsys):
    from cli.main import main
    from data_prep.split import load_splits

    run = tmp_path / "run"
    argv = ["train", "--chips", str(chips), "--out", str(run), "--holdout", "2", "--quiet"]
    for item in [*TINY, "train.epochs=1"]:
        argv += ["--set", item]
    assert main(argv) == 0
    summary = json.loads((run / "summary.json").read_text())
    splits = load_splits(chips)
    assert summary["holdout"] == 2 and summary["val_chips"] == 0
    assert summary["train_chips"] == int((splits["fold"] != 2).sum())
    assert "without validation" in capsys.readouterr().err


@pytest.mark.slow
def test_balanced_sampling_does_not_weight_the_loss_twice(chips, tmp_path):
    from data_prep.store import read_manifest

    labels = read_manifest(chips)["label"]
    present = sorted(set(labels[labels >= 0]))
    plain = train(tiny("train.epochs=1"), chips, tmp_path / "plain", progress=False)
    assert len(set(np.round(plain["class_weights"], 6))) > 1  # skewed data: unequal weights
    balanced = train(
        tiny("train.epochs=1", "data.balanced_sampling=true"),
        chips,
        tmp_path / "balanced",
        progress=False,
    )
    expected = [1.0 if c in present else 0.0 for c in range(len(balanced["class_weights"]))]
    assert balanced["class_weights"] == pytest.approx(expected)


@pytest.mark.slow
def test_same_seed_same_first_epoch_loss(chips, tmp_path):
    losses = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        train(tiny(f"train.seed={seed}"), chips, tmp_path / name, ChipSplit(fold=0), progress=False)
        losses.append(pd.read_csv(tmp_path / name / "metrics.csv")["train_loss"].iloc[0])
    assert losses[0] == losses[1]
    assert losses[0] != losses[2]


@pytest.mark.slow
def test_resume_continues_exactly(chips, tmp_path):
    straight = tmp_path / "straight"
    train(tiny("train.epochs=2"), chips, straight, ChipSplit(fold=0), progress=False)
    split = tmp_path / "split"
    train(tiny("train.epochs=1"), chips, split, ChipSplit(fold=0), progress=False)
    argv = ["train", "--chips", str(chips), "--out", str(split), "--fold", "0", "--resume"]
    assert main([*argv, "--set", "train.epochs=2", "--quiet"]) == 0
    a = load_file(str(straight / "checkpoints/last/model.safetensors"))
    b = load_file(str(split / "checkpoints/last/model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)
    la = pd.read_csv(straight / "metrics.csv")["train_loss"].to_numpy()
    lb = pd.read_csv(split / "metrics.csv")["train_loss"].to_numpy()
    np.testing.assert_allclose(la, lb, rtol=1e-6)


@pytest.mark.slow
def test_init_with_frozen_encoder_keeps_encoder_and_trains_heads(chips, tmp_path):
    base = tmp_path / "base"
    train(tiny(), chips, base, ChipSplit(fold=0), progress=False)
    tuned = tmp_path / "tuned"
    train(
        tiny("train.freeze_encoder_epochs=1"),
        chips,
        tuned,
        ChipSplit(fold=0),
        init=base,
        progress=False,
    )
    a = load_file(str(base / "best.safetensors"))
    b = load_file(str(tuned / "checkpoints/last/model.safetensors"))
    encoder = [k for k in a if k.startswith("encoder.")]
    heads = [
        k for k in a if k.startswith(("classifier", "projection")) and a[k].is_floating_point()
    ]
    assert encoder and heads
    for key in encoder:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
    assert any(not torch.equal(a[k], b[k]) for k in heads)


def test_encoder_learning_rate_share_makes_two_groups_that_the_schedule_scales_alike():
    """``optim.encoder_lr_scale``: the encoder's parameters in a group of their own at that share
    of ``optim.lr``, every other parameter at ``lr``; the schedule keeps the ratio; at 0 a step
    leaves the encoder as it was and moves the rest."""
    from local_damage.models.local_net import build_model
    from local_damage.train.loop import build_optimizer, model_config_for

    cfg = tiny(
        "optim.lr=0.01", "optim.encoder_lr_scale=0.1", "optim.schedule=cosine", "train.epochs=4"
    )
    model = build_model(model_config_for(cfg))
    opt, schedule = build_optimizer(cfg, model)
    head, encoder = opt.param_groups
    assert head["lr"] == pytest.approx(0.01) and encoder["lr"] == pytest.approx(0.001)
    n_encoder = sum(1 for _ in model.encoder.parameters())
    assert len(encoder["params"]) == n_encoder
    assert len(head["params"]) + n_encoder == sum(1 for _ in model.parameters())
    opt.step()  # no gradients yet: nothing moves
    schedule.step()
    assert 0 < head["lr"] < 0.01
    assert encoder["lr"] / head["lr"] == pytest.approx(0.1)
    assert len(build_optimizer(tiny(), model)[0].param_groups) == 1  # the default: one group

    frozen = tiny("optim.encoder_lr_scale=0", "optim.weight_decay=0")
    opt, _ = build_optimizer(frozen, model)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    model.train()
    x = torch.rand(4, 3, 32, 32)
    model(x, x.flip(-1)).logits.sum().backward()
    opt.step()
    moved = [k for k, v in model.named_parameters() if not torch.equal(before[k], v)]
    assert moved and not any(k.startswith("encoder.") for k in moved)


def test_encoder_learning_rate_share_outside_zero_to_one_is_refused():
    with pytest.raises(ConfigError, match="encoder_lr_scale"):
        tiny("optim.encoder_lr_scale=2")


def test_init_from_missing_run_is_a_clear_error(chips, tmp_path, capsys):
    argv = [
        "train",
        "--chips",
        str(chips),
        "--out",
        str(tmp_path / "r"),
        "--init",
        str(tmp_path / "none"),
    ]
    assert main([*argv, "--set", "train.epochs=1", "--quiet"]) == 2
    assert "none" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        ("train.amp=bf16",),
        ("model.gradient_checkpointing=true", "model.channels_last=true"),
        ("loss.method=scl", "data.balanced_sampling=true"),
        ("loss.method=ce", "optim.optimizer=sgd", "optim.schedule=step"),
        ("loss.normalize_z=false", "model.latent_abs=true", "loss.beta=0.01"),
    ],
)
def test_memory_options_and_methods_train(chips, tmp_path, options):
    summary = train(
        tiny("train.max_steps_per_epoch=1", *options),
        chips,
        tmp_path / "r",
        ChipSplit(fold=0),
        progress=False,
    )
    assert np.isfinite(pd.read_csv(tmp_path / "r" / "metrics.csv")["train_loss"]).all()
    if "loss.method=scl" in options:  # the SCL baseline has no latent module
        assert summary["config"]["loss"]["method"] == "scl"
        assert not any(
            k.startswith("latent") for k in load_file(str(tmp_path / "r" / "best.safetensors"))
        )


@pytest.mark.slow
def test_ddp_two_cpu_processes_keep_identical_replicas(chips, tmp_path):
    run = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [
        "-m",
        "cli.main",
        "train",
        "--chips",
        str(chips),
        "--out",
        str(run),
        "--fold",
        "0",
        "--quiet",
    ]
    for item in TINY:
        cmd += ["--set", item]
    cmd += [
        "--set",
        "train.max_steps_per_epoch=2",
        "--set",
        "train.epochs=2",
        "--set",
        "train.batch_size=2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2
    a, b = summary["replica_checksums"]
    assert a == b
    assert np.isfinite(pd.read_csv(run / "metrics.csv")["train_loss"]).all()


@pytest.mark.slow
def test_probe_separates_the_pull_of_each_term(chips, capsys):
    """The probe's gradients: the latent term's pull scales with beta, WCE's does not."""
    from local_damage.experiments.probe import probe

    full = probe(tiny(), chips, batches=2)
    small = probe(tiny("loss.beta=0.1"), chips, batches=2)
    assert set(full["terms"]) == {"wce", "contrastive_z", "contrastive_l"}
    assert small["terms"]["wce"]["grad_norm"] == pytest.approx(full["terms"]["wce"]["grad_norm"])
    assert small["terms"]["contrastive_l"]["grad_norm"] == pytest.approx(
        0.1 * full["terms"]["contrastive_l"]["grad_norm"], rel=1e-4
    )
    for term in full["terms"].values():
        assert term["grad_norm"] > 0 and -1.0 <= term["cos_with_wce"] <= 1.0
    scl = probe(tiny("loss.method=scl"), chips, batches=2)
    assert set(scl["terms"]) == {"wce", "contrastive_z"}
    counted = sum(c["n"] for c in full["per_class"].values())
    assert counted == 2 * int(tiny().train.batch_size)
    assert main(["probe", "--config", "missing.yaml", "--chips", str(chips)]) == 2
    assert "missing.yaml" in capsys.readouterr().err


_EPOCHS_SCRIPT = """
import json, sys, torch
from data_prep.store import read_manifest
from local_damage.config import load_yaml
from local_damage.train.config import Config
from local_damage.train.distributed import DistInfo
from local_damage.train.loaders import build_loaders, start_epoch

chips = sys.argv[1]
ids = read_manifest(chips)["chip_id"].tolist()[:8]
out = {}
for workers in (1, 0):  # the worker forks before this process has augmented anything
    sets = [f"data.num_workers={workers}", "data.augment=true", "train.batch_size=4"]
    cfg = load_yaml(Config, None, sets)
    loader = build_loaders(cfg, chips, ids, [], DistInfo(), torch.device("cpu")).train
    for epoch in (0, 1, 2):
        start_epoch(loader, epoch, cfg.train.seed, 0)
        pairs = [float(p[i].double().sum() + 3 * q[i].double().sum())
                 for p, q, _ in loader for i in range(len(p))]
        out[f"{workers},{epoch}"] = sorted(pairs)
print(json.dumps(out))
"""


def test_augmentation_changes_each_epoch_whatever_the_loader_workers(chips):
    """The epoch set before an epoch reaches the loader's persistent workers: with a worker,
    epoch 1's augmented pairs differ from epoch 0's and equal those made without a worker (a
    worker holding the dataset as it started would repeat epoch 0's augmentation for ever).
    Run in a fresh process, whose worker forks before any augmentation ran in its parent."""
    done = subprocess.run(
        [sys.executable, "-c", _EPOCHS_SCRIPT, str(chips)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    epochs = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(epochs["0,0"]) == 8
    for workers in (0, 1):
        assert epochs[f"{workers},1"] != epochs[f"{workers},0"]
        assert epochs[f"{workers},2"] != epochs[f"{workers},1"]
    for epoch in (0, 1, 2):
        assert epochs[f"1,{epoch}"] == pytest.approx(epochs[f"0,{epoch}"])
