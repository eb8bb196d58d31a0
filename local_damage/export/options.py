"""What an export is asked for: the options of ``local-damage export`` and the export's error.

Torch-free, so the command line can build its parser from these defaults without loading the
learning stack.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from data_prep.errors import LocalDamageError

DEFAULT_OPSET = 17


class ExportError(LocalDamageError, RuntimeError):
    """An export that cannot be done or failed its parity check; the message says why."""


@dataclass
class ExportOptions:
    """How a run is exported (see :func:`local_damage.export.model.export_run`).

    Attributes:
        quantize: ``None`` or ``"int8"``.
        fp16: write an fp16 model (weights and activations; uint8 inputs, float32 outputs).
        opset: ONNX opset version.
        chips: the chip store for the parity check (default: the one recorded in the run).
        parity_limit: at most this many chips for the parity check.
        calibration_limit: at most this many training chips to calibrate int8 ranges.
        int8_method: ``"static"`` or ``"dynamic"`` (see
            :func:`local_damage.export.quantize.quantize_int8`).
        threads: ONNX Runtime intra-op threads for the check (default: its own choice).
        change_map: also output the latent correlation map (see
            :func:`local_damage.export.graph.export_onnx`).
        test_metrics: a ``metrics.json`` of ``local-damage evaluate`` on held-out data, stored as
            the ``test_metrics`` metadata (for a model trained on everything, the figures of
            the same recipe trained without the held-out tiles; say so in its model card).
        false_alarm_cost: the model's own grade rule (metadata ``grade_rule``,
            :mod:`runtime.grading`); None: the run config's ``grade.false_alarm_cost``.
    """

    quantize: str | None = None
    fp16: bool = False
    opset: int = DEFAULT_OPSET
    chips: str | os.PathLike | None = None
    parity_limit: int = 512
    calibration_limit: int = 128
    int8_method: str = "static"
    threads: int | None = None
    change_map: bool = False
    test_metrics: str | os.PathLike | None = None
    false_alarm_cost: float | None = None

    def check(self) -> None:
        """Raise :class:`ExportError` for a precision that cannot be written."""
        if self.quantize not in (None, "int8"):
            raise ExportError(f"unknown --quantize {self.quantize!r}: expected int8")
        if self.quantize and self.fp16:
            raise ExportError("choose one of --quantize int8 and --fp16")

    @property
    def precision(self) -> str:
        """``"int8"``, ``"fp16"`` or ``"fp32"``."""
        return "int8" if self.quantize else "fp16" if self.fp16 else "fp32"


def check_out(out: str | os.PathLike) -> Path:
    """``out`` as a Path.

    Raises:
        ExportError: the name does not end in .onnx.
    """
    out = Path(out)
    if out.suffix != ".onnx":
        raise ExportError(f"{out}: the model file name must end in .onnx")
    return out
