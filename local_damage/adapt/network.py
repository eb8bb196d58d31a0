"""The network of a model file for fine-tuning: loaded from its fp16 weights, split into a frozen
trunk and a trained top (the last residual blocks and the classifier), and run on chip pairs
(PyTorch, imported inside the functions)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data_prep.errors import LocalDamageError
from runtime.predictor import resize_chips


class FinetuneError(LocalDamageError, ValueError):
    """Fine-tuning cannot run: PyTorch missing, no weights, too few labels."""


#: What to install when PyTorch is missing.
INSTALL = (
    "fine-tuning needs PyTorch and segmentation-models-pytorch, which are not installed here: "
    "pip install 'torch>=2.4' 'torchvision>=0.19' 'segmentation-models-pytorch>=0.3.4' "
    "safetensors (or install local-damage with all its dependencies: pip install -e .); "
    "without them, `local-damage adapt` without --finetune adapts the head in seconds"
)


def require_torch() -> None:
    """Raise :class:`FinetuneError` with :data:`INSTALL` unless PyTorch can be imported."""
    import importlib.util

    for name in ("torch", "segmentation_models_pytorch", "safetensors"):
        if importlib.util.find_spec(name) is None:
            raise FinetuneError(f"{INSTALL} (missing: {name})")


def load_network(weights: str | Path):
    """``(LocalNet in eval mode, config dict)`` from a ``.safetensors`` file whose metadata holds
    the training config (``export --weights``).

    Raises:
        FinetuneError: the file is missing or carries no config.
    """
    require_torch()
    import yaml
    from safetensors import safe_open
    from safetensors.torch import load_file

    from local_damage.config import from_dict
    from local_damage.models import build_model
    from local_damage.train.config import Config

    path = Path(weights)
    if not path.is_file():
        raise FinetuneError(
            f"{path}: no fine-tuning weights; fine-tuning starts from the fp16 weights shipped "
            "beside the model (NAME.safetensors, written by `local-damage export --weights`)"
        )
    with safe_open(str(path), "pt") as fh:
        text = (fh.metadata() or {}).get("config")
    if not text:
        raise FinetuneError(f"{path}: the weights carry no training config in their metadata")
    raw = yaml.safe_load(text)
    cfg = from_dict(Config, raw, where=str(path))
    model_cfg = cfg.model
    model_cfg.weights = None  # never download: every weight comes from the file
    net = build_model(model_cfg)
    state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
    missing, unexpected = net.load_state_dict(state, strict=False)
    if missing:
        raise FinetuneError(f"{path}: weights missing for {len(missing)} tensors ({missing[:3]})")
    return net.eval(), raw


def _blocks(encoder) -> list:
    """The encoder as a sequence: the stem, then each residual block of its four stages."""
    import torch.nn as nn

    stem = nn.Sequential(encoder.conv1, encoder.bn1, encoder.relu, encoder.maxpool)
    return [stem, *encoder.layer1, *encoder.layer2, *encoder.layer3, *encoder.layer4]


def split_network(net, blocks: int):
    """``(trunk, top, trainable parameters)``: the last ``blocks`` residual blocks of the encoder
    (``top``) and the classifier are trained; the rest (``trunk``) is frozen."""
    import torch.nn as nn

    seq = _blocks(net.encoder)
    if not 1 <= blocks < len(seq):
        raise FinetuneError(f"blocks must lie in 1..{len(seq) - 1}, got {blocks}")
    trunk = nn.Sequential(*seq[: len(seq) - blocks])
    top = nn.Sequential(*seq[len(seq) - blocks :])
    for p in net.parameters():
        p.requires_grad_(False)
    params = [*top.parameters(), *net.classifier.parameters()]
    for p in params:
        p.requires_grad_(True)
    return trunk, top, params


def logits_features(net, top, f_pre, f_post):
    """What the classifier reads for trunk features ``f_pre``/``f_post``: the pooled (and, as
    the network does, normalised) pre and post representations, side by side."""
    import torch
    import torch.nn.functional as F

    # pre and post through the block in one call (eval-mode BatchNorm: no batch dependence),
    # faster than two on a few cores
    r = top(torch.cat([f_pre, f_post])).mean(dim=(2, 3))
    r_pre, r_post = r[: len(f_pre)], r[len(f_pre) :]
    if net.cfg.normalize_r:
        r_pre, r_post = F.normalize(r_pre, dim=1), F.normalize(r_post, dim=1)
    return _cat([r_pre, r_post])


def logits_of(net, top, f_pre, f_post):
    return net.classifier(logits_features(net, top, f_pre, f_post))


def _cat(parts):
    import torch

    return torch.cat(parts, dim=1)


def dihedral(x, t: int):
    """Turn ``t`` (0-7) of NCHW images: ``t % 4`` quarter turns, mirrored when ``t >= 4``."""
    import torch

    if t >= 4:
        x = torch.flip(x, dims=(3,))
    return torch.rot90(x, t % 4, dims=(2, 3))


def prepare_chips(chips: np.ndarray, size: int):
    """uint8 ``[N, S, S, 3]`` chips to the network's normalised NCHW input of side ``size``
    (resampled as serving resamples them)."""
    import torch

    from local_damage.data import normalize

    x = torch.from_numpy(np.ascontiguousarray(resize_chips(chips, size))).permute(0, 3, 1, 2)
    return normalize(x)


def trunk_features(trunk, pre, post, turns: Sequence[int] = range(8), batch: int = 64):
    """Frozen features ``[T, 2, N, C, h, w]`` of every turn of the pairs (pre, post NCHW).

    The trunk runs in channels-last memory layout, about a quarter faster on a CPU than the
    default layout (the features are the same up to float rounding); it is left as it was."""
    import torch

    out = []
    fast = torch.channels_last
    try:
        trunk.to(memory_format=fast)
        with torch.no_grad():
            for t in turns:
                both = []
                for x in (pre, post):
                    parts = [
                        trunk(dihedral(x[i : i + batch], t).contiguous(memory_format=fast))
                        for i in range(0, len(x), batch)
                    ]
                    both.append(torch.cat(parts).contiguous())
                out.append(torch.stack(both))
    finally:
        trunk.to(memory_format=torch.contiguous_format)
    return torch.stack(out)


def predict(net, pre: np.ndarray, post: np.ndarray, size: int, batch: int = 64) -> np.ndarray:
    """float32 ``[N, K]`` logits of a network on uint8 chip pairs (resampled to ``size``)."""
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(pre), batch):
            a = prepare_chips(pre[i : i + batch], size)
            b = prepare_chips(post[i : i + batch], size)
            out.append(net.predict(a, b)[0].float().numpy())
    return np.concatenate(out) if out else np.zeros((0, net.cfg.num_classes), np.float32)
