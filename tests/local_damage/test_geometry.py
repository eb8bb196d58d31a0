"""The geometry experiment: a tiny seeded run, its outputs, and the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cli import main as cli
from local_damage.experiments.geometry import (
    TABLE_COLUMNS,
    GeometryConfig,
    class_counts_for,
    geometry_metrics,
    theory_value,
)
from local_damage.losses import OrthonormalContrastiveLoss, SupConLoss

TINY = [
    "--proportions",
    "0.25,0.25,0.25,0.25",
    "--n",
    "48",
    "--dim",
    "8",
    "--steps",
    "400",
    "--lr",
    "0.05",
    "--batch-sizes",
    "8,16",
    "--temperature",
    "0.5",
    "--seed",
    "0",
]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("geometry")
    rc = cli.main(["geometry", *TINY, "--out", str(out), "--name", "tiny"])
    return rc, out


@pytest.mark.slow
def test_cli_writes_outputs(tiny_run, capsys):
    rc, out = tiny_run
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == ["tiny.json", "tiny.md", "tiny.png"]
    assert (out / "tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "tiny.json").read_text())
    assert results["counts"] == [12, 12, 12, 12] and results["balanced"]
    assert {(r["loss"], r["batch_size"]) for r in results["runs"]} == {
        ("scl", 8),
        ("scl", 16),
        ("ocl", 8),
        ("ocl", 16),
    }


def test_ocl_class_means_orthogonal_scl_not(tiny_run):
    results = json.loads((tiny_run[1] / "tiny.json").read_text())
    runs = {(r["loss"], r["batch_size"]): r for r in results["runs"]}
    for b in (8, 16):
        ocl, scl = runs[("ocl", b)], runs[("scl", b)]
        assert ocl["max_abs_cos"] < 0.15, ocl["gram"]
        assert ocl["max_abs_cos"] < ocl["init_max_abs_cos"] / 3  # it moved there, not started there
        assert ocl["max_abs_cos"] < scl["max_abs_cos"] - 0.15
        # SCL pushes every pair of balanced classes to negative cosine (simplex: -1/3)
        assert scl["max_cos"] < -0.1
        assert abs(scl["mean_offdiag_cos"] - (-1 / 3)) < 0.1
        for r in (ocl, scl):
            assert r["min_within_cos"] > 0.8  # classes have (nearly) collapsed
            assert r["final_loss"] < r["history"][0][1]  # training lowered the full-batch loss
            gram = torch.tensor(r["gram"])
            assert torch.allclose(gram, gram.T) and torch.allclose(gram.diagonal(), torch.ones(4))
    # OCL's minimum is Theorem 3.2's value: the loss cannot go below it
    for r in results["runs"]:
        if r["loss"] == "ocl":
            assert r["final_loss"] >= r["theory"] - 1e-9


def test_table_parses(tiny_run):
    text = (tiny_run[1] / "tiny.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split(" | ")]
    assert header == list(TABLE_COLUMNS)
    assert set(rows[1]) <= set("|-")
    body = [
        dict(zip(header, (c.strip() for c in r.strip("|").split(" | ")), strict=True))
        for r in rows[2:]
    ]
    assert [(r["loss"], r["batch"]) for r in body] == [
        ("SCL", "8"),
        ("SCL", "16"),
        ("OCL", "8"),
        ("OCL", "16"),
    ]
    results = json.loads((tiny_run[1] / "tiny.json").read_text())
    for row, run in zip(body, results["runs"], strict=True):
        assert float(row["max|cos|"]) == pytest.approx(run["max_abs_cos"], abs=6e-4)
        assert float(row["full-batch loss"]) == pytest.approx(run["final_loss"], abs=6e-5)
        assert row["converged"] in {"yes", "no"}
        assert float(row["draws/sample"]) == round(400 * int(row["batch"]) / 48)


def test_theory_values_are_the_losses_at_the_named_configurations():
    counts = (7, 3, 2, 4)
    labels = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    q, _ = torch.linalg.qr(
        torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    )
    ortho = q.T[labels]
    simplex = torch.nn.functional.normalize(torch.eye(4, dtype=torch.float64) - 0.25, dim=1)[labels]
    for t in (0.1, 0.5):
        assert OrthonormalContrastiveLoss(t)(ortho, labels).item() == pytest.approx(
            theory_value("ocl", counts, t), rel=1e-10
        )
        assert SupConLoss(t)(simplex, labels).item() == pytest.approx(
            theory_value("scl", counts, t), rel=1e-10
        )


def test_geometry_metrics_by_hand():
    z = torch.tensor([[1.0, 0.0], [0.6, 0.8], [-1.0, 0.0], [-1.0, 0.0]])
    m = geometry_metrics(z, torch.tensor([0, 0, 1, 1]), 2)
    mean0 = torch.nn.functional.normalize(torch.tensor([1.6, 0.8]), dim=0)
    assert m["gram"][0][1] == pytest.approx(-mean0[0].item(), abs=1e-6)
    assert m["max_abs_cos"] == pytest.approx(mean0[0].item(), abs=1e-6)
    assert m["within_cos"] == pytest.approx([0.6, 1.0])
    assert m["min_within_cos"] == pytest.approx(0.6)


def test_class_counts_for():
    assert class_counts_for((0.70, 0.11, 0.13, 0.06), 400) == (280, 44, 52, 24)
    assert class_counts_for((1, 1, 1), 10) in {(4, 3, 3), (3, 4, 3), (3, 3, 4)}
    assert sum(class_counts_for((0.5, 0.3, 0.2), 101)) == 101
    with pytest.raises(ValueError, match=r"class\(es\) \[1\].*raise --n"):
        class_counts_for((0.99, 0.01), 50)
    with pytest.raises(ValueError, match="> 0"):
        class_counts_for((0.5, -0.5, 1.0), 50)
    assert math.isclose(sum(class_counts_for((0.70, 0.11, 0.13, 0.06), 57)), 57)


def test_bad_settings(capsys):
    with pytest.raises(ValueError, match=r"batch size 1 must lie in \[2, n=40\]"):
        GeometryConfig(n=40, batch_sizes=(1,))
    with pytest.raises(ValueError, match="dim must be >= the number of classes K=4"):
        GeometryConfig(dim=3)
    assert cli.main(["geometry", "--losses", "ocl,triplet"]) == 2
    assert "valid losses: scl, ocl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["geometry", "--proportions", "a,b"])
    assert "comma-separated numbers" in capsys.readouterr().err
