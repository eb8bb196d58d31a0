"""`local-damage export`: graph contract, metadata, parity with PyTorch, int8 / fp16 reports."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data_prep.spec import CLASS_NAMES


@pytest.fixture(scope="module")
def tiny_run(score_model) -> Path:
    """The run folder behind the shared tiny exported model (resnet18, 32 px, 1 epoch)."""
    run = score_model.parent / "run"
    assert (run / "best.safetensors").is_file(), f"{run}: expected a trained run folder"
    return run


@pytest.fixture(scope="module")
def exported(tiny_run, tmp_path_factory):
    """(model path, report) of an fp32 export made through the CLI."""
    from cli.main import main

    out = tmp_path_factory.mktemp("export") / "models" / "tiny.onnx"
    assert main(["export", "--run", str(tiny_run), "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".parity.json").read_text())
    return out, report


def _props(path: Path) -> dict:
    import onnx

    proto = onnx.load(str(path))
    return {p.key: json.loads(p.value) for p in proto.metadata_props}


@pytest.mark.slow
def test_graph_inputs_outputs_and_dynamic_batch(exported, tiny_run):
    import onnx
    import yaml

    path, _ = exported
    size = yaml.safe_load((tiny_run / "config.yaml").read_text())["data"]["input_size"]
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    inputs = {i.name: i.type.tensor_type for i in proto.graph.input}
    assert sorted(inputs) == ["post", "pre"]
    for t in inputs.values():
        assert t.elem_type == onnx.TensorProto.UINT8
        dims = [d.dim_param or d.dim_value for d in t.shape.dim]
        assert isinstance(dims[0], str) and dims[1:] == [size, size, 3]
    assert [o.name for o in proto.graph.output] == ["logits", "embedding"]

    from runtime.contract import CPU_ONLY, open_session

    session = open_session(path, CPU_ONLY)[0]
    rng = np.random.default_rng(3)
    for n in (1, 5):
        pre = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
        post = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
        logits, emb = session.run(None, {"pre": pre, "post": post})
        assert logits.shape == (n, len(CLASS_NAMES)) and logits.dtype == np.float32
        assert emb.shape[0] == n
        np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)


def test_metadata_carries_run_facts(exported, tiny_run):
    import csv

    import yaml

    path, report = exported
    props = _props(path)
    summary = json.loads((tiny_run / "summary.json").read_text())
    config = yaml.safe_load((tiny_run / "config.yaml").read_text())
    assert props["class_names"] == list(CLASS_NAMES)
    assert props["chip_spec"] == summary["chip_spec"]
    assert props["input_size"] == config["data"]["input_size"]
    assert props["embedding_dim"] == config["model"]["embed_dim"]
    assert props["config"] == config
    assert props["precision"] == "fp32"
    assert props["format_version"] == 1
    assert props["created_by"].startswith("local-damage ")
    vm = props["validation_metrics"]
    assert vm["fold"] == summary["fold"] == 0
    assert vm["macro_f1"] == pytest.approx(summary["best_val_macro_f1"])
    with open(tiny_run / "metrics.csv", newline="") as fh:
        best = [r for r in csv.DictReader(fh) if int(r["epoch"]) == summary["best_epoch"]][0]
    assert vm["accuracy"] == pytest.approx(float(best["val_accuracy"]))
    td = props["training_data"]
    assert td["events"] == summary["events"]
    assert td["chips"] == summary["chips"]
    assert "synthetic" in td["source"] and "credit" not in td
    assert props["license"] is None  # synthetic imagery: no third-party terms
    assert props["parity"] == report


def test_xbd_training_data_carries_its_licence():
    from local_damage.export.provenance import XBD_CREDIT, training_data_info

    info, licence = training_data_info(
        {"source": "xbd"}, ["santa-rosa-wildfire", "joplin-tornado"], "/data/chips", 100
    )
    assert licence == "CC BY-NC-SA 4.0"
    assert info["credit"] == XBD_CREDIT and "Gupta" in info["credit"]
    assert info["events"] == ["joplin-tornado", "santa-rosa-wildfire"]
    info, licence = training_data_info({"source": "xbd"}, ["synthetic-flood"], None, 3)
    assert licence is None and "credit" not in info
    info, licence = training_data_info({"source": "scene"}, ["joplin"], None, 3)
    assert licence is None and info["source"] == "scene"


def test_parity_with_pytorch_computed_independently(exported, tiny_run):
    """ONNX Runtime on the validation chips against the run's model in plain PyTorch."""
    import onnxruntime as ort
    import torch

    from data_prep.split import fold_indices
    from local_damage.config import load_yaml
    from local_damage.data import ChipPairDataset, normalize
    from local_damage.models import build_model
    from local_damage.train.checkpoint import load_weights
    from local_damage.train.config import Config
    from local_damage.train.loop import model_config_for

    path, report = exported
    cfg = load_yaml(Config, tiny_run / "config.yaml")
    model = build_model(model_config_for(cfg)).eval()
    load_weights(model, tiny_run / "best.safetensors")
    chips = json.loads((tiny_run / "summary.json").read_text())["chips"]
    _, val_ids = fold_indices(chips, 0)
    ds = ChipPairDataset(chips, val_ids, cfg.data.input_size, augment=False)
    pre = torch.stack([ds[i][0] for i in range(len(ds))])  # uint8 [N, 3, S, S]
    post = torch.stack([ds[i][1] for i in range(len(ds))])
    with torch.no_grad():
        t_logits, t_z = model.predict(normalize(pre), normalize(post))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    o_logits, o_z = session.run(
        None,
        {
            "pre": pre.permute(0, 2, 3, 1).contiguous().numpy(),
            "post": post.permute(0, 2, 3, 1).contiguous().numpy(),
        },
    )
    diff = np.abs(o_logits - t_logits.numpy()).max()
    assert diff <= 1e-4
    np.testing.assert_allclose(o_z, t_z.numpy(), atol=1e-4)
    assert report["chips"]["count"] == len(ds)
    assert report["fp32"]["max_abs_logit_diff_vs_pytorch"] <= 1e-4
    assert report["fp32"]["max_abs_logit_diff_vs_pytorch"] == pytest.approx(diff, abs=1e-5)


#: Bounds on the int8 and fp16 exports of the tiny fixture run against its fp32 export, on its 11
#: validation chips. Measured: largest logit difference 0.0031 (int8) and 5.2e-5 (fp16), argmax
#: agreement 1.0 for both. The logits of this one-epoch model move little with the input (int8
#: calibrated on blank chips differs by 0.013; the fp16 model fed pre and post swapped, by 0.015),
#: so the logit bound is what tells a sound export from a broken one; agreement is loose (one chip
#: of the 11 may change class).
LOW_PRECISION_BOUNDS = {"int8": (10 / 11, 0.01), "fp16": (10 / 11, 1e-3)}


@pytest.mark.slow
def test_int8_and_fp16_exports_report_agreement(tiny_run, tmp_path):
    import onnx

    from local_damage.export.model import export_run
    from local_damage.export.options import ExportOptions

    for kwargs, name in (({"quantize": "int8"}, "int8"), ({"fp16": True}, "fp16")):
        out = tmp_path / f"tiny-{name}.onnx"
        report = export_run(tiny_run, out, ExportOptions(**kwargs))
        v = report[name]
        agreement, logit_diff = LOW_PRECISION_BOUNDS[name]
        assert report["chips"]["count"] == 11
        assert v["argmax_agreement_with_fp32"] >= agreement - 1e-9, v
        assert 0.0 < v["max_abs_logit_diff_vs_fp32"] <= logit_diff, v
        assert v["meets_target"] == (v["argmax_agreement_with_fp32"] >= 0.99)
        assert v["macro_f1_diff_vs_fp32"] == pytest.approx(
            v["macro_f1"] - report["fp32"]["macro_f1"], abs=1e-5
        )
        assert json.loads(out.with_suffix(".parity.json").read_text()) == report
        proto = onnx.load(str(out))
        props = {p.key: json.loads(p.value) for p in proto.metadata_props}
        assert props["precision"] == name and props["parity"][name] == v
        assert props["class_names"] == list(CLASS_NAMES)
        inputs = {i.name: i.type.tensor_type.elem_type for i in proto.graph.input}
        assert inputs == {"pre": onnx.TensorProto.UINT8, "post": onnx.TensorProto.UINT8}
        ops = {n.op_type for n in proto.graph.node}
        if name == "int8":
            assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
        else:
            types = {t.data_type for t in proto.graph.initializer}
            assert onnx.TensorProto.FLOAT16 in types
            outputs = {o.name: o.type.tensor_type.elem_type for o in proto.graph.output}
            assert outputs["logits"] == onnx.TensorProto.FLOAT


@pytest.mark.slow
def test_parity_failure_writes_nothing(tiny_run, tmp_path, monkeypatch):
    from local_damage.export import model as export
    from local_damage.export import parity

    monkeypatch.setattr(parity, "LOGIT_TOLERANCE", -1.0)  # no difference can pass
    out = tmp_path / "never.onnx"
    with pytest.raises(export.ExportError, match="differ from PyTorch"):
        export.export_run(tiny_run, out)
    assert not out.exists() and not out.with_suffix(".parity.json").exists()
    assert list(tmp_path.iterdir()) == []


def test_bad_runs_give_clear_errors(tiny_run, tmp_path, capsys):
    from cli.main import main
    from local_damage.export.model import export_run
    from local_damage.export.options import ExportError, ExportOptions

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", "--run", str(empty), "--out", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert "config.yaml" in err and str(empty) in err
    with pytest.raises(ExportError, match="--chips"):
        export_run(tiny_run, tmp_path / "m.onnx", ExportOptions(chips=tmp_path / "no-store"))
    with pytest.raises(ExportError, match=r"\.onnx"):
        export_run(tiny_run, tmp_path / "m.bin")
    assert not (tmp_path / "m.onnx").exists()


def test_fp16_weights_fine_tune_into_the_same_model(tiny_run, tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from local_damage.config import load_yaml
    from local_damage.export.weights import export_weights
    from local_damage.models import build_model
    from local_damage.train.checkpoint import load_weights, resolve_weights
    from local_damage.train.config import Config
    from local_damage.train.loop import model_config_for

    out = export_weights(tiny_run, tmp_path / "w.safetensors")
    full = load_file(str(resolve_weights(tiny_run)))
    half = load_file(str(out))
    assert half.keys() == full.keys()
    assert out.stat().st_size < 0.6 * resolve_weights(tiny_run).stat().st_size
    for key, value in full.items():
        if value.is_floating_point():
            assert half[key].dtype == torch.float16
            torch.testing.assert_close(half[key].float(), value, rtol=1e-3, atol=1e-4)
        else:
            assert torch.equal(half[key], value)
    with safe_open(str(out), "pt") as f:
        assert "encoder" in f.metadata()["config"]
    cfg = load_yaml(Config, tiny_run / "config.yaml")
    model = build_model(model_config_for(cfg))
    assert load_weights(model, out) == ([], [])
    assert next(model.parameters()).dtype == torch.float32


@pytest.mark.slow
def test_test_metrics_travel_into_the_model_card(tiny_run, tmp_path):
    import json

    from app.web.app import card_markdown
    from cli.main import main
    from local_damage.export.model import export_run
    from local_damage.export.options import ExportError, ExportOptions
    from local_damage.export.provenance import summarize_test_metrics
    from runtime.predictor import Predictor

    evaluated = tmp_path / "eval"
    argv = ["evaluate", "--run", str(tiny_run), "--chips", str(tiny_run.parent / "chips")]
    assert main([*argv, "--fold", "0", "--out", str(evaluated), "--no-tsne", "--quiet"]) == 0
    metrics = json.loads((evaluated / "metrics.json").read_text())
    model = tmp_path / "m.onnx"
    export_run(
        tiny_run, model, ExportOptions(parity_limit=8, test_metrics=evaluated / "metrics.json")
    )
    card = Predictor(model).card()
    assert card["test_metrics"]["accuracy"] == metrics["accuracy"]
    assert card["test_metrics"]["n"] == metrics["n"]
    assert set(card["test_metrics"]["f1"]) == set(metrics["per_class"])
    text = card_markdown(Predictor(model))
    # evaluated on the validation fold: none of its tiles is a training tile
    tiles = len(metrics["source"]["tiles"])
    assert f"held-out test ({metrics['n']} buildings, {tiles} tiles, none in the model's" in text
    assert f"macro-F1 {metrics['macro_f1']:.4f}" in text

    # out-of-fold figures carried by a model with its own false-alarm cost are those of its grades
    from data_prep.spec import CLASS_NAMES
    from local_damage.experiments.cv_report import OOF_METRICS, protocol_summary

    chips = tiny_run.parent / "chips"
    protocol_summary({0: evaluated}, chips, list(CLASS_NAMES), tmp_path / "oof")
    strict = tmp_path / "strict.onnx"
    options = ExportOptions(
        parity_limit=8, test_metrics=tmp_path / "oof" / OOF_METRICS, false_alarm_cost=100.0
    )
    export_run(tiny_run, strict, options)
    tested = Predictor(strict).card()["test_metrics"]
    assert tested["cross_validation"]["false_alarm_cost"] == 100.0
    expected = summarize_test_metrics(tmp_path / "oof" / OOF_METRICS, list(CLASS_NAMES), 100.0)
    assert tested["accuracy"] == pytest.approx(expected["accuracy"])
    assert "graded at false-alarm cost 100, the model's own rule" in card_markdown(
        Predictor(strict)
    )

    with pytest.raises(ExportError, match="not found"):
        summarize_test_metrics(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ExportError, match="bad.json: no accuracy"):
        summarize_test_metrics(bad)


@pytest.mark.slow
def test_the_grade_rule_comes_from_the_run_or_the_command_line(exported, tiny_run, tmp_path):
    """`export` writes the run's grade.false_alarm_cost as the model's own rule (metadata
    ``grade_rule``), or the one given with --false-alarm-cost, and the predictor reads it."""
    from cli.main import main
    from runtime.predictor import Predictor

    path, _ = exported
    assert _props(path)["grade_rule"] == {
        "false_alarm_cost": 1.0,
        "rule": "the most probable grade",
    }
    out = tmp_path / "careful.onnx"
    argv = ["export", "--run", str(tiny_run), "--out", str(out), "--parity-chips", "8"]
    assert main([*argv, "--false-alarm-cost", "2.5"]) == 0
    rule = _props(out)["grade_rule"]
    assert rule["false_alarm_cost"] == 2.5 and "2.5 times" in rule["rule"]
    assert Predictor(out).false_alarm_cost == 2.5
    assert Predictor(out).card()["grade_rule"] == rule
    with pytest.raises(SystemExit):
        main([*argv, "--false-alarm-cost", "0"])
