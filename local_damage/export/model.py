"""`local-damage export`: a trained run to a self-describing ONNX model, checked against PyTorch.

The exported graph takes what a scoring machine has, uint8 RGB chips ``[N, H, W, 3]`` named
``pre`` and ``post`` (``H = W`` = the run's ``data.input_size``), and does the normalisation
itself (cast to float, NHWC to NCHW, ``(x - MEAN) / STD`` with :data:`local_damage.data.MEAN` and
:data:`~local_damage.data.STD`). It returns ``logits`` ``[N, K]`` and ``embedding`` ``[N, D]`` (the
L2-normalised joint embedding ``z``). The batch axis is dynamic. Exported with ``change_map=True``
(``--change-map``), a model with a latent module also returns ``change_map`` ``[N, 1, S, S]``,
the channel-averaged latent correlation map ("where the model saw change", Sec. 3.4) that the
web app draws as a heatmap; the metadata prop ``outputs`` lists the output names.

Metadata props (``ModelProto.metadata_props``, every value a JSON string) carry what serving needs
and what a reader of the file should know: ``class_names``, ``chip_spec``, ``input_size``,
``embedding_dim``, ``precision``, ``config`` (the resolved training config),
``validation_metrics``, ``training_data``, ``license``, ``parity``, ``format_version`` and
``created_by``. :mod:`runtime.predictor` reads them back without torch.

Every export is checked on real chips of the run's store (its validation fold when the run has
one, else the first chips of the store): ONNX Runtime fp32 logits must match PyTorch within
:data:`LOGIT_TOLERANCE`, or nothing is written. An int8 (``--quantize int8``) or fp16 (``--fp16``)
model is compared with the fp32 one: argmax agreement (target :data:`AGREEMENT_TARGET`) and the
change of validation macro-F1. The report is stored in the model (``parity``) and beside it as
``NAME.parity.json``.

With ``calibrate_fold`` (``--calibrate-fold K``) the written model is then calibrated by
:func:`local_damage.evaluation.calibrate.calibrate_model` on fold ``K`` of the same chip store: a
temperature in the ``calibration`` metadata prop that the predictor applies to the probabilities.
It also gets the class prototypes of the other folds (except the run's ``--holdout`` fold) and the
threshold of the ``ood`` abstain flag chosen on fold ``K``, in the ``ood`` metadata prop.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.errors import LocalDamageError
from runtime.contract import (
    CHANGE_MAP,
    CPU_ONLY,
    FORMAT_VERSION,
    INPUT_NAMES,
    OUTPUT_NAMES,
    open_session,
    read_metadata,
    save_onnx,
    set_metadata,
)

DEFAULT_OPSET = 17
#: Largest accepted |logit| difference between ONNX Runtime fp32 and PyTorch.
LOGIT_TOLERANCE = 1e-4
#: Target share of chips on which an int8 / fp16 model picks the fp32 model's class.
AGREEMENT_TARGET = 0.99
#: Attribution a model trained on xBD chips must carry, and its licence.
XBD_CREDIT = "xBD (Gupta et al. 2019), CC BY-NC-SA 4.0"
XBD_LICENSE = "CC BY-NC-SA 4.0"
#: Event-name prefix of the synthetic xBD-format data of :mod:`data_prep.synthetic`.
SYNTHETIC_EVENT_PREFIX = "synthetic-"
INT8_METHODS = ("static", "dynamic")


class ExportError(LocalDamageError, RuntimeError):
    """An export that cannot be done or failed its parity check; the message says why."""


# --------------------------------------------------------------------------------------------
# The graph


def uint8_model(model, change_map: bool = False):
    """Wrap a :class:`~local_damage.models.LocalNet` so that it takes uint8 NHWC chips.

    Args:
        model: the LocalNet.
        change_map: also return the latent correlation map (the model needs a latent module).

    Returns:
        An ``nn.Module`` in eval mode whose ``forward(pre, post)`` takes uint8 ``[N, H, W, 3]``
        RGB tensors and returns ``(logits [N, K], embedding [N, D])``, plus
        ``change_map [N, 1, S, S]`` with ``change_map=True``.
    """
    import torch
    from torch import nn

    from local_damage.data import MEAN, STD
    from local_damage.models import LocalInference

    class UInt8LocalModel(nn.Module):
        def __init__(self, net) -> None:
            super().__init__()
            self.inner = LocalInference(net, with_change_map=change_map)
            self.register_buffer("mean", torch.tensor(MEAN, dtype=torch.float32).view(1, 3, 1, 1))
            self.register_buffer("std", torch.tensor(STD, dtype=torch.float32).view(1, 3, 1, 1))

        def _prep(self, x: torch.Tensor) -> torch.Tensor:
            return (x.permute(0, 3, 1, 2).float() - self.mean) / self.std

        def forward(self, pre: torch.Tensor, post: torch.Tensor):
            return self.inner(self._prep(pre), self._prep(post))

    return UInt8LocalModel(model).eval()


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
    import torch

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


# --------------------------------------------------------------------------------------------
# Reduced precision


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
    import collections

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
            from min/max over the calibration chips (after ``quant_pre_process``);
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


# --------------------------------------------------------------------------------------------
# Running both sides


def ort_outputs(
    session, pre: np.ndarray, post: np.ndarray, batch_size: int = 32
) -> tuple[np.ndarray, np.ndarray]:
    """``(logits [N, K], embedding [N, D])`` float32 of an ONNX session over uint8 chip pairs."""
    logits, emb = [], []
    for i in range(0, len(pre), batch_size):
        lo, em = session.run(
            list(OUTPUT_NAMES), {"pre": pre[i : i + batch_size], "post": post[i : i + batch_size]}
        )
        logits.append(lo.astype(np.float32))
        emb.append(em.astype(np.float32))
    return np.concatenate(logits), np.concatenate(emb)


def torch_outputs(
    model, pre: np.ndarray, post: np.ndarray, batch_size: int = 32
) -> tuple[np.ndarray, np.ndarray]:
    """``(logits [N, K], embedding [N, D])`` of a LocalNet in PyTorch (CPU, fp32) over uint8 chips."""
    import torch

    wrapper = uint8_model(model.cpu().eval())
    logits, emb = [], []
    with torch.inference_mode():
        for i in range(0, len(pre), batch_size):
            lo, em = wrapper(
                torch.from_numpy(np.ascontiguousarray(pre[i : i + batch_size])),
                torch.from_numpy(np.ascontiguousarray(post[i : i + batch_size])),
            )
            logits.append(lo.numpy())
            emb.append(em.numpy())
    return np.concatenate(logits), np.concatenate(emb)


# --------------------------------------------------------------------------------------------
# A run and its chips


@dataclass
class RunInfo:
    """What an export needs from a run folder.

    Attributes:
        path: the run folder.
        cfg: the resolved training :class:`~local_damage.train.config.Config`.
        summary: ``summary.json``.
        metrics: rows of ``metrics.csv`` (dicts of text), possibly empty.
        model: the LocalNet with the run's best weights, on CPU, in eval mode.
    """

    path: Path
    cfg: Any
    summary: dict
    metrics: list[dict]
    model: Any


def load_run(run: str | os.PathLike) -> RunInfo:
    """Rebuild the model of a run folder with its best weights.

    Raises:
        ExportError: the folder lacks config.yaml, summary.json or weights, or they do not fit.
    """
    from local_damage.config import ConfigError, load_yaml
    from local_damage.models import build_model
    from local_damage.train import checkpoint as ckpt
    from local_damage.train.config import Config
    from local_damage.train.loop import model_config_for

    run = Path(run)
    if not run.is_dir():
        raise ExportError(f"{run}: run folder not found")
    for name in ("config.yaml", "summary.json"):
        if not (run / name).is_file():
            raise ExportError(
                f"{run / name}: missing; is {run} a finished `local-damage train` run folder?"
            )
    try:
        cfg = load_yaml(Config, run / "config.yaml")
    except ConfigError as exc:
        raise ExportError(str(exc)) from exc
    try:
        summary = json.loads((run / "summary.json").read_text())
    except json.JSONDecodeError as exc:
        raise ExportError(f"{run / 'summary.json'}: not valid JSON ({exc})") from exc
    metrics: list[dict] = []
    if (run / "metrics.csv").is_file():
        with open(run / "metrics.csv", newline="") as fh:
            metrics = list(csv.DictReader(fh))
    model = build_model(replace(model_config_for(cfg), weights=None))
    try:
        weights = ckpt.resolve_weights(run)
        ckpt.load_weights(model, weights)
    except (FileNotFoundError, ValueError) as exc:
        raise ExportError(str(exc)) from exc
    except RuntimeError as exc:  # state dict does not fit the config
        raise ExportError(f"{run}: weights do not fit config.yaml ({exc})") from exc
    return RunInfo(run, cfg, summary, metrics, model.eval())


def is_xbd_store(meta: Mapping[str, Any], events: Sequence[str]) -> bool:
    """Whether chips came from real xBD tiles: an xBD-source store with a non-synthetic event."""
    return meta.get("source") == "xbd" and any(
        not str(e).startswith(SYNTHETIC_EVENT_PREFIX) for e in events
    )


def training_data_info(
    meta: Mapping[str, Any], events: Sequence[str], chips: str | None, train_chips: int | None
) -> tuple[dict[str, Any], str | None]:
    """``(training_data, license)`` metadata of a model trained on a chip store.

    Args:
        meta: the store's ``store.json`` (``source`` is ``xbd`` or ``scene``).
        events: the events of the training chips.
        chips: the chip store path.
        train_chips: number of training chips.

    Returns:
        The ``training_data`` dict (events, chips, source, train_chips, and ``credit`` for xBD)
        and the licence the model must carry (``None`` when the data's terms are not known).
    """
    source = meta.get("source") or "unknown"
    if source == "xbd" and not is_xbd_store(meta, events):
        source = "synthetic xBD-format data (data_prep.synthetic)"
    info: dict[str, Any] = {
        "source": source,
        "events": sorted(map(str, events)),
        "chips": chips,
        "train_chips": train_chips,
    }
    licence = None
    if is_xbd_store(meta, events):
        info["source"] = "xBD"
        info["credit"] = XBD_CREDIT
        licence = XBD_LICENSE
    return info, licence


def validation_metrics(summary: Mapping[str, Any], metrics: Sequence[Mapping[str, str]]) -> dict:
    """Best validation macro-F1 and accuracy of a run, with its fold and epoch."""
    best_epoch = summary.get("best_epoch")
    accuracy = None
    for row in metrics:
        if str(row.get("epoch")) == str(best_epoch) and row.get("val_accuracy") not in (None, ""):
            accuracy = float(row["val_accuracy"])
    return {
        "fold": summary.get("fold"),
        "macro_f1": summary.get("best_val_macro_f1"),
        "accuracy": accuracy,
        "epoch": best_epoch,
        "val_chips": summary.get("val_chips"),
    }


def summarize_test_metrics(path: str | os.PathLike) -> dict[str, Any]:
    """The headline figures of an ``evaluate`` metrics.json, for a model's metadata.

    Raises:
        ExportError: the file is missing, not JSON, or lacks accuracy / macro_f1.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ExportError(f"{path}: test metrics file not found") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExportError(f"{path}: not a metrics.json of `local-damage evaluate` ({exc})") from exc
    if not isinstance(data, dict) or "accuracy" not in data or "macro_f1" not in data:
        raise ExportError(
            f"{path}: no accuracy / macro_f1; expected `local-damage evaluate` output"
        )
    per_class = data.get("per_class") or {}
    return {
        "accuracy": data["accuracy"],
        "macro_f1": data["macro_f1"],
        "xview2_damage_f1": data.get("xview2_damage_f1"),
        "f1": {name: v.get("f1") for name, v in per_class.items() if isinstance(v, dict)},
        "n": data.get("n"),
        "source": str(path),
    }


def _resolve_chips(info: RunInfo, chips: str | os.PathLike | None) -> Path:
    from data_prep.store import MANIFEST

    path = Path(chips) if chips is not None else Path(str(info.summary.get("chips") or ""))
    if not str(path) or not (path / MANIFEST).is_file():
        raise ExportError(
            f"{info.path}: the run's chip store {str(path) or '(not recorded)'} has no "
            f"{MANIFEST}; pass --chips CHIPS with the store the run was trained on"
        )
    return path


def load_chips(
    chips: str | os.PathLike, chip_ids: Sequence[str], input_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(pre, post, labels)`` of chips resized to the model input as in training.

    Returns:
        uint8 ``[N, S, S, 3]`` pre and post chips and int ``[N]`` labels (-1 unlabelled).
    """
    from local_damage.data import ChipPairDataset

    ds = ChipPairDataset(chips, list(chip_ids), input_size, augment=False)
    n = len(ds)
    pre = np.empty((n, input_size, input_size, 3), np.uint8)
    post = np.empty_like(pre)
    for i in range(n):
        a, b, _ = ds[i]
        pre[i] = a.numpy().transpose(1, 2, 0)
        post[i] = b.numpy().transpose(1, 2, 0)
    return pre, post, ds.labels.copy()


def chip_selection(
    chips: str | os.PathLike, fold: int | None, parity_limit: int, calibration_limit: int
) -> tuple[list[str], str, list[str]]:
    """Chips for the parity check and for int8 calibration.

    Returns:
        ``(parity_ids, description, calibration_ids)``: the validation fold's chips (at most
        ``parity_limit``) when ``fold`` is set and the store has splits.csv, else the first
        ``parity_limit`` chips of the store; calibration chips come from the training side of
        the fold (or the whole store), at most ``calibration_limit``, spread evenly.
    """
    from data_prep.split import SPLITS, fold_indices
    from data_prep.store import read_manifest

    chips = Path(chips)
    if fold is not None and (chips / SPLITS).is_file():
        train_ids, val_ids = fold_indices(chips, int(fold))
        parity = val_ids[:parity_limit]
        what = f"validation fold {fold} of {chips}"
        if len(val_ids) > parity_limit:
            what += f" (first {parity_limit} of {len(val_ids)})"
    else:
        train_ids = read_manifest(chips)["chip_id"].tolist()
        parity = train_ids[:parity_limit]
        what = f"first {len(parity)} chips of {chips} (no validation fold)"
    if len(train_ids) > calibration_limit:
        step = len(train_ids) / calibration_limit
        train_ids = [train_ids[int(i * step)] for i in range(calibration_limit)]
    return parity, what, train_ids


# --------------------------------------------------------------------------------------------
# Parity


def _scores(labels: np.ndarray, logits: np.ndarray, class_names: Sequence[str]) -> dict:
    from local_damage.metrics import classification_metrics

    keep = labels >= 0
    if not keep.any():
        return {"macro_f1": None, "accuracy": None}
    m = classification_metrics(labels[keep], logits[keep].argmax(1), class_names)
    return {"macro_f1": round(m["macro_f1"], 6), "accuracy": round(m["accuracy"], 6)}


def variant_report(
    fp32_logits: np.ndarray,
    logits: np.ndarray,
    labels: np.ndarray,
    class_names: Sequence[str],
    method: str,
) -> dict[str, Any]:
    """How a reduced-precision model compares with the fp32 one on the same chips."""
    agree = float(np.mean(fp32_logits.argmax(1) == logits.argmax(1))) if len(logits) else 1.0
    ref, got = _scores(labels, fp32_logits, class_names), _scores(labels, logits, class_names)
    diff = None
    if ref["macro_f1"] is not None:
        diff = round(got["macro_f1"] - ref["macro_f1"], 6)
    return {
        "method": method,
        "argmax_agreement_with_fp32": round(agree, 6),
        "agreement_target": AGREEMENT_TARGET,
        "meets_target": agree >= AGREEMENT_TARGET,
        "max_abs_logit_diff_vs_fp32": float(np.abs(fp32_logits - logits).max(initial=0.0)),
        "macro_f1": got["macro_f1"],
        "accuracy": got["accuracy"],
        "macro_f1_diff_vs_fp32": diff,
    }


def export_run(
    run: str | os.PathLike,
    out: str | os.PathLike,
    quantize: str | None = None,
    fp16: bool = False,
    opset: int = DEFAULT_OPSET,
    chips: str | os.PathLike | None = None,
    parity_limit: int = 512,
    calibration_limit: int = 128,
    int8_method: str = "static",
    threads: int | None = None,
    change_map: bool = False,
    test_metrics: str | os.PathLike | None = None,
    calibrate_fold: int | None = None,
) -> dict[str, Any]:
    """Export a run's best weights to ``out`` and check it; returns the parity report.

    Args:
        run: the run folder (config.yaml, summary.json, best.safetensors).
        out: the ``.onnx`` file to write; the report goes to ``out`` with ``.parity.json``.
        quantize: ``None`` or ``"int8"``.
        fp16: write an fp16 model (weights and activations; uint8 inputs, float32 outputs).
        opset: ONNX opset version.
        chips: the chip store for the parity check (default: the one recorded in the run).
        parity_limit: at most this many chips for the parity check.
        calibration_limit: at most this many training chips to calibrate int8 ranges.
        int8_method: ``"static"`` or ``"dynamic"`` (see :func:`quantize_int8`).
        threads: ONNX Runtime intra-op threads for the check (default: its own choice).
        change_map: also output the latent correlation map (see :func:`export_onnx`).
        test_metrics: a ``metrics.json`` of ``local-damage evaluate`` on held-out data, stored as
            the ``test_metrics`` metadata (for a model trained on everything, the figures of
            the same recipe trained without the held-out tiles; say so in its model card).
        calibrate_fold: fit a temperature to the written model on this fold of the chip store
            (the run's validation fold; see :mod:`local_damage.evaluation.calibrate`).

    Returns:
        The parity report: ``chips`` (what was compared), ``fp32`` (max |logit| and |embedding|
        differences to PyTorch, argmax agreement, macro-F1), and ``int8`` or ``fp16`` (see
        :func:`variant_report`), ``precision``, versions; with ``calibrate_fold``, also
        ``calibration``, the block stored in the model (not part of ``NAME.parity.json``).

    Raises:
        ExportError: the run cannot be exported or ONNX Runtime fp32 logits differ from PyTorch
            by more than :data:`LOGIT_TOLERANCE` (nothing is written then).
    """
    import onnxruntime as ort
    import torch

    from data_prep.spec import CLASS_NAMES, ChipSpec
    from data_prep.store import read_meta, write_json
    from local_damage import __version__
    from local_damage.config import to_dict

    out = Path(out)
    if out.suffix != ".onnx":
        raise ExportError(f"{out}: the model file name must end in .onnx")
    if quantize not in (None, "int8"):
        raise ExportError(f"unknown --quantize {quantize!r}: expected int8")
    if quantize and fp16:
        raise ExportError("choose one of --quantize int8 and --fp16")
    info = load_run(run)
    tested = summarize_test_metrics(test_metrics) if test_metrics is not None else None
    store = _resolve_chips(info, chips)
    if calibrate_fold is not None:  # a missing fold fails here, before any work
        from local_damage.evaluation.evaluate import select_chips

        select_chips(store, calibrate_fold)
    meta = read_meta(store)
    spec_dict = info.summary.get("chip_spec") or meta.get("spec")
    if not spec_dict:
        raise ExportError(
            f"{info.path / 'summary.json'}: no chip_spec, and {store} has no store.json spec"
        )
    spec = ChipSpec.from_dict(spec_dict)
    cfg = info.cfg
    size = int(cfg.data.input_size)
    k = int(info.model.cfg.num_classes)
    class_names = list(CLASS_NAMES[:k])
    training, licence = training_data_info(
        meta,
        info.summary.get("events") or [],
        str(info.summary.get("chips") or store),
        info.summary.get("train_chips"),
    )
    precision = "int8" if quantize else "fp16" if fp16 else "fp32"
    props: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "created_by": f"local-damage {__version__}",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "class_names": class_names,
        "chip_spec": spec.to_dict(),
        "input_size": size,
        "embedding_dim": int(info.model.cfg.embed_dim),
        "precision": precision,
        "config": to_dict(cfg),
        "validation_metrics": validation_metrics(info.summary, info.metrics),
        "training_data": training,
        "license": licence,
        "run": str(info.path),
    }
    if tested is not None:
        props["test_metrics"] = tested

    parity_ids, parity_what, calib_ids = chip_selection(
        store, info.summary.get("fold"), parity_limit, calibration_limit
    )
    if not parity_ids:
        raise ExportError(f"{store}: no chips for the parity check")
    pre, post, labels = load_chips(store, parity_ids, size)

    with tempfile.TemporaryDirectory(prefix="export-") as tmp:
        fp32_path = Path(tmp) / "fp32.onnx"
        export_onnx(info.model, fp32_path, size, props, opset, change_map=change_map)
        t_logits, t_emb = torch_outputs(info.model, pre, post)
        session = open_session(fp32_path, CPU_ONLY, threads)[0]
        o_logits, o_emb = ort_outputs(session, pre, post)
        del session
        logit_diff = float(np.abs(t_logits - o_logits).max(initial=0.0))
        report: dict[str, Any] = {
            "chips": {
                "store": str(store),
                "selection": parity_what,
                "count": len(pre),
                "labelled": int((labels >= 0).sum()),
                "input_size": size,
            },
            "fp32": {
                "max_abs_logit_diff_vs_pytorch": logit_diff,
                "max_abs_embedding_diff_vs_pytorch": float(np.abs(t_emb - o_emb).max(initial=0.0)),
                "tolerance": LOGIT_TOLERANCE,
                "argmax_agreement_with_pytorch": round(
                    float(np.mean(t_logits.argmax(1) == o_logits.argmax(1))), 6
                ),
                **_scores(labels, o_logits, class_names),
            },
            "precision": precision,
            "opset": int(opset),
            "onnxruntime": ort.__version__,
            "torch": torch.__version__.split("+")[0],
        }
        if not logit_diff <= LOGIT_TOLERANCE:
            raise ExportError(
                f"{out}: ONNX Runtime fp32 logits differ from PyTorch by up to {logit_diff:.3g} "
                f"(tolerance {LOGIT_TOLERANCE:g}) on {len(pre)} chips ({parity_what}); "
                "nothing was written"
            )
        final = fp32_path
        if quantize or fp16:
            final = Path(tmp) / f"{precision}.onnx"
            if quantize:
                calib = load_chips(store, calib_ids, size)[:2]
                quantize_int8(fp32_path, final, calib, method=int8_method)
                method = (
                    f"static QDQ, per-channel int8 weights, uint8 activations, MinMax calibration "
                    f"on {len(calib[0])} training chips"
                    if int8_method == "static"
                    else "dynamic: int8 weights, activation ranges at run time"
                )
            else:
                convert_fp16(fp32_path, final)
                method = "fp16 weights and activations (float16 converter of onnxruntime)"
            v_logits, _ = ort_outputs(open_session(final, CPU_ONLY, threads)[0], pre, post)
            report[precision] = variant_report(o_logits, v_logits, labels, class_names, method)
        import onnx

        proto = onnx.load(str(final))
        set_metadata(proto, {"parity": report})
        calibration = None
        if calibrate_fold is None:
            save_onnx(proto, out)
        else:  # calibrated from a staged copy, so a failed fit leaves nothing behind
            from local_damage.evaluation.calibrate import calibrate_model, store_folds

            # prototypes of the ood flag: the training folds (not the held-out fold)
            holdout = info.summary.get("holdout")
            folds = [f for f in store_folds(store) if f not in (calibrate_fold, holdout)]
            staged = save_onnx(proto, Path(tmp) / "staged.onnx")
            calibrated = calibrate_model(
                staged, store, out, fold=calibrate_fold, prototype_folds=folds
            )
            calibration, ood = calibrated["calibration"], calibrated["ood"]
    write_json(out.with_suffix(".parity.json"), report)
    if calibration is None:
        return report
    return {**report, "calibration": calibration, "ood": ood}


def format_report(report: Mapping[str, Any], out: str | os.PathLike) -> str:
    """A short human-readable parity report."""
    c, f = report["chips"], report["fp32"]
    lines = [
        f"{out}: {report['precision']} model, opset {report['opset']}, "
        f"onnxruntime {report['onnxruntime']}",
        f"parity chips: {c['count']} ({c['labelled']} labelled) from {c['selection']}, "
        f"at {c['input_size']} px",
        f"fp32 vs PyTorch: max |logit diff| {f['max_abs_logit_diff_vs_pytorch']:.2e} "
        f"(tolerance {f['tolerance']:g}), max |embedding diff| "
        f"{f['max_abs_embedding_diff_vs_pytorch']:.2e}, argmax agreement "
        f"{f['argmax_agreement_with_pytorch']:.2%}, macro-F1 {_fmt(f['macro_f1'])}",
    ]
    for name in ("int8", "fp16"):
        v = report.get(name)
        if not v:
            continue
        flag = "" if v["meets_target"] else f"  BELOW the {v['agreement_target']:.0%} target"
        lines.append(
            f"{name} vs fp32: argmax agreement {v['argmax_agreement_with_fp32']:.2%}{flag}, "
            f"max |logit diff| {v['max_abs_logit_diff_vs_fp32']:.3g}, macro-F1 "
            f"{_fmt(v['macro_f1'])} (change {_fmt(v['macro_f1_diff_vs_fp32'], sign=True)}); "
            f"{v['method']}"
        )
    if report.get("calibration"):
        from local_damage.evaluation.calibrate import format_block, format_ood

        lines.append(format_block(report["calibration"]))
        lines.append(format_ood(report.get("ood")))
    return "\n".join(lines)


def _fmt(x: float | None, sign: bool = False) -> str:
    if x is None:
        return "n/a (no labelled chips)"
    return f"{x:+.4f}" if sign else f"{x:.4f}"


# --------------------------------------------------------------------------------------------
# CLI


def export_weights(run: str | Path, out: str | Path) -> Path:
    """Write the run's best weights as fp16 safetensors (for ``train --init``), atomically.

    Floating-point tensors are stored in fp16 (half the size; fine-tuning loads them into an fp32
    model); integer buffers (BatchNorm counters) are kept. The run's config travels in the
    file's metadata.
    """
    from safetensors.torch import load_file, save_file

    from data_prep.store import atomic_path
    from local_damage.train.checkpoint import resolve_weights

    run = Path(run)
    state = load_file(str(resolve_weights(run)))
    half = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
    config = run / "config.yaml"
    metadata = {"config": config.read_text()} if config.is_file() else {}
    metadata["source"] = "local-damage export --weights"
    with atomic_path(out, suffix=".safetensors") as tmp:
        save_file({k: v.contiguous() for k, v in half.items()}, str(tmp), metadata=metadata)
    return Path(out)
