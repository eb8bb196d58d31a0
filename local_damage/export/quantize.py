"""Reduced precision: an fp32 model to int8 (static or dynamic) or to fp16, metadata kept.

Torch-free (onnx and onnxruntime only), so the localiser's export uses it too.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from runtime.contract import read_metadata, save_onnx, set_metadata

INT8_METHODS = ("static", "dynamic")


class _ChipReader:
    """An onnxruntime ``CalibrationDataReader`` over uint8 chip pairs, in small batches."""

    def __init__(self, pre: np.ndarray, post: np.ndarray, batch_size: int = 8) -> None:
        self.pre, self.post, self.batch_size = pre, post, batch_size
        self.start = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.start >= len(self.pre):
            return None
        sl = slice(self.start, self.start + self.batch_size)
        self.start += self.batch_size
        return {"pre": self.pre[sl], "post": self.post[sl]}

    def rewind(self) -> None:
        self.start = 0


@contextlib.contextmanager
def _quiet_quantizer() -> Iterator[None]:
    """Silence the quantizer's root-logger notes about the (deliberately) uint8 inputs."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        root.setLevel(level)


def _unshare_weights(proto) -> None:
    """Give every Gemm / MatMul node its own copy of an initializer that several of them use."""
    inits = {t.name: t for t in proto.graph.initializer}
    nodes = [n for n in proto.graph.node if n.op_type in ("Gemm", "MatMul")]
    uses = collections.Counter(x for n in nodes for x in n.input if x in inits)
    seen: collections.Counter = collections.Counter()
    for node in nodes:
        for j, name in enumerate(node.input):
            if uses.get(name, 0) > 1:
                seen[name] += 1
                if seen[name] > 1:
                    copy = proto.graph.initializer.add()
                    copy.CopyFrom(inits[name])
                    copy.name = f"{name}__copy{seen[name]}"
                    node.input[j] = copy.name


def front_end(model) -> list[str]:
    """Names of the nodes an ONNX model runs before its first convolution, in graph order: the
    input's normalisation and, in networks with ``model.pair_norm``, the post chip matched to the
    pre chip. Static int8 keeps them in float: they are a few elementwise ops on the pixels, and
    with uint8 activations the per-chip standardisation lost enough precision to move 1.4% of
    the bundled model's grades against fp32 (0.8% with it in float; docs/export.md)."""
    names = []
    for node in model.graph.node:
        if node.op_type == "Conv":
            return names
        names.append(node.name)
    return []


def quantize_int8(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    calibration: tuple[np.ndarray, np.ndarray] | None = None,
    method: str = "static",
    reader=None,
    extra_props: Mapping[str, Any] | None = None,
) -> Path:
    """Quantize an fp32 model to int8 with onnxruntime.quantization; metadata props are kept.

    Args:
        src: the fp32 ``.onnx`` model.
        dst: the int8 ``.onnx`` model to write.
        calibration: ``(pre, post)`` uint8 ``[N, S, S, 3]`` chips for ``method="static"``.
        method: ``"static"``: QDQ format, per-channel int8 weights, uint8 activations with ranges
            from min/max over the calibration chips (after ``quant_pre_process``), the nodes
            before the first convolution kept in float (:func:`front_end`);
            ``"dynamic"``: int8 weights, activation ranges computed at run time.
        reader: an onnxruntime ``CalibrationDataReader`` to use instead of ``calibration``
            (models with other inputs, e.g. the localiser's images).
        extra_props: metadata props to set on the int8 model besides the ones kept.

    Returns:
        ``dst``.
    """
    import onnx
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if method not in INT8_METHODS:
        raise ValueError(f"unknown int8 method {method!r}: expected one of {INT8_METHODS}")
    src, dst = Path(src), Path(dst)
    props = read_metadata(onnx.load(str(src), load_external_data=False))
    with tempfile.TemporaryDirectory(prefix="quantize-") as tmp, _quiet_quantizer():
        prepared = Path(tmp) / "prepared.onnx"
        out = Path(tmp) / "int8.onnx"
        if method == "static":
            quant_pre_process(str(src), str(prepared))
            if reader is None and (calibration is None or len(calibration[0]) == 0):
                raise ValueError("static int8 quantization needs calibration chips")
            quantize_static(
                str(prepared),
                str(out),
                reader if reader is not None else _ChipReader(*calibration),
                quant_format=QuantFormat.QDQ,
                per_channel=True,
                activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                calibrate_method=CalibrationMethod.MinMax,
                nodes_to_exclude=front_end(onnx.load(str(prepared))),
            )
        else:
            # The quantizer rewrites each Gemm's weight in place; the projection head is shared
            # by the pre and post branches, so its weights must first be one copy per node.
            unshared = Path(tmp) / "unshared.onnx"
            proto = onnx.load(str(src))
            _unshare_weights(proto)
            onnx.save(proto, str(unshared))
            quantize_dynamic(
                str(unshared),
                str(out),
                weight_type=QuantType.QInt8,
                extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
            )
        proto = onnx.load(str(out))
    set_metadata(proto, {**props, **(extra_props or {})}, only=True)
    return save_onnx(proto, dst)


def convert_fp16(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Convert an fp32 model to fp16 weights and activations; inputs and outputs keep their types.

    Uses ``onnxruntime.transformers.float16.convert_float_to_float16`` (``keep_io_types=True``);
    metadata props are kept.
    """
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    proto = onnx.load(str(src))
    props = read_metadata(proto)
    with _quiet_quantizer():
        half = convert_float_to_float16(proto, keep_io_types=True)
    set_metadata(half, props, only=True)
    return save_onnx(half, Path(dst))
