"""`local-damage localize export`: a localiser run to a self-describing ONNX model.

The graph (:class:`~local_damage.localize.model.UInt8Localizer`) takes ``image`` uint8
``[N, H, W, 3]`` (N, H and W dynamic; H and W multiples of 32) and returns ``building`` float32
``[N, H, W]``, the building probability (normalisation and sigmoid are inside). Metadata props,
each value JSON text: ``format_version`` (1), ``task`` (``"localize"``), ``tile_size``, ``flip_tta``,
``scale``, ``threshold``, ``min_area_px``, ``largest_building_px`` (the largest building
footprint of the training tiles, native pixels; scoring flags larger detections ``oversized``),
``trained_on``, ``license``, ``training`` (the
resolved config), ``metrics`` (held-out and validation pixel figures, tiles and folds),
``training_data``, ``precision``, ``parity``, ``created_by`` and ``created``.

Every export is checked on a real tile (the run's first validation tile, else its first training
tile) resized by the run's scale: ONNX Runtime fp32 probabilities must match PyTorch within
:data:`PROB_TOLERANCE`, at the full window and at a smaller one (the shapes are dynamic), or
nothing is written. An int8 model (``--quantize int8``: static QDQ, per-channel int8 weights,
uint8 activations with ranges from windows of training tiles) is compared with the fp32 one.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from data_prep.masks import find_mask_tiles, largest_building_px, load_mask_tile
from data_prep.xbd_tiles import as_roots, roots_label
from local_damage import __version__
from local_damage.config import load_yaml, to_dict
from local_damage.export.options import DEFAULT_OPSET
from local_damage.export.provenance import SYNTHETIC_EVENT_PREFIX, XBD_CREDIT
from local_damage.export.quantize import quantize_int8
from local_damage.localize.config import LocalizeConfig
from local_damage.localize.model import UInt8Localizer, build_unet, torch_model
from local_damage.localize.train import BEST, SUMMARY
from runtime.contract import (
    CPU_ONLY,
    FORMAT_VERSION,
    LOCALIZE_TASK,
    LOCALIZER_INPUT,
    LOCALIZER_OUTPUT,
    open_session,
    save_onnx,
    set_metadata,
)
from runtime.localize_errors import (
    LocalizeError,
    LocalizeFileNotFoundError,
    LocalizerExportError,
)

#: Largest accepted |probability| difference between ONNX Runtime fp32 and PyTorch.
PROB_TOLERANCE = 1e-4
#: The licence a localiser trained on xBD carries (SPDX identifier).
XBD_SPDX = "CC-BY-NC-SA-4.0"


def load_localize_run(run: str | os.PathLike):
    """``(config, summary, net)`` of a localiser run folder, the net with its best weights.

    Raises:
        LocalizeFileNotFoundError: the folder lacks config.yaml, summary.json or best.safetensors.
        LocalizeError: the weights do not fit the config (ConfigError: the config is not valid).
    """
    run = Path(run)
    for name in ("config.yaml", SUMMARY, BEST):
        if not (run / name).is_file():
            raise LocalizeFileNotFoundError(
                f"{run / name}: missing; is {run} a finished `local-damage localize train` run?"
            )
    cfg = load_yaml(LocalizeConfig, run / "config.yaml")
    summary = json.loads((run / SUMMARY).read_text())
    # the run's weights replace the encoder's initial ones, which need not be on this machine
    net = build_unet(replace(cfg.model, encoder_weights=None))
    try:
        net.load_state_dict(load_file(str(run / BEST)))
    except RuntimeError as exc:
        raise LocalizeError(f"{run}: weights do not fit config.yaml ({exc})") from exc
    return cfg, summary, net.eval()


def export_graph(
    net, path: str | os.PathLike, metadata: dict[str, Any], opset: int, flip_tta: bool = False
) -> Path:
    """Write the fp32 uint8-in / probability-out graph of a U-Net with ``metadata`` props (with
    ``flip_tta``, the average over flips is part of the graph)."""
    import onnx

    wrapper = UInt8Localizer(net.cpu().eval(), flip_tta).eval()
    dummy = torch.randint(
        0, 256, (1, 128, 160, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    axes = {0: "batch", 1: "height", 2: "width"}
    with tempfile.TemporaryDirectory(prefix="export-") as tmp:
        raw = Path(tmp) / "model.onnx"
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                wrapper,
                (dummy,),
                str(raw),
                input_names=[LOCALIZER_INPUT],
                output_names=[LOCALIZER_OUTPUT],
                dynamic_axes={LOCALIZER_INPUT: axes, LOCALIZER_OUTPUT: axes},
                opset_version=int(opset),
                do_constant_folding=True,
                dynamo=False,
            )
        proto = onnx.load(str(raw))
    proto.producer_name = "local-damage"
    set_metadata(proto, metadata)
    return save_onnx(proto, Path(path))


class _WindowReader:
    """onnxruntime ``CalibrationDataReader`` over uint8 windows ``[1, h, w, 3]``."""

    def __init__(self, windows: list[np.ndarray]) -> None:
        self.windows, self.i = windows, 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.i >= len(self.windows):
            return None
        self.i += 1
        return {LOCALIZER_INPUT: self.windows[self.i - 1][None]}

    def rewind(self) -> None:
        self.i = 0


def quantize_localizer(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    windows: list[np.ndarray] | None = None,
    method: str = "static",
) -> Path:
    """int8 copy of an fp32 localiser; metadata props kept (``precision`` set to ``int8``).

    Args:
        src, dst: fp32 model in, int8 model out.
        windows: uint8 ``[h, w, 3]`` calibration windows (static method).
        method: ``"static"`` (QDQ, per-channel int8 weights, uint8 activations, min/max ranges)
            or ``"dynamic"`` (int8 weights, activation ranges at run time).
    """
    if method == "static" and not windows:
        raise LocalizeError("static int8 quantization needs calibration windows")
    return quantize_int8(
        src,
        dst,
        method=method,
        reader=_WindowReader(windows) if method == "static" else None,
        extra_props={"precision": "int8"},
    )


def _summarize_test_metrics(path: str | os.PathLike) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise LocalizeFileNotFoundError(str(exc)) from exc
    except json.JSONDecodeError as exc:
        raise LocalizeError(str(exc)) from exc
    keys = ("fold", "precision", "recall", "f1", "threshold", "min_area_px", "tiles", "split")
    missing = [k for k in ("fold", "precision", "recall", "f1") if k not in data]
    if missing:
        raise LocalizeError(
            f"{path}: not a `localize evaluate --out` file (missing {', '.join(missing)})"
        )
    return {**{k: data.get(k) for k in keys}, "model": data.get("model"), "source": str(path)}


def export_localizer(
    run: str | os.PathLike,
    out: str | os.PathLike,
    *,
    root: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    quantize: str | None = None,
    int8_method: str = "static",
    test_metrics: str | os.PathLike | None = None,
    opset: int = DEFAULT_OPSET,
) -> dict[str, Any]:
    """Export a localiser run to ``out`` (see the module docstring) and return the parity report.

    Args:
        run: run folder of ``local-damage localize train``.
        out: the ``.onnx`` file to write.
        root: xBD root (or roots) for the parity tile and int8 calibration (default: the
            run's).
        quantize: None (fp32) or ``"int8"``.
        int8_method: ``"static"`` or ``"dynamic"`` (see :func:`quantize_localizer`).
        test_metrics: a ``localize evaluate --out`` JSON to store as the held-out figures.
        opset: ONNX opset.

    Raises:
        LocalizerExportError: the fp32 graph does not match PyTorch within
            :data:`PROB_TOLERANCE`.
        LocalizeFileNotFoundError: none of the run's tiles is below ``root``.
    """
    cfg, summary, net = load_localize_run(run)
    root = as_roots(root or summary["root"])
    scale, tile_size = float(cfg.data.scale), int(cfg.data.tile_size)
    tiles = {t.name: t for t in find_mask_tiles(root)}
    names = [n for n in summary.get("val_tiles", []) + summary["train_tiles"] if n in tiles]
    if not names:
        raise LocalizeFileNotFoundError(
            f"{roots_label(root)}: none of the run's tiles is there; pass --xbd"
        )
    image, _ = load_mask_tile(tiles[names[0]], scale)
    h, w = (min(tile_size, s) // 32 * 32 for s in image.shape[:2])
    window = np.ascontiguousarray(image[:h, :w])
    small = np.ascontiguousarray(window[: max(32, h // 2 // 32 * 32), : max(32, w // 2 // 32 * 32)])

    events = sorted({tiles[n].event for n in summary["train_tiles"] if n in tiles})
    xbd = any(not e.startswith(SYNTHETIC_EVENT_PREFIX) for e in events)
    op = summary["operating_point"]
    heldout = _summarize_test_metrics(test_metrics) if test_metrics else None
    n_train = len(summary["train_tiles"])
    trained_on = (
        f"{XBD_CREDIT}: building polygons of {n_train} pre-disaster tiles "
        f"({', '.join(events)}), folds {summary.get('train_folds')} of a "
        f"{summary['split']['folds']}-fold tile split (seed {summary['split']['seed']})"
        if xbd
        else f"{n_train} tiles of synthetic or unknown-licence data ({', '.join(events)})"
    )
    metadata = {
        "format_version": FORMAT_VERSION,
        "task": LOCALIZE_TASK,
        "created_by": f"local-damage {__version__}",
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "tile_size": tile_size,
        "scale": scale,
        "threshold": float(op["threshold"]),
        "min_area_px": int(op["min_area_px"]),
        "largest_building_px": largest_building_px(
            [tiles[n] for n in summary["train_tiles"] if n in tiles]
        ),
        "flip_tta": bool(cfg.model.flip_tta),
        "trained_on": trained_on,
        "license": XBD_SPDX if xbd else None,
        "training": to_dict(cfg),
        "training_data": {
            "source": "xBD" if xbd else "other",
            "credit": XBD_CREDIT if xbd else None,
            "events": events,
            "train_tiles": summary["train_tiles"],
            "train_folds": summary.get("train_folds"),
            "split": summary["split"],
            "holdout_fold": summary.get("holdout"),
            "epochs": summary.get("epochs"),
            "best_epoch": summary.get("best_epoch"),
        },
        "metrics": {
            "heldout": heldout,
            "calibration": {
                k: op.get(k) for k in ("precision", "recall", "f1", "threshold", "min_area_px")
            }
            | {"fold": summary.get("fold"), "tiles": summary.get("val_tiles")},
            "pixel_metric": "building pixels predicted vs rasterised label polygons, pooled",
        },
        "precision": "fp32",
        "run": str(run),
    }

    out = Path(out)
    run_torch = torch_model(net, cfg.model.flip_tta)
    with tempfile.TemporaryDirectory(prefix="localize-export-") as tmp:
        fp32 = Path(tmp) / "fp32.onnx"
        export_graph(net, fp32, metadata, opset, cfg.model.flip_tta)
        session = open_session(fp32, CPU_ONLY)[0]
        diffs = []
        for x in (window, small):
            ref = run_torch(x[None])
            got = session.run([LOCALIZER_OUTPUT], {LOCALIZER_INPUT: x[None]})[0]
            diffs.append(float(np.abs(ref - got).max()))
        parity: dict[str, Any] = {
            "tile": names[0],
            "windows": [list(window.shape[:2]), list(small.shape[:2])],
            "max_abs_diff_fp32": max(diffs),
            "tolerance": PROB_TOLERANCE,
        }
        if max(diffs) > PROB_TOLERANCE:
            raise LocalizerExportError(
                f"{run}: ONNX Runtime and PyTorch probabilities differ by {max(diffs):.2e} "
                f"(> {PROB_TOLERANCE}) on tile {names[0]}; nothing written"
            )
        final = fp32
        if quantize == "int8":
            calib = []
            for name in summary["train_tiles"][:8]:
                if name in tiles:
                    img, _ = load_mask_tile(tiles[name], scale)
                    calib.append(np.ascontiguousarray(img[:h, :w]))
            final = Path(tmp) / "int8.onnx"
            quantize_localizer(fp32, final, calib, method=int8_method)
            q = open_session(final, CPU_ONLY)[0].run(
                [LOCALIZER_OUTPUT], {LOCALIZER_INPUT: window[None]}
            )[0]
            f = session.run([LOCALIZER_OUTPUT], {LOCALIZER_INPUT: window[None]})[0]
            t = float(op["threshold"])
            parity.update(
                int8_method=int8_method,
                max_abs_diff_int8_vs_fp32=float(np.abs(q - f).max()),
                mask_agreement_int8_vs_fp32=float(np.mean((q >= t) == (f >= t))),
            )
        elif quantize is not None:
            raise ValueError(f"unknown --quantize {quantize!r}: expected int8")
        import onnx

        proto = onnx.load(str(final))
        set_metadata(proto, {"parity": parity})
        save_onnx(proto, out)
    return {"model": str(out), "bytes": out.stat().st_size, **parity}
