"""The base model of one held-out event: trained on the other events (or reused, or resumed),
exported to ONNX and calibrated on its validation slice."""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import onnx

from data_prep.store import write_json
from local_damage.experiments.cv import CrossValidationError, check_run_config
from local_damage.export.model import export_run
from local_damage.export.options import ExportOptions
from local_damage.train import checkpoint as ckpt
from local_damage.train.loaders import ChipSplit
from local_damage.train.loop import SUMMARY, train
from runtime.contract import save_onnx
from runtime.evaluation.calibrate import CalibrationOptions, calibrate_model
from studies.fewshot_settings import BASE_SPLIT, FewShotError


def prepare_base(cfg, chips, folder: Path, ids, progress: bool) -> tuple[Path, Path, str]:
    """Train (or reuse, or resume) the base run of one held-out event and export it.

    Returns:
        ``(run, model.onnx, how)``, ``how`` one of ``reused``, ``resumed``, ``trained``.

    Raises:
        FewShotError: the folder holds a run of another config or other chips.
    """
    run, onnx_path = folder / "base", folder / "base.onnx"
    try:
        check_run_config(run, cfg)
    except CrossValidationError as exc:
        raise FewShotError(str(exc)) from exc
    wanted = {"train": sorted(ids[0]), "val": sorted(ids[1])}
    split_path = run / BASE_SPLIT
    if run.is_dir() and any(run.iterdir()):
        saved = json.loads(split_path.read_text()) if split_path.is_file() else None
        if saved != wanted:
            raise FewShotError(
                f"{run}: holds a run trained on other chips than this held-out event's training "
                "events (another store, --val-share or --seed); remove the folder or choose "
                "another --out"
            )
    if (run / SUMMARY).is_file():
        how = "reused"
    else:
        resume = (run / ckpt.LAST_DIR / "state.pt").is_file()
        run.mkdir(parents=True, exist_ok=True)
        write_json(split_path, wanted)
        split = ChipSplit(ids=(ids[0], ids[1]))
        train(cfg, chips, run, split, resume=resume, progress=progress)
        how = "resumed" if resume else "trained"
    weights = run / ckpt.BEST
    fresh = onnx_path.is_file() and onnx_path.stat().st_mtime >= weights.stat().st_mtime
    if not fresh:
        export_base(run, onnx_path, chips, ids[1])
    return run, onnx_path, how


def export_base(run: Path, out: Path, chips, val_ids: Sequence[str]) -> Path:
    """Export ``run`` to ``out`` (parity-checked) with a temperature and ``ood`` prototypes
    fitted on the validation slice ``val_ids`` (none when it is empty, or when no temperature
    fits it), atomically: exported to a staged file, then calibrated from it by
    :func:`runtime.evaluation.calibrate.calibrate_model`.
    """
    with tempfile.TemporaryDirectory(prefix="fewshot-export-", dir=out.parent) as tmp:
        staged = Path(tmp) / "base.onnx"
        export_run(run, staged, ExportOptions(chips=chips, parity_limit=64, calibration_limit=8))
        if val_ids:
            try:
                options = CalibrationOptions(
                    chip_ids=list(val_ids),
                    selection="validation slice",
                    prototype_ids=list(val_ids),
                )
                calibrate_model(staged, chips, out, options)
                return out
            except ValueError as exc:  # e.g. a slice the model separates perfectly
                print(f"{run}: not calibrated ({exc})", file=sys.stderr)
        save_onnx(onnx.load(str(staged)), out)
    return out
