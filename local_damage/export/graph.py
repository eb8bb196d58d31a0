"""The exported graph: a LocalNet wrapped to take uint8 chips, written as fp32 ONNX.

The graph takes what a scoring machine has, uint8 RGB chips ``[N, H, W, 3]`` named ``pre`` and
``post`` (``H = W`` = the run's ``data.input_size``), and does the normalisation itself (cast to
float, NHWC to NCHW, ``(x - MEAN) / STD`` with :data:`local_damage.data.MEAN` and
:data:`~local_damage.data.STD`). It returns ``logits`` ``[N, K]`` and ``embedding`` ``[N, D]``
(the L2-normalised joint embedding ``z``). The batch axis is dynamic. Exported with
``change_map=True`` (``--change-map``), a model with a latent module also returns ``change_map``
``[N, 1, S, S]``, the channel-averaged latent correlation map ("where the model saw change",
Sec. 3.4) that the web app draws as a heatmap; the metadata prop ``outputs`` lists the output
names.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from local_damage.data import MEAN, STD
from local_damage.export.options import DEFAULT_OPSET
from local_damage.models import LocalInference
from runtime.contract import CHANGE_MAP, INPUT_NAMES, OUTPUT_NAMES, save_onnx, set_metadata


class UInt8LocalModel(nn.Module):
    """A LocalNet that takes uint8 NHWC chips and normalises them itself.

    ``forward(pre, post)`` takes uint8 ``[N, H, W, 3]`` RGB tensors and returns ``(logits [N, K],
    embedding [N, D])``, plus ``change_map [N, 1, S, S]`` with ``change_map=True``.
    """

    def __init__(self, net, change_map: bool = False) -> None:
        super().__init__()
        self.inner = LocalInference(net, with_change_map=change_map)
        self.register_buffer("mean", torch.tensor(MEAN, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(STD, dtype=torch.float32).view(1, 3, 1, 1))

    def _prep(self, x: torch.Tensor) -> torch.Tensor:
        return (x.permute(0, 3, 1, 2).float() - self.mean) / self.std

    def forward(self, pre: torch.Tensor, post: torch.Tensor):
        return self.inner(self._prep(pre), self._prep(post))


def uint8_model(model, change_map: bool = False) -> UInt8LocalModel:
    """Wrap a :class:`~local_damage.models.LocalNet` so that it takes uint8 NHWC chips.

    Args:
        model: the LocalNet.
        change_map: also return the latent correlation map (the model needs a latent module).

    Returns:
        A :class:`UInt8LocalModel` in eval mode.
    """
    return UInt8LocalModel(model, change_map=change_map).eval()


def output_names(model, change_map: bool = False) -> tuple[str, ...]:
    """The graph outputs of an export: :data:`OUTPUT_NAMES`, plus :data:`CHANGE_MAP` when asked
    for and the model has a latent module."""
    if change_map and getattr(model, "latent", None) is not None:
        return (*OUTPUT_NAMES, CHANGE_MAP)
    return OUTPUT_NAMES


def export_onnx(
    model,
    path: str | os.PathLike,
    input_size: int,
    metadata: Mapping[str, Any] | None = None,
    opset: int = DEFAULT_OPSET,
    change_map: bool = False,
) -> Path:
    """Export a LocalNet as an fp32 ONNX model with uint8 inputs (see the module docstring).

    Args:
        model: a :class:`~local_damage.models.LocalNet` (moved to CPU, put in eval mode).
        path: the ``.onnx`` file to write (atomically).
        input_size: side ``S`` of the square input chips in pixels.
        metadata: metadata props to store (values JSON-encoded); ``outputs`` is added.
        opset: ONNX opset version.
        change_map: also output ``change_map`` ``[N, 1, S_L, S_L]`` (``S_L`` =
            ``model.cfg.latent_size``) when the model has a latent module; ignored otherwise.

    Returns:
        ``path``.
    """
    import onnx

    path = Path(path)
    model = model.cpu().eval()
    names = output_names(model, change_map)
    wrapper = uint8_model(model, change_map=CHANGE_MAP in names)
    gen = torch.Generator().manual_seed(0)
    dummy = torch.randint(0, 256, (2, input_size, input_size, 3), dtype=torch.uint8, generator=gen)
    batch = {0: "batch"}
    with tempfile.TemporaryDirectory(prefix="export-") as tmp:
        raw = Path(tmp) / "model.onnx"
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter(
                "ignore"
            )  # the TorchScript exporter's deprecation and tracer notes
            torch.onnx.export(
                wrapper,
                (dummy, dummy.flip(0)),
                str(raw),
                input_names=list(INPUT_NAMES),
                output_names=list(names),
                dynamic_axes=dict.fromkeys(INPUT_NAMES + names, batch),
                opset_version=int(opset),
                do_constant_folding=True,
                dynamo=False,
            )
        proto = onnx.load(str(raw))
    # The tracer leaves the embedding width symbolic; it is fixed by the model.
    dims = {"logits": model.cfg.num_classes, "embedding": model.cfg.embed_dim}
    for out in proto.graph.output:
        shape = out.type.tensor_type.shape
        if len(shape.dim) == 2:
            shape.dim[1].Clear()
            shape.dim[1].dim_value = int(dims[out.name])
        elif out.name == CHANGE_MAP and len(shape.dim) == 4:
            side = int(model.cfg.latent_size)
            for axis, value in ((1, 1), (2, side), (3, side)):
                shape.dim[axis].Clear()
                shape.dim[axis].dim_value = value
    proto.producer_name = "local-damage"
    set_metadata(proto, {**dict(metadata or {}), "outputs": list(names)})
    return save_onnx(proto, path)
