"""`local-damage pretrain`: the self-supervised losses against loops written from their formulas,
random crops of real files, and encoder weights that `train` takes as ``model.weights``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import yaml

from cli.main import main
from local_damage.models import ModelConfig, build_model
from local_damage.models.encoders import build_encoder
from local_damage.pretrain import BalancedContrastiveLoss, NTXentLoss
from local_damage.pretrain.crops import CropPool, PretrainError, augment, find_sources


def views(n: int = 5, d: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)


def cos(u: torch.Tensor, v: torch.Tensor) -> float:
    return float(u @ v / (u.norm() * v.norm()))


def test_ntxent_matches_a_loop_from_its_formula():
    a, b = views()
    rows = list(a) + list(b)
    n, t = len(a), 0.3
    total = 0.0
    for i, u in enumerate(rows):
        p = (i + n) % (2 * n)
        denominator = sum(math.exp(cos(u, rows[k]) / t) for k in range(2 * n) if k != i)
        total += -math.log(math.exp(cos(u, rows[p]) / t) / denominator)
    assert float(NTXentLoss(t)(a, b)) == pytest.approx(total / (2 * n), rel=1e-5)


def test_balanced_loss_matches_a_loop_from_its_formula():
    a, b = views(seed=1)
    rows = list(a) + list(b)
    n, alpha, lam = len(a), 4.0, 0.7
    total = 0.0
    for i, u in enumerate(rows):
        p = (i + n) % (2 * n)
        negatives = [k for k in range(2 * n) if k not in (i, p)]
        repel = math.log(sum(math.exp(alpha * cos(u, rows[k])) for k in negatives))
        total += -cos(u, rows[p]) + lam / alpha * repel
    got = float(BalancedContrastiveLoss(alpha, lam)(a, b))
    assert got == pytest.approx(total / (2 * n), rel=1e-5)
    # the positive stays out of the repelling term: moving it changes only the attraction
    a2 = a.clone()
    a2[0] = b[0]  # views 0 identical: attraction of rows 0 and n is 1
    assert float(BalancedContrastiveLoss(alpha, lam)(a2, b)) < got


def test_losses_refuse_bad_input():
    with pytest.raises(ValueError, match="same shape"):
        NTXentLoss()(torch.randn(3, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match="alpha and lam"):
        BalancedContrastiveLoss(alpha=0)


def test_sources_and_crops_from_real_files(synthetic_xbd, synthetic_scene, tmp_path):
    sources = find_sources([synthetic_xbd], [synthetic_scene.root], "augment")
    tifs = [s for s in sources if s.path.suffix == ".tif"]
    pres = [s for s in sources if "_pre_disaster" in s.path.name]
    assert tifs and pres and all(s.pair is not None for s in pres)
    assert len([s for s in sources if "_post_disaster" in s.path.name]) == len(pres)
    pairs = find_sources([synthetic_xbd], [synthetic_scene.root], "prepost")
    assert pairs and all("_pre_disaster" in s.path.name and s.pair for s in pairs)
    pool = CropPool(pairs, crop=32, views="prepost", pool_size=2, seed=0)
    a, b = pool.batch(64)
    assert a.shape == b.shape == (64, 32, 32, 3) and a.dtype == np.uint8
    # pre against post of the same windows: equal where nothing changed, not everywhere
    same = [np.array_equal(x, y) for x, y in zip(a, b, strict=True)]
    assert not all(same)
    twice, again = CropPool(pairs, crop=32, views="augment", pool_size=2, seed=0).batch(64)
    assert np.array_equal(twice, a) and np.array_equal(again, a)  # same windows, one image
    a = a[:6]
    v = augment(a, 24, torch.Generator().manual_seed(0))
    assert v.shape == (6, 3, 24, 24) and float(v.min()) >= 0 and float(v.max()) <= 255
    with pytest.raises(PretrainError, match="not an xBD folder"):
        find_sources([tmp_path], [], "augment")
    with pytest.raises(PretrainError, match="no GeoTIFF"):
        find_sources([], [tmp_path], "augment")


def _red(n: int = 48) -> np.ndarray:
    """A flat red crop: green and blue equal."""
    return np.broadcast_to(np.array([200, 60, 60], np.uint8), (1, n, n, 3)).copy()


def _checkerboard(n: int = 48, square: int = 8) -> np.ndarray:
    """Black and white squares: the number of edges a view crosses says how wide a window it
    was cut from, whatever its colours, greying or blur did."""
    ij = np.indices((n, n)) // square
    board = ((ij[0] + ij[1]) % 2 * 255).astype(np.uint8)
    return np.repeat(board[..., None], 3, axis=-1)[None]


def _edges(view: torch.Tensor) -> int:
    """Sign changes about the median along the middle row and column, the larger."""
    grey = view.mean(0)
    mid = grey.shape[0] // 2
    counts = []
    for line in (grey[mid], grey[:, mid]):
        signs = (line > line.median()).int()
        counts.append(int((signs[1:] != signs[:-1]).sum()))
    return max(counts)


@pytest.mark.parametrize("strength", ["light", "simclr"])
def test_augment_strengths_crop_and_colour_as_documented(strength):
    """``light``: windows of at least 0.4 of the area (a side of 0.63 or more: 3 or more edges of
    the 6 squares a side), colours only brighter or contrastier; ``simclr``: windows down to 0.08
    of the area, and the hue turned."""
    g = torch.Generator().manual_seed(0)
    boards = augment(np.repeat(_checkerboard(), 200, axis=0), 24, g, strength=strength)
    assert boards.shape == (200, 3, 24, 24)
    assert float(boards.min()) >= 0 and float(boards.max()) <= 255
    edges = [_edges(v) for v in boards]
    # brightness, contrast and greying keep green equal to blue on a flat red crop; only a turn
    # of hue tells them apart
    v = augment(np.repeat(_red(), 200, axis=0), 24, g, strength=strength).mean((2, 3))
    hue_moved = float(((v[:, 1] - v[:, 2]).abs() > 5).float().mean())
    if strength == "light":
        assert min(edges) >= 3
        assert hue_moved == 0.0
    else:
        assert min(edges) <= 2  # some windows of a small share of the crop
        assert hue_moved > 0.3  # 0.55-0.60 over seeds 0-2: jitter 0.8, grey 0.2, small turns


def test_augment_refuses_an_unknown_strength():
    with pytest.raises(PretrainError, match="unknown augmentation"):
        augment(_red(), 24, torch.Generator(), strength="heavy")


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["balanced", "ntxent"])
def test_pretrain_writes_weights_that_train_takes(synthetic_xbd, tmp_path, loss):
    out = tmp_path / "pre"
    argv = ["pretrain", "--xbd", str(synthetic_xbd), "--out", str(out), "--loss", loss]
    argv += ["--steps", "3", "--batch-size", "4", "--crop", "48", "--input-size", "32", "--quiet"]
    argv += ["--augment", "simclr" if loss == "ntxent" else "light"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["sources"]
    recorded = yaml.safe_load((out / "pretrain.yaml").read_text())
    assert recorded["augment"] == ("simclr" if loss == "ntxent" else "light")
    assert summary["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert summary["steps_per_s"] == pytest.approx(3 / summary["seconds"], rel=0.01)
    assert 0 < summary["data_seconds"] < summary["seconds"]
    weights = out / "encoder.safetensors"
    from safetensors.torch import load_file

    saved = load_file(str(weights))
    torch.manual_seed(123)
    model = build_model(ModelConfig(encoder="resnet18", weights=str(weights)))
    own = model.encoder.state_dict()
    assert set(saved) == set(own)
    for key, value in saved.items():
        torch.testing.assert_close(own[key], value)
    # the weights pretraining started from: its seed (0) before the encoder is built
    torch.manual_seed(0)
    start = build_encoder("resnet18").state_dict()
    key = "conv1.weight"
    assert not torch.allclose(start[key], saved[key])  # pretraining moved the weights
    # and the same run with a learning rate of 0 leaves them where they started: the
    # comparison above is against the true starting point, so it fails if nothing was learnt
    still = tmp_path / "still"
    argv[argv.index(str(out))] = str(still)
    assert main([*argv, "--lr", "0"]) == 0
    torch.testing.assert_close(load_file(str(still / "encoder.safetensors"))[key], start[key])


def test_pretrain_needs_a_source(tmp_path, capsys):
    assert main(["pretrain", "--out", str(tmp_path / "x")]) != 0
    assert "--xbd ROOT or --rasters DIR" in capsys.readouterr().err


def test_pretrain_device_refused_clearly(synthetic_xbd, tmp_path, capsys):
    argv = ["pretrain", "--xbd", str(synthetic_xbd), "--out", str(tmp_path / "x"), "--quiet"]
    assert main([*argv, "--device", "tpu"]) != 0
    assert "unknown device 'tpu'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main([*argv, "--device", "cuda", "--steps", "1"]) != 0
        assert "CUDA is not available" in capsys.readouterr().err
        assert not (tmp_path / "x").exists()  # refused before anything is written
