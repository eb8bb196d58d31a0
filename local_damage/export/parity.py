"""The export's check: ONNX Runtime against PyTorch on real chips, and reduced precision against
fp32.

ONNX Runtime fp32 logits must match PyTorch within :data:`LOGIT_TOLERANCE` on the chips of
:func:`chip_selection`, or nothing is written. An int8 or fp16 model is compared with the fp32
one: argmax agreement (target :data:`AGREEMENT_TARGET`) and the change of validation macro-F1
(:func:`variant_report`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data_prep.split import SPLITS, fold_indices
from data_prep.store import read_manifest
from local_damage.data import ChipPairDataset
from local_damage.export.graph import uint8_model
from local_damage.export.options import ExportError
from runtime.contract import OUTPUT_NAMES
from runtime.metrics import classification_metrics

#: Largest accepted |logit| difference between ONNX Runtime fp32 and PyTorch.
LOGIT_TOLERANCE = 1e-4
#: Target share of chips on which an int8 / fp16 model picks the fp32 model's class.
AGREEMENT_TARGET = 0.99


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
# The chips


def load_chips(
    chips: str | os.PathLike, chip_ids: Sequence[str], input_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(pre, post, labels)`` of chips resized to the model input as in training.

    Returns:
        uint8 ``[N, S, S, 3]`` pre and post chips and int ``[N]`` labels (-1 unlabelled).
    """
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
# The reports


def label_scores(labels: np.ndarray, logits: np.ndarray, class_names: Sequence[str]) -> dict:
    """``{"macro_f1", "accuracy"}`` of the labelled chips (both None when none is labelled)."""
    keep = labels >= 0
    if not keep.any():
        return {"macro_f1": None, "accuracy": None}
    m = classification_metrics(labels[keep], logits[keep].argmax(1), class_names)
    return {"macro_f1": round(m["macro_f1"], 6), "accuracy": round(m["accuracy"], 6)}


def fp32_report(
    torch_logits: np.ndarray,
    torch_embedding: np.ndarray,
    logits: np.ndarray,
    embedding: np.ndarray,
    labels: np.ndarray,
    class_names: Sequence[str],
) -> dict[str, Any]:
    """How the ONNX Runtime fp32 outputs compare with PyTorch's on the same chips."""
    return {
        "max_abs_logit_diff_vs_pytorch": float(np.abs(torch_logits - logits).max(initial=0.0)),
        "max_abs_embedding_diff_vs_pytorch": float(
            np.abs(torch_embedding - embedding).max(initial=0.0)
        ),
        "tolerance": LOGIT_TOLERANCE,
        "argmax_agreement_with_pytorch": round(
            float(np.mean(torch_logits.argmax(1) == logits.argmax(1))), 6
        ),
        **label_scores(labels, logits, class_names),
    }


def check_fp32(report: Mapping[str, Any], out: str | os.PathLike) -> None:
    """Raise :class:`~local_damage.export.options.ExportError` when the fp32 logits of a parity
    report differ from PyTorch by more than :data:`LOGIT_TOLERANCE`."""
    diff, chips = report["fp32"]["max_abs_logit_diff_vs_pytorch"], report["chips"]
    if not diff <= LOGIT_TOLERANCE:
        raise ExportError(
            f"{out}: ONNX Runtime fp32 logits differ from PyTorch by up to {diff:.3g} "
            f"(tolerance {LOGIT_TOLERANCE:g}) on {chips['count']} chips ({chips['selection']}); "
            "nothing was written"
        )


def variant_report(
    fp32_logits: np.ndarray,
    logits: np.ndarray,
    labels: np.ndarray,
    class_names: Sequence[str],
    method: str,
) -> dict[str, Any]:
    """How a reduced-precision model compares with the fp32 one on the same chips."""
    agree = float(np.mean(fp32_logits.argmax(1) == logits.argmax(1))) if len(logits) else 1.0
    ref = label_scores(labels, fp32_logits, class_names)
    got = label_scores(labels, logits, class_names)
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
    return "\n".join(lines)


def _fmt(x: float | None, sign: bool = False) -> str:
    if x is None:
        return "n/a (no labelled chips)"
    return f"{x:+.4f}" if sign else f"{x:.4f}"
