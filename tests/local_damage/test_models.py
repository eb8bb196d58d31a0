"""The LOCAL model: shapes, the paper's correlation maths, one-pass encoding, weights, export."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from local_damage.models import (
    Correlation,
    LatentCorrelation,
    LocalInference,
    LocalNet,
    ModelConfig,
    WeightsUnavailableError,
    build_encoder,
    build_model,
    load_encoder_weights,
    parse_blocks,
)

SIZE = 64  # chip side for the tests: blocks 1-4 are 16, 8, 4, 2 px
BLOCK_SPECS = ["1-2-3-4", "2-3-4", "3-4", "4", None]


def pairs(n: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, SIZE, SIZE, generator=g), torch.randn(n, 3, SIZE, SIZE, generator=g)


def model(encoder: str = "resnet18", seed: int = 0, **kw) -> LocalNet:
    torch.manual_seed(seed)
    return build_model(ModelConfig(encoder=encoder, **kw))


@pytest.fixture(scope="module")
def encoders() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    names = ("resnet18", "resnet34", "resnet50", "mobilenet_v2")
    return {name: build_encoder(name) for name in names}


# ----------------------------------------------------------------------------- config, blocks


def test_parse_blocks():
    assert parse_blocks("1-2-3-4") == (1, 2, 3, 4)
    assert parse_blocks("4-3") == (3, 4)
    assert parse_blocks("2, 3") == (2, 3)
    assert parse_blocks([4]) == (4,)
    assert parse_blocks(None) == () == parse_blocks("")
    for bad, words in [
        ("0-1", "1, 2, 3, 4"),
        ("1-5", "got [5]"),
        ("a-b", "'-'"),
        ("3-3", "repeated"),
    ]:
        with pytest.raises(ValueError, match="latent blocks") as err:
            parse_blocks(bad)
        assert words in str(err.value)


def test_config_validation_and_round_trip():
    cfg = ModelConfig(encoder="resnet18", latent_blocks="4-3", weights=None)
    assert cfg.latent_blocks == "3-4"
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig(latent_blocks="").latent_blocks is None
    with pytest.raises(ValueError, match=r"unknown keys \['blocks'\]"):
        ModelConfig.from_dict({"blocks": "1-2"})
    with pytest.raises(ValueError, match="num_classes"):
        ModelConfig(num_classes=1)
    with pytest.raises(ValueError, match="latent_size"):
        ModelConfig(latent_size=0)
    with pytest.raises(ValueError, match="dropout"):
        ModelConfig(dropout=1.0)


# ----------------------------------------------------------------------------- shapes, norms


@pytest.mark.parametrize("encoder", ["resnet18", "resnet34", "resnet50", "mobilenet_v2"])
@pytest.mark.parametrize("blocks", BLOCK_SPECS)
def test_output_shapes_and_unit_norms(encoders, encoder, blocks):
    torch.manual_seed(0)
    cfg = ModelConfig(encoder=encoder, latent_blocks=blocks, embed_dim=32, num_classes=4)
    net = LocalNet(cfg, encoder=encoders[encoder]).eval()
    pre, post = pairs(2)
    with torch.no_grad():
        out = net(pre, post)
    assert out.logits.shape == (2, 4)
    assert out.z.shape == out.e_pre.shape == out.e_post.shape == (2, 32)
    for t in (out.z, out.e_pre, out.e_post):
        torch.testing.assert_close(t.norm(dim=1), torch.ones(2))
    if blocks is None:
        assert out.l is None and out.latent_map is None and net.latent_dim is None
    else:
        assert out.l.shape == (2, 64) and net.latent_dim == 64
        assert out.latent_map.shape == (2, 1, 8, 8)
        torch.testing.assert_close(out.l.norm(dim=1), torch.ones(2))
        torch.testing.assert_close(out.l, F.normalize(out.latent_map.flatten(1), dim=1))


def test_latent_size_sets_latent_dim(encoders):
    net = LocalNet(ModelConfig(encoder="resnet18", latent_size=5), encoder=encoders["resnet18"])
    out = net(*pairs(2))
    assert out.l.shape == (2, 25) and out.latent_map.shape == (2, 1, 5, 5)


def test_pre_post_shapes_must_agree():
    net = model()
    with pytest.raises(ValueError, match="pre and post batches differ"):
        net(torch.zeros(2, 3, SIZE, SIZE), torch.zeros(1, 3, SIZE, SIZE))


# ----------------------------------------------------------------------------- paper maths


def naive_latent(feats_pre, feats_post, blocks, size, weights=None):
    """Sec. 3.4 literally: W_i[f_pre, f_post] per block, resize, concat, mean, flatten, L2."""
    maps = []
    for k, b in enumerate(blocks):
        a, c = feats_pre[b + 1], feats_post[b + 1]
        d = (
            a - c
            if weights is None
            else torch.einsum("oc,bchw->bohw", weights[k], torch.cat([a, c], 1))
        )
        if d.shape[-1] > size:
            d = F.adaptive_avg_pool2d(d, size)
        elif d.shape[-1] < size:
            d = F.interpolate(d, size=(size, size), mode="bilinear", align_corners=False)
        maps.append(d)
    m = torch.cat(maps, dim=1).mean(dim=1, keepdim=True)
    return F.normalize(m.flatten(1), dim=1), m


@pytest.fixture(scope="module")
def block_features(encoders):
    enc = encoders["resnet18"].eval()
    pre, post = pairs(2, seed=1)
    with torch.no_grad():
        return enc.out_channels, enc(pre), enc(post)


@pytest.mark.parametrize("blocks", ["1-2-3-4", "2-3-4", "3-4", "4"])
@pytest.mark.parametrize("learnable", [False, True])
def test_latent_module_matches_naive_formula(block_features, blocks, learnable):
    channels, fp, fq = block_features
    lat = LatentCorrelation(channels, parse_blocks(blocks), 8, learnable)
    weights = None
    with torch.no_grad():
        if learnable:  # move W away from [I, -I] so the learned path is really exercised
            for corr in lat.correlations:
                corr.weight.add_(0.01 * torch.randn_like(corr.weight))
            weights = [corr.weight for corr in lat.correlations]
        l_emb, m = lat(fp, fq)
        l_ref, m_ref = naive_latent(fp, fq, parse_blocks(blocks), 8, weights)
    torch.testing.assert_close(m, m_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(l_emb, l_ref, rtol=1e-4, atol=1e-5)


def test_correlation_learnable_starts_at_identity_difference():
    a, b = torch.randn(3, 6), torch.randn(3, 6)
    am, bm = torch.randn(3, 6, 4, 5), torch.randn(3, 6, 4, 5)
    fixed, learned = Correlation(6), Correlation(6, learnable=True)
    assert fixed.weight is None and learned.weight.shape == (6, 12)
    torch.testing.assert_close(learned(a, b), a - b)
    torch.testing.assert_close(learned(am, bm), am - bm)
    torch.testing.assert_close(fixed(am, bm), am - bm)


def test_learnable_model_matches_fixed_at_init(encoders):
    pre, post = pairs(2, seed=2)
    enc = encoders["resnet18"]
    fixed = LocalNet(ModelConfig(encoder="resnet18"), encoder=enc).eval()
    learned = LocalNet(
        ModelConfig(encoder="resnet18", learnable_correlation=True), encoder=copy.deepcopy(enc)
    ).eval()
    missing, unexpected = learned.load_state_dict(fixed.state_dict(), strict=False)
    assert not unexpected and all(
        k.endswith("correlation.weight") or "correlations" in k for k in missing
    )
    n_params = sum(p.numel() for p in learned.parameters()) - sum(
        p.numel() for p in fixed.parameters()
    )
    assert n_params == 2 * 128 * 128 + sum(2 * d * d for d in (64, 128, 256, 512))
    with torch.no_grad():
        a, b = fixed(pre, post), learned(pre, post)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        learned.correlation.weight.mul_(0.5).add_(0.1)  # the learned W is used
        assert not torch.allclose(learned(pre, post).z, a.z, atol=1e-3)


@pytest.mark.parametrize("train", [False, True])
def test_swapping_pre_and_post_negates_z_and_l(encoders, train):
    net = LocalNet(ModelConfig(encoder="resnet18"), encoder=encoders["resnet18"])
    net.train(train)
    pre, post = pairs(3, seed=3)
    with torch.no_grad():
        a, b = net(pre, post), net(post, pre)
    net.eval()
    torch.testing.assert_close(b.z, -a.z, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(b.l, -a.l, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(b.latent_map, -a.latent_map, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(b.e_pre, a.e_post, rtol=1e-4, atol=1e-5)
    assert a.z.abs().max() > 0.05 and a.l.abs().max() > 0.05


def test_pre_and_post_go_through_the_encoder_as_one_batch():
    net = model()
    calls = []
    net.encoder.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    pre, post = pairs(3)
    net(pre, post)
    assert calls == [6]
    net.predict(pre, post)
    assert calls == [6, 6]


# ----------------------------------------------------------------------------- gradients


def loss_terms(out, labels):
    return {
        "ce": F.cross_entropy(out.logits, labels),
        "z": (out.z @ out.z.T).sum(),
        "l": (out.l @ out.l.T).sum(),
    }


def test_each_loss_term_reaches_the_encoder():
    net = model().train()
    pre, post = pairs(4, seed=4)
    terms = loss_terms(net(pre, post), torch.tensor([0, 1, 2, 3]))
    for term, loss in terms.items():
        net.zero_grad(set_to_none=True)
        loss.backward(retain_graph=True)
        for name in ("conv1.weight", "layer1.0.conv1.weight", "layer4.1.conv2.weight"):
            grad = net.encoder.get_parameter(name).grad
            assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, (
                term,
                name,
            )
        # each term reaches only its own head
        assert (net.classifier[0].weight.grad is not None) == (term == "ce"), term
        assert (net.projection[0].weight.grad is not None) == (term == "z"), term


@pytest.mark.parametrize("encoder", ["resnet18", "mobilenet_v2"])
def test_gradient_checkpointing_gives_same_outputs_grads_and_stats(encoder):
    plain = model(encoder, seed=5).train()
    ckpt = copy.deepcopy(plain)
    ckpt.cfg = dataclasses.replace(plain.cfg, gradient_checkpointing=True)
    last = [m for m in ckpt.encoder.modules() if isinstance(m, torch.nn.Conv2d)][-1]
    calls = []
    last.register_forward_hook(lambda *a: calls.append(1))
    pre, post = pairs(2, seed=5)
    labels = torch.tensor([1, 3])
    outs = []
    for net in (plain, ckpt):
        out = net(pre, post)
        sum(loss_terms(out, labels).values()).backward()
        outs.append(out)
    assert len(calls) == 2  # forward + recompute in backward: checkpointing really happened
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    for (name, s), t in zip(plain.state_dict().items(), ckpt.state_dict().values(), strict=True):
        torch.testing.assert_close(s, t, msg=name)  # batch-norm stats updated once


def test_channels_last_matches(encoders):
    pre, post = pairs(2)
    plain = LocalNet(ModelConfig(encoder="resnet18"), encoder=encoders["resnet18"]).eval()
    cl = copy.deepcopy(plain)
    cl.cfg = dataclasses.replace(plain.cfg, channels_last=True)
    cl.to(memory_format=torch.channels_last)
    assert cl.encoder.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        for a, b in zip(plain(pre, post), cl(pre, post), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- weights


def _features_equal(a, b, x) -> bool:
    with torch.no_grad():
        return all(torch.equal(f, g) for f, g in zip(a.eval()(x), b.eval()(x), strict=True))


@pytest.mark.parametrize("form", ["pth", "state_dict", "model_prefixed", "safetensors"])
def test_local_weights_round_trip(tmp_path, form):
    from safetensors.torch import save_file

    torch.manual_seed(6)
    src = build_encoder("resnet18")
    for m in src.modules():  # non-default BN stats so that buffers are checked too
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
    enc_state = src.state_dict()
    path = tmp_path / ("enc.safetensors" if form == "safetensors" else "enc.pth")
    if form == "pth":
        torch.save(enc_state, path)
    elif form == "state_dict":
        torch.save({"state_dict": enc_state, "epoch": 3}, path)
    elif form == "model_prefixed":  # a whole LocalNet checkpoint with its config
        net = LocalNet(ModelConfig(encoder="resnet18"), encoder=src)
        torch.save({"model": net.state_dict(), "config": net.cfg.to_dict()}, path)
    else:
        save_file({k: v.contiguous() for k, v in enc_state.items()}, str(path))
    loaded = build_model(ModelConfig(encoder="resnet18", weights=str(path)))
    x = torch.randn(2, 3, SIZE, SIZE)
    assert _features_equal(src, loaded.encoder, x)
    assert not _features_equal(src, build_encoder("resnet18"), x)


def test_partial_weights_warn_with_missing_keys(tmp_path):
    enc = build_encoder("resnet18")
    state = {k: v for k, v in enc.state_dict().items() if not k.startswith("layer4")}
    state["extra.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "part.pth")
    with pytest.warns(UserWarning, match=r"missing.*layer4.*1 unexpected.*extra\.weight"):
        report = load_encoder_weights(build_encoder("resnet18"), tmp_path / "part.pth")
    assert report.unexpected == ["extra.weight"]
    assert report.missing and all(k.startswith("layer4") for k in report.missing)


@pytest.mark.slow
def test_bad_weights_files_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="weights file .*nope.pth not found"):
        build_encoder("resnet18", tmp_path / "nope.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.pth cannot be read"):
        build_encoder("resnet18", tmp_path / "junk.pth")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="junk.safetensors cannot be read"):
        build_encoder("resnet18", str(tmp_path / "junk.safetensors"))
    (tmp_path / "w.txt").write_text("x")
    with pytest.raises(ValueError, match="unknown suffix '.txt'"):
        build_encoder("resnet18", tmp_path / "w.txt")
    torch.save({"head.weight": torch.zeros(2, 2)}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match="other.pth matched no encoder key"):
        build_encoder("resnet18", tmp_path / "other.pth")
    torch.save(build_encoder("resnet50").state_dict(), tmp_path / "r50.pth")
    with pytest.raises(ValueError, match="r50.pth does not fit.*shape mismatches"):
        build_encoder("resnet18", tmp_path / "r50.pth")


def test_unknown_encoder_and_hub_weights_names():
    with pytest.raises(
        ValueError, match=r"unknown encoder 'resnet19'; valid names are \[.*'resnet18'"
    ):
        build_model(ModelConfig(encoder="resnet19"))
    with pytest.raises(ValueError, match=r"no hub weights 'imagenett'.*available: \['imagenet'"):
        build_encoder("resnet18", "imagenett")


def _offline_env(monkeypatch, endpoint: str | None = None):
    from huggingface_hub import constants

    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    if endpoint:
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "unreachable"])
def test_hub_weights_offline_fail_fast_with_advice(tmp_path, monkeypatch, how):
    """Failing fast is counted, not timed: the only download asked for is the cache lookup (no
    networked download, which would retry), and every connection tried has a short timeout; with
    the hub unreachable, the refused connection to it is tried."""
    import socket

    import huggingface_hub

    if how == "HF_HUB_OFFLINE":
        _offline_env(monkeypatch)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        _offline_env(monkeypatch, endpoint="http://127.0.0.1:9")  # discard port: refused
    downloads: list[bool] = []  # local_files_only of each hf_hub_download
    tried: list[tuple[object, float | None]] = []  # (address, timeout) of each connection
    download, connect = huggingface_hub.hf_hub_download, socket.socket.connect

    def counted_download(*args, **kwargs):
        downloads.append(bool(kwargs.get("local_files_only")))
        return download(*args, **kwargs)

    def counted_connect(sock, address):
        tried.append((address, sock.gettimeout()))
        return connect(sock, address)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", counted_download)
    monkeypatch.setattr(socket.socket, "connect", counted_connect)
    with pytest.raises(WeightsUnavailableError) as err:
        build_encoder("resnet34", "imagenet", cache_dir=tmp_path)
    assert downloads == [True]
    assert all(t is not None and t <= 10 for _, t in tried), tried
    assert (("127.0.0.1", 9) in [a for a, _ in tried]) == (how == "unreachable"), tried
    msg = str(err.value)
    assert "smp-hub/resnet34.imagenet" in msg and "not in the local cache" in msg
    assert "connected machine" in msg and "pass a local path" in msg
    assert ("HF_HUB_OFFLINE" in msg) == (how == "HF_HUB_OFFLINE")


def test_hub_weights_come_from_the_cache_without_network(tmp_path, monkeypatch):
    from safetensors.torch import save_file
    from segmentation_models_pytorch.encoders import encoders as registry

    _offline_env(monkeypatch, endpoint="http://127.0.0.1:9")
    settings = registry["resnet18"]["pretrained_settings"]["imagenet"]
    snapshot = (
        tmp_path / f"models--{settings['repo_id'].replace('/', '--')}" / "snapshots"
    ) / settings["revision"]
    snapshot.mkdir(parents=True)
    torch.manual_seed(7)
    src = build_encoder("resnet18")
    save_file(
        {k: v.contiguous() for k, v in src.state_dict().items()},
        str(snapshot / "model.safetensors"),
    )
    enc = build_encoder("resnet18", "imagenet", cache_dir=tmp_path)
    assert _features_equal(src, enc, torch.randn(1, 3, SIZE, SIZE))


# ----------------------------------------------------------------------------- export


@pytest.mark.parametrize("with_change_map", [False, True])
def test_onnx_export_round_trip_dynamic_batch(tmp_path, with_change_map):
    import onnxruntime as ort

    net = model("resnet18", seed=8).eval()
    wrapper = LocalInference(net, with_change_map=with_change_map).eval()
    outputs = ["logits", "embedding"] + (["change_map"] if with_change_map else [])
    path = tmp_path / "model.onnx"
    with torch.no_grad():
        torch.onnx.export(
            wrapper,
            pairs(2),
            str(path),
            input_names=["pre", "post"],
            output_names=outputs,
            dynamic_axes={name: {0: "batch"} for name in ["pre", "post", *outputs]},
            opset_version=17,
            dynamo=False,
        )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == outputs
    for batch in (1, 3):
        pre, post = pairs(batch, seed=batch)
        with torch.no_grad():
            expected = wrapper(pre, post)
        got = session.run(None, {"pre": pre.numpy(), "post": post.numpy()})
        assert len(got) == len(expected) == len(outputs)
        for g, e in zip(got, expected, strict=True):
            assert g.shape == tuple(e.shape) and g.shape[0] == batch
            np.testing.assert_allclose(g, e.numpy(), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        logits, z = net.predict(*pairs(3, seed=3))
    torch.testing.assert_close(logits, torch.from_numpy(got[0]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(z, torch.from_numpy(got[1]), rtol=1e-4, atol=1e-4)


def test_change_map_needs_the_latent_module():
    net = model(latent_blocks=None)
    with pytest.raises(ValueError, match="no latent correlation module"):
        net.change_map(*pairs(1))
    with pytest.raises(ValueError, match="with_change_map"):
        LocalInference(net, with_change_map=True)


@pytest.mark.parametrize("blocks", ["1-2-3-4", "3-4"])
def test_absolute_latent_matches_naive_formula(block_features, blocks):
    """latent_abs: the channel mean of |f_pre - f_post| per block, resized, concatenated."""
    channels, fp, fq = block_features
    lat = LatentCorrelation(channels, parse_blocks(blocks), 8, absolute=True)
    with torch.no_grad():
        l_emb, m = lat(fp, fq)
        absolute = [f.abs() for f in fp]  # |a - c| = naive formula on (|a - c|, 0)
        diffs = [(a - c).abs() for a, c in zip(fp, fq, strict=True)]
        l_ref, m_ref = naive_latent(
            diffs, [torch.zeros_like(a) for a in absolute], parse_blocks(blocks), 8
        )
        signed, _ = LatentCorrelation(channels, parse_blocks(blocks), 8)(fp, fq)
    torch.testing.assert_close(m, m_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(l_emb, l_ref, rtol=1e-4, atol=1e-5)
    assert bool((m >= 0).all())
    assert not torch.allclose(l_emb, signed, atol=1e-3)


def test_forward_returns_the_unnormalised_z(encoders):
    pre, post = pairs(3, seed=4)
    model = LocalNet(ModelConfig(encoder="resnet18"), encoder=encoders["resnet18"]).eval()
    with torch.no_grad():
        out = model(pre, post)
        e_diff = out.e_pre - out.e_post
    torch.testing.assert_close(out.z_raw, e_diff)
    torch.testing.assert_close(out.z, F.normalize(e_diff, dim=1))
    assert float(out.z_raw.norm(dim=1).max()) <= 2.0 + 1e-5


@pytest.mark.parametrize("shape, size", [((12, 12), 8), ((6, 6), 4), ((7, 10), 5), ((9, 3), 8)])
def test_resize_map_pools_as_adaptive_pooling_does(shape, size):
    from local_damage.models.correlation import resize_map

    x = torch.randn(2, 3, *shape, generator=torch.Generator().manual_seed(1))
    expected = F.adaptive_avg_pool2d(x, (min(shape[0], size), min(shape[1], size)))
    if expected.shape[-2:] != (size, size):
        expected = F.interpolate(expected, size=(size, size), mode="bilinear", align_corners=False)
    torch.testing.assert_close(resize_map(x, size), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_onnx_export_at_an_input_size_whose_maps_do_not_divide_the_latent_grid(tmp_path):
    """96 px: block 2 is 12 px against the 8 px latent grid (ONNX has no adaptive pooling for
    that); the exported graph must still run and agree with PyTorch."""
    import onnxruntime as ort

    net = model("resnet18", seed=2).eval()
    wrapper = LocalInference(net, with_change_map=True).eval()
    g = torch.Generator().manual_seed(5)
    pre, post = torch.randn(2, 3, 96, 96, generator=g), torch.randn(2, 3, 96, 96, generator=g)
    path = tmp_path / "model96.onnx"
    with torch.no_grad():
        torch.onnx.export(
            wrapper,
            (pre, post),
            str(path),
            input_names=["pre", "post"],
            output_names=["logits", "embedding", "change_map"],
            opset_version=17,
            dynamo=False,
        )
        expected = wrapper(pre, post)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {"pre": pre.numpy(), "post": post.numpy()})
    for a, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, e.numpy(), rtol=1e-4, atol=1e-4)
