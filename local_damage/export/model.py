"""`local-damage export`: a trained run to a self-describing ONNX model, checked against PyTorch.

The graph (:mod:`local_damage.export.graph`) takes uint8 RGB chips ``pre`` and ``post``
``[N, H, W, 3]``, normalises them itself and returns ``logits`` ``[N, K]`` and ``embedding``
``[N, D]`` (and ``change_map`` with ``--change-map``).

Metadata props (``ModelProto.metadata_props``, every value a JSON string) carry what serving needs
and what a reader of the file should know: ``class_names``, ``chip_spec``, ``input_size``,
``embedding_dim``, ``precision``, ``config`` (the resolved training config),
``validation_metrics``, ``training_data``, ``license`` (:mod:`local_damage.export.provenance`),
``parity``, ``format_version`` and ``created_by``. :mod:`runtime.predictor` reads them back
without torch.

Every export is checked on real chips of the run's store (its validation fold when the run has
one, else the first chips of the store; :mod:`local_damage.export.parity`): ONNX Runtime fp32
logits must match PyTorch, or nothing is written. An int8 (``--quantize int8``) or fp16
(``--fp16``) model (:mod:`local_damage.export.quantize`) is compared with the fp32 one. The report
is stored in the model (``parity``) and beside it as ``NAME.parity.json``.

Calibration is a separate step on the written model
(:func:`runtime.evaluation.calibrate.calibrate_model`); ``local-damage export
--calibrate-fold K`` runs it after the export.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
import torch

from data_prep.spec import CLASS_NAMES, ChipSpec
from data_prep.store import read_meta, write_json
from local_damage import __version__
from local_damage.config import to_dict
from local_damage.export.graph import export_onnx
from local_damage.export.options import ExportError, ExportOptions, check_out
from local_damage.export.parity import (
    check_fp32,
    chip_selection,
    fp32_report,
    load_chips,
    ort_outputs,
    torch_outputs,
    variant_report,
)
from local_damage.export.provenance import (
    run_tiles,
    summarize_test_metrics,
    training_data_info,
    validation_metrics,
)
from local_damage.export.quantize import convert_fp16, quantize_int8
from local_damage.export.run import load_run, resolve_chips
from runtime.contract import CPU_ONLY, FORMAT_VERSION, open_session, save_onnx, set_metadata
from runtime.grading import GRADE_RULE_KEY, grade_rule_block, resolve_cost
from runtime.training_tiles import IN_TRAINING

log = logging.getLogger(__name__)


class RunExport:
    """A run read for export: configuration and the run in the constructor, the export in
    :meth:`write`.

    Attributes:
        options: the :class:`~local_damage.export.options.ExportOptions`.
        info: the run (:class:`~local_damage.export.run.RunInfo`).
        tested: the ``test_metrics`` block, or None.
        store: the chip store the model is checked (and may be calibrated) on.

    Raises:
        ExportError: bad options, a run that cannot be read, a missing test metrics file or a
            chip store without manifest.
    """

    def __init__(self, run: str | os.PathLike, options: ExportOptions | None = None) -> None:
        self.options = options or ExportOptions()
        self.options.check()
        self.info = load_run(run)
        test_metrics = self.options.test_metrics
        self.tested = None
        if test_metrics is not None:
            # out-of-fold figures are graded under the model's own rule (its false-alarm cost)
            names = CLASS_NAMES[: int(self.info.model.cfg.num_classes)]
            self.tested = summarize_test_metrics(test_metrics, names, self.grade_cost())
        self.store = resolve_chips(self.info, self.options.chips)

    def grade_cost(self) -> float:
        """The model's own false-alarm cost: ``--false-alarm-cost``, else the run config's."""
        return resolve_cost(self.options.false_alarm_cost, self.info.cfg.grade.false_alarm_cost)

    def metadata(self) -> dict[str, Any]:
        """The model's metadata props, except ``parity`` (see the module docstring).

        Raises:
            ExportError: neither the run nor the store records the chip spec.
        """
        info, store = self.info, self.store
        meta = read_meta(store)
        spec_dict = info.summary.get("chip_spec") or meta.get("spec")
        if not spec_dict:
            raise ExportError(
                f"{info.path / 'summary.json'}: no chip_spec, and {store} has no store.json spec"
            )
        k = int(info.model.cfg.num_classes)
        training, licence = training_data_info(
            meta,
            info.summary.get("events") or [],
            str(info.summary.get("chips") or store),
            info.summary.get("train_chips"),
            run_tiles(info.summary, store, info.path),
            {
                "validation_fold": info.summary.get("fold"),
                "holdout_fold": info.summary.get("holdout"),
            },
        )
        props: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "created_by": f"local-damage {__version__}",
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "class_names": list(CLASS_NAMES[:k]),
            "chip_spec": ChipSpec.from_dict(spec_dict).to_dict(),
            "input_size": int(info.cfg.data.input_size),
            "embedding_dim": int(info.model.cfg.embed_dim),
            "precision": self.options.precision,
            "config": to_dict(info.cfg),
            GRADE_RULE_KEY: grade_rule_block(self.grade_cost()),
            "validation_metrics": validation_metrics(info.summary, info.metrics),
            "training_data": training,
            "license": licence,
            "run": str(info.path),
        }
        if self.tested is not None:
            # a recipe's out-of-fold figures (`cross_validation`) are on the tiles a model trained
            # on every tile learnt from, by design; the card says what they are
            props["test_metrics"] = self.tested
            tested = set(self.tested.get("tiles") or [])
            overlap = sorted(tested & set(training.get("train_tiles") or []))
            if overlap and "cross_validation" not in self.tested:
                log.warning(
                    f"warning: {len(overlap)} of the {len(tested)} tiles of "
                    f"{self.tested['source']} are {IN_TRAINING} ({', '.join(overlap[:3])}"
                    f"{', ...' if len(overlap) > 3 else ''}): the model card will say they are "
                    "not its held-out figures"
                )
        return props

    def write(self, out: str | os.PathLike) -> dict[str, Any]:
        """Export the run's best weights to ``out`` and check it; returns the parity report.

        Args:
            out: the ``.onnx`` file to write; the report goes to ``out`` with ``.parity.json``.

        Returns:
            The parity report: ``chips`` (what was compared), ``fp32`` (max |logit| and
            |embedding| differences to PyTorch, argmax agreement, macro-F1), and ``int8`` or
            ``fp16`` (see :func:`~local_damage.export.parity.variant_report`), ``precision``,
            versions.

        Raises:
            ExportError: ``out`` does not end in .onnx, the chip spec is unknown, no chip to
                check on, or ONNX Runtime fp32 logits differ from PyTorch by more than
                :data:`~local_damage.export.parity.LOGIT_TOLERANCE` (nothing is written then).
        """
        out = check_out(out)
        opts, info, store = self.options, self.info, self.store
        props = self.metadata()
        size, class_names = props["input_size"], props["class_names"]
        precision = opts.precision
        parity_ids, parity_what, calib_ids = chip_selection(
            store, info.summary.get("fold"), opts.parity_limit, opts.calibration_limit
        )
        if not parity_ids:
            raise ExportError(f"{store}: no chips for the parity check")
        pre, post, labels = load_chips(store, parity_ids, size)

        with tempfile.TemporaryDirectory(prefix="export-") as tmp:
            fp32_path = Path(tmp) / "fp32.onnx"
            export_onnx(info.model, fp32_path, size, props, opts.opset, change_map=opts.change_map)
            t_logits, t_emb = torch_outputs(info.model, pre, post)
            session = open_session(fp32_path, CPU_ONLY, opts.threads)[0]
            o_logits, o_emb = ort_outputs(session, pre, post)
            del session
            report: dict[str, Any] = {
                "chips": {
                    "store": str(store),
                    "selection": parity_what,
                    "count": len(pre),
                    "labelled": int((labels >= 0).sum()),
                    "input_size": size,
                },
                "fp32": fp32_report(t_logits, t_emb, o_logits, o_emb, labels, class_names),
                "precision": precision,
                "opset": int(opts.opset),
                "onnxruntime": ort.__version__,
                "torch": torch.__version__.split("+")[0],
            }
            check_fp32(report, out)
            final = fp32_path
            if opts.quantize or opts.fp16:
                final = Path(tmp) / f"{precision}.onnx"
                method = self._reduce(fp32_path, final, calib_ids)
                v_logits, _ = ort_outputs(open_session(final, CPU_ONLY, opts.threads)[0], pre, post)
                report[precision] = variant_report(o_logits, v_logits, labels, class_names, method)
            proto = onnx.load(str(final))
            set_metadata(proto, {"parity": report})
            save_onnx(proto, out)
        write_json(out.with_suffix(".parity.json"), report)
        return report

    def _reduce(self, fp32_path: Path, final: Path, calib_ids: list[str]) -> str:
        """Write the int8 or fp16 model of ``fp32_path`` to ``final``; returns how."""
        opts = self.options
        if opts.quantize:
            calib = load_chips(self.store, calib_ids, int(self.info.cfg.data.input_size))[:2]
            quantize_int8(fp32_path, final, calib, method=opts.int8_method)
            if opts.int8_method == "static":
                return (
                    f"static QDQ, per-channel int8 weights, uint8 activations, MinMax calibration "
                    f"on {len(calib[0])} training chips"
                )
            return "dynamic: int8 weights, activation ranges at run time"
        convert_fp16(fp32_path, final)
        return "fp16 weights and activations (float16 converter of onnxruntime)"


def export_run(
    run: str | os.PathLike, out: str | os.PathLike, options: ExportOptions | None = None
) -> dict[str, Any]:
    """Export a run's best weights to ``out`` and check it; returns the parity report.

    Args:
        run: the run folder (config.yaml, summary.json, best.safetensors).
        out: the ``.onnx`` file to write; the report goes to ``out`` with ``.parity.json``.
        options: how (precision, opset, chips...); default :class:`ExportOptions()`.

    Returns:
        The parity report (see :meth:`RunExport.write`).

    Raises:
        ExportError: the run cannot be exported or ONNX Runtime fp32 logits differ from PyTorch
            (nothing is written then).
    """
    out = check_out(out)
    return RunExport(run, options).write(out)
