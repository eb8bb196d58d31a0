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


def test_bench_infer_random_models_table(capsys):
    from bench.infer import bench_infer, format_table

    figures = bench_infer(
        encoders=["resnet18"],
        input_size=32,
        batch_size=4,
        pairs=8,
        calibration=8,
        repeat=1,
        threads=[1, None],
    )
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
