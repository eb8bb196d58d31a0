"""`local-damage bench infer` on a tiny configuration: well-formed rows, table and JSON."""

from __future__ import annotations

import json

import pytest

ROW_KEYS = {
    "encoder",
    "runtime",
    "precision",
    "threads",
    "pairs_per_s",
    "ratio_vs_eager",
    "agreement_vs_eager",
    "max_abs_logit_diff_vs_eager",
    "input_size",
    "batch_size",
    "pairs",
    "models",
}


#: Bounds on an int8 row against PyTorch eager (the timed pairs: 8 of a random-init model, 16 of
#: the tiny trained run, int8 calibrated on 8 other chips). Measured: largest logit difference
#: 0.0034 (random init) and 0.0072 (trained), argmax agreement 1.0 on both. These models' logits
#: move little with the input (int8 calibrated on blank chips differs by 0.013-0.014), so the
#: logit bound is the one that tells; one pair in eight may change class. An fp16 row (on a GPU
#: only) is held to the same bounds.
INT8_AGREEMENT, INT8_LOGIT_DIFF = 7 / 8, 0.02


def _check_rows(rows, encoder, input_size, pairs, runtimes):
    assert [r["runtime"].split(" (")[0] for r in rows] == runtimes
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["encoder"] == encoder and r["input_size"] == input_size and r["pairs"] == pairs
        assert r["pairs_per_s"] > 0
        if r["precision"] != "fp32":
            assert r["agreement_vs_eager"] >= INT8_AGREEMENT, r
            assert 0.0 < r["max_abs_logit_diff_vs_eager"] <= INT8_LOGIT_DIFF, r
        else:  # fp32: the same model and arithmetic, the same class for every pair
            assert r["agreement_vs_eager"] == 1.0, r
    eager = rows[0]
    assert eager["ratio_vs_eager"] == 1.0 and eager["agreement_vs_eager"] == 1.0
    assert eager["max_abs_logit_diff_vs_eager"] == 0.0
    for r in rows[1:]:
        assert r["ratio_vs_eager"] == pytest.approx(
            r["pairs_per_s"] / eager["pairs_per_s"], rel=0.01
        )
    fp32 = [r for r in rows if r["runtime"].startswith("ORT fp32")]
    assert fp32 and all(r["max_abs_logit_diff_vs_eager"] < 1e-4 for r in fp32)


@pytest.mark.slow
def test_bench_infer_random_models_table(capsys):
    from bench.infer import InferBenchOptions, bench_infer, format_table

    options = InferBenchOptions(
        input_size=32, batch_size=4, pairs=8, calibration=8, repeat=1, threads=(1, None)
    )
    figures = bench_infer(encoders=["resnet18"], options=options)
    printed = capsys.readouterr().out
    rows = figures["rows"]
    _check_rows(
        rows,
        "resnet18",
        32,
        8,
        ["PyTorch eager", "ORT fp32", "ORT fp32", "ORT int8 static", "ORT int8 static"],
    )
    assert [r["threads"] for r in rows[1:]] == [1, "default", 1, "default"]
    assert all(r["models"] == "random init" for r in rows)
    assert printed.strip() == format_table(figures)
    lines = printed.strip().splitlines()
    assert lines[1].split()[:3] == ["encoder", "runtime", "threads"]
    assert len(lines) == 2 + len(rows) + 1
    assert "x eager" in lines[-1]


@pytest.mark.slow
def test_bench_infer_cli_json_with_a_trained_run(score_model, capsys):
    from cli.main import main

    run = score_model.parent / "run"
    rc = main(
        [
            "bench",
            "infer",
            "--run",
            str(run),
            "--pairs",
            "16",
            "--batch-size",
            "8",
            "--calibration",
            "8",
            "--repeat",
            "1",
            "--threads",
            "1",
            "--json",
        ]
    )
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    size = json.loads((run / "summary.json").read_text())["config"]["data"]["input_size"]
    _check_rows(rows, "resnet18", size, 16, ["PyTorch eager", "ORT fp32", "ORT int8 static"])
    assert all(r["models"].startswith("trained run") for r in rows)


def test_bench_infer_cli_errors(tmp_path, capsys):
    from cli.main import main

    assert main(["bench", "infer", "--run", str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "infer", "--threads", "0"])


def test_bench_infer_encoders_by_commas(capsys):
    """`--encoders a,b` names two encoders (as `bench train --encoders` does), not one 'a,b'."""
    from cli.main import main

    args = ["bench", "infer", "--input-size", "32", "--pairs", "4", "--calibration", "4"]
    assert main([*args, "--encoders", "nosuch,resnet18"]) == 2
    err = capsys.readouterr().err
    assert "unknown encoder 'nosuch'" in err and "nosuch,resnet18" not in err


def test_rows_name_the_provider_the_session_took(tmp_path):
    """Asking for CUDA where ONNX Runtime cannot start it falls back to the CPU: the row says CPU."""
    import onnx
    from onnx import TensorProto, helper

    from bench.infer import _onnx

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    path = tmp_path / "relu.onnx"
    onnx.save(model, str(path))
    import onnxruntime as ort
    import torch

    cuda_works = (
        "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()
    )
    _, where = _onnx(path, 1, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert where == ("CUDA" if cuda_works else "CPU")
    assert _onnx(path, 1, ["CPUExecutionProvider"])[1] == "CPU"
