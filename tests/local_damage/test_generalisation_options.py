"""The recipe options for imagery the model never saw: the pair's radiometric normalisation in
the network (and the exported graph), strong augmentation, softer class weights; and the packed
chip store that carries a store to a training machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data_prep.spec import ChipSpec
from data_prep.store import read_manifest
from data_prep.store_pack import pack_store, unpack_store
from data_prep.xbd import prepare_xbd
from local_damage.data import ChipPairDataset
from local_damage.losses.weighted_ce import class_weights
from local_damage.models.local_net import ModelConfig, build_model
from local_damage.train.config import DataConfig


def tiny(pair_norm: bool):
    torch.manual_seed(0)
    cfg = ModelConfig(
        encoder="resnet18", pair_norm=pair_norm, embed_dim=16, proj_hidden=32, cls_hidden=32
    )
    return build_model(cfg).eval()


def test_pair_norm_makes_the_grade_blind_to_an_overall_shift_of_the_post_image():
    g = torch.Generator().manual_seed(1)
    pre, post = torch.randn(3, 3, 64, 64, generator=g), torch.randn(3, 3, 64, 64, generator=g)
    # another sensor: each channel of the post image brighter and with more contrast
    gain = torch.tensor([1.6, 1.3, 0.8]).view(1, 3, 1, 1)
    shifted = post * gain + torch.tensor([0.5, -0.3, 0.2]).view(1, 3, 1, 1)
    moved = {}
    with torch.no_grad():
        for pair_norm in (True, False):
            model = tiny(pair_norm)
            moved[pair_norm] = (model.predict(pre, post)[1] - model.predict(pre, shifted)[1]).abs()
    assert moved[True].max() < 1e-4 < 1e-2 < moved[False].max()


def test_pair_norm_is_in_the_exported_graph(tmp_path):
    onnxruntime = pytest.importorskip("onnxruntime")
    from local_damage.data import normalize
    from local_damage.export.graph import export_onnx

    model = tiny(True)
    g = torch.Generator().manual_seed(2)
    pre = torch.randint(0, 256, (2, 64, 64, 3), dtype=torch.uint8, generator=g)
    post = (pre.float() * 0.5 + 60).to(torch.uint8)  # the same scene, darker and flatter
    path = export_onnx(model, tmp_path / "m.onnx", 64)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    z = session.run(["embedding"], {"pre": pre.numpy(), "post": post.numpy()})[0]
    chw = lambda x: normalize(x.permute(0, 3, 1, 2))  # noqa: E731
    with torch.no_grad():
        expected = model.predict(chw(pre), chw(post))[1].numpy()
        unmatched = tiny(False)
        unmatched.load_state_dict(model.state_dict())
        other = unmatched.predict(chw(pre), chw(post))[1].numpy()
    np.testing.assert_allclose(z, expected, atol=1e-3)
    assert np.abs(z - other).max() > 1e-2


def test_square_root_class_weights_by_hand():
    w = class_weights([100, 25, 0, 4], 4, counts=True, power=0.5)
    inv = np.array([1 / 10, 1 / 5, 0, 1 / 2])
    np.testing.assert_allclose(w.numpy(), inv / inv[[0, 1, 3]].mean(), rtol=1e-6)
    np.testing.assert_allclose(class_weights([3, 5], 2, counts=True, power=0).numpy(), [1, 1])
    with pytest.raises(ValueError, match="power"):
        class_weights([3, 5], 2, counts=True, power=-1)


@pytest.fixture(scope="module")
def store(tmp_path_factory, synthetic_xbd):
    out = tmp_path_factory.mktemp("gen") / "chips"
    prepare_xbd([synthetic_xbd], out, spec=ChipSpec(chip_size=64, min_size=32), progress=False)
    return out


def test_strong_augmentation_is_seeded_and_stronger_than_light(store):
    ids = read_manifest(store)["chip_id"].tolist()[:12]
    plain = ChipPairDataset(store, ids, 64)
    light = ChipPairDataset(store, ids, 64, augment=True, seed=3)
    strong = ChipPairDataset(store, ids, 64, augment=True, seed=3, augment_strength="strong")
    again = ChipPairDataset(store, ids, 64, augment=True, seed=3, augment_strength="strong")

    def change(ds):  # mean absolute change of the post chips against the plain ones
        return np.mean([(ds[i][1].float() - plain[i][1].float()).abs().mean() for i in range(12)])

    assert all(torch.equal(strong[i][1], again[i][1]) for i in range(12))
    assert change(strong) > change(light) > 0
    with pytest.raises(ValueError, match="augment_strength"):
        DataConfig(augment_strength="medium")


def test_a_packed_store_unpacks_to_the_same_store_within_jpeg_loss(store, tmp_path):
    result = pack_store(store, tmp_path / "s.pack", quality=95)
    assert result["bytes"] < result["shard_bytes"] / 2
    back = unpack_store(tmp_path / "s.pack", tmp_path / "back")
    assert (back / "manifest.csv").read_bytes() == (store / "manifest.csv").read_bytes()
    a, b = ChipPairDataset(store, None, 64), ChipPairDataset(back, None, 64)
    assert len(a) == len(b) == result["chips"] // 2
    diff = np.mean([(a[i][0].float() - b[i][0].float()).abs().mean() for i in range(len(a))])
    assert 0 < diff < 4
    (tmp_path / "bad.pack").write_bytes(b"not a pack")
    with pytest.raises(Exception, match="not a chip store pack"):
        unpack_store(tmp_path / "bad.pack", tmp_path / "x")


def test_a_damaged_pack_is_refused_by_name(store, tmp_path):
    pack = tmp_path / "s.pack"
    pack_store(store, pack)
    data = pack.read_bytes()
    (tmp_path / "short.pack").write_bytes(data[:20])
    with pytest.raises(Exception, match="header is cut short or damaged"):
        unpack_store(tmp_path / "short.pack", tmp_path / "a")
    (tmp_path / "cut.pack").write_bytes(data[:-100])
    with pytest.raises(Exception, match="cut short in"):
        unpack_store(tmp_path / "cut.pack", tmp_path / "b")
    assert not (tmp_path / "b" / "manifest.csv").exists()  # no store that looks complete
