"""`bench train`: the naive forward, the saved-bytes count, the figures and the CLI."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from bench import train as bt
from cli.main import main
from local_damage.models import ModelConfig, build_model

TINY = ["--encoders", "resnet18", "--sizes", "32", "--batches", "2", "--steps", "1"]


def _tiny_model(**kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(encoder="resnet18", proj_hidden=32, cls_hidden=32, embed_dim=16, **kwargs)
    return build_model(cfg)


@pytest.fixture(scope="module")
def tiny_rows():
    """The records `bench train --json` prints for the tiny grid (resnet18, 32 px, batch 2)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", "train", *TINY, "--json"])
    assert rc == 0
    return json.loads(out.getvalue())


def test_separate_pass_forward_equals_paired_forward():
    model = _tiny_model().eval()
    gen = torch.Generator().manual_seed(1)
    pre = torch.randn(3, 3, 64, 64, generator=gen)
    post = torch.randn(3, 3, 64, 64, generator=gen)
    with torch.no_grad():
        paired = model(pre, post)
        separate = bt.separate_pass_forward(model, pre, post)
    assert paired.l is not None and separate.l is not None
    for name in paired._fields:
        a, b = getattr(paired, name), getattr(separate, name)
        assert a.shape == b.shape, name
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)
    # the pre and post inputs are not interchangeable: swapping them changes z
    swapped = bt.separate_pass_forward(model, post, pre)
    assert not torch.allclose(swapped.z, paired.z, atol=1e-3)


def test_separate_pass_forward_rejects_mismatched_shapes():
    model = _tiny_model().eval()
    with pytest.raises(ValueError, match="differ in shape"):
        bt.separate_pass_forward(model, torch.zeros(2, 3, 32, 32), torch.zeros(2, 3, 64, 64))


def test_saved_bytes_counts_unique_storages_and_skips_excluded():
    a = torch.randn(4, 8, requires_grad=True)  # 128 bytes
    with bt.SavedTensorBytes() as saved:
        a.sin()  # saves a
        a[:2].cos()  # saves a view of a's storage: not counted again
    assert (saved.bytes, saved.count) == (a.numel() * 4, 1)
    with bt.SavedTensorBytes() as saved:
        a.sin()
        (a * 2).sin()  # saves a new tensor
    assert (saved.bytes, saved.count) == (2 * a.numel() * 4, 2)
    with bt.SavedTensorBytes(exclude=[a]) as saved:
        a.sin()
        (a * 2).sin()
    assert (saved.bytes, saved.count) == (a.numel() * 4, 1)
    with bt.SavedTensorBytes() as saved, torch.no_grad():
        a.sin()
    assert saved.bytes == 0


def test_saved_bytes_puts_autocast_weight_copies_apart():
    lin = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), bt.SavedTensorBytes(lin.parameters()) as s:
        lin(x)
    # activations: the bf16 copy of x (4*8*2 bytes); the bf16 weight copy (16*8*2) apart
    assert (s.bytes, s.count, s.excluded_bytes) == (64, 1, 256)
    with bt.SavedTensorBytes() as s, torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x)
    assert (s.bytes, s.excluded_bytes) == (64 + 256, 0)


def test_checkpointing_reduces_saved_bytes():
    pre = torch.randn(2, 3, 32, 32)
    post = torch.randn(2, 3, 32, 32)
    measured = {}
    for ckpt in (False, True):
        model = _tiny_model(gradient_checkpointing=ckpt).train()
        exclude = list(model.parameters()) + list(model.buffers())
        with bt.SavedTensorBytes(exclude) as saved:
            out = model(pre, post)
        out.logits.sum().backward()  # the measured graph is a working one
        measured[ckpt] = saved.bytes
    assert measured[False] > 0 and measured[True] > 0
    assert measured[True] < measured[False] / 2


@pytest.mark.slow
def test_tiny_grid_rows_are_well_formed(tiny_rows):
    rows = tiny_rows
    assert [r["config"] for r in rows] == list(bt.CONFIGS)
    assert set(rows[0]) == set(rows[1])
    naive, optimised = rows
    for r in rows:
        assert (r["encoder"], r["size"], r["batch"], r["steps"]) == ("resnet18", 32, 2, 1)
        assert r["device"] == "cpu" and r["threads"] == torch.get_num_threads()
        assert r["step_s"] > 0 and r["saved_bytes"] > 0 and r["saved_tensors"] > 0
        assert r["pairs_per_s"] == pytest.approx(2 / r["step_s"])
        assert r["bytes_per_pair"] == pytest.approx(r["saved_bytes"] / 2)
        assert r["mib_per_pair"] == pytest.approx(r["saved_bytes"] / 2 / 2**20)
        assert r["peak_mib"] is None
        assert r["time_ratio"] == pytest.approx(r["step_s"] / naive["step_s"])
    assert naive["mem_ratio"] == 1.0 and naive["meets_target"] is None
    assert optimised["mem_ratio"] == pytest.approx(optimised["saved_bytes"] / naive["saved_bytes"])
    assert optimised["meets_target"] == (optimised["mem_ratio"] <= 1 / 3)
    assert optimised["saved_bytes"] < naive["saved_bytes"]
    # autocast keeps bf16 copies of the head weights: counted apart from the activations
    assert optimised["weight_bytes"] > 0
    table = bt.format_table(rows, steps=1).splitlines()
    assert table[1].split()[:4] == ["encoder", "size", "batch", "config"]
    assert table[2].split()[:4] == ["resnet18", "32", "2", "naive"]
    assert table[3].split()[-1] == ("yes" if optimised["meets_target"] else "no")


def test_cli_table_goes_on_past_a_failed_grid_point(tiny_rows, monkeypatch, capsys):
    measured = {r["config"]: r for r in tiny_rows}
    calls = []

    def failing_at_64(encoder, size, batch, config, **kw):
        calls.append((size, config))
        if size == 64:
            raise RuntimeError("not enough memory: you tried to allocate 1 byte")
        return dict(measured[config])  # the real figures of the 32 px grid point

    monkeypatch.setattr(bt, "measure_config", failing_at_64)
    args = ["bench", "train", "--encoders", "resnet18", "--sizes", "64,32"]
    rc = main([*args, "--batches", "2", "--steps", "1"])
    captured = capsys.readouterr()
    assert rc == 1
    assert calls == [(64, "naive"), (32, "naive"), (32, "optimised")]
    lines = captured.out.strip().splitlines()
    assert lines[0].startswith("LOCAL training step on cpu")
    assert lines[2:] == bt.format_rows(tiny_rows).splitlines()
    assert "1 grid point(s) failed" in captured.err
    assert "resnet18 64 px batch 2: RuntimeError: not enough memory" in captured.err


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--sizes", "48", "multiple of 32"),
        ("--batches", "1", "at least 2 pairs"),
        ("--encoders", "resnet7", "unknown encoder"),
    ],
)
def test_cli_rejects_bad_input(option, value, message, capsys):
    args = dict(zip(TINY[::2], TINY[1::2], strict=True))
    args[option] = value
    argv = ["bench", "train", *[x for kv in args.items() for x in kv]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and value in err
