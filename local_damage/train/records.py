"""What a run records each epoch: a row of ``metrics.csv``, TensorBoard scalars (when
tensorboard is installed) and, with progress on, one line through logging."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

from local_damage.config import save_yaml
from local_damage.train.config import Config

log = logging.getLogger(__name__)

METRICS_CSV = "metrics.csv"
#: The columns of metrics.csv, in order (a field an epoch did not measure stays empty).
FIELDS = [
    "epoch",
    "alpha",
    "lr",
    "train_loss",
    "wce",
    "contrastive_z",
    "contrastive_l",
    "val_accuracy",
    "val_macro_f1",
    "train_max_abs_cos",
    "train_mean_offdiag_cos",
    "val_max_abs_cos",
    "val_mean_offdiag_cos",
    "pairs_per_s",
    "peak_memory_mb",
    "seconds",
]
#: The fields of the epoch line, when measured.
SHOWN = ("train_loss", "val_accuracy", "val_macro_f1", "pairs_per_s", "peak_memory_mb")


def start_run_folder(run: Path, cfg: Config) -> None:
    """Create ``run`` with its config.yaml, and no metrics.csv of an earlier run."""
    run.mkdir(parents=True, exist_ok=True)
    save_yaml(cfg, run / "config.yaml")
    (run / METRICS_CSV).unlink(missing_ok=True)


def epoch_line(row: dict[str, Any], epochs: int) -> str:
    """``epoch E/N: train_loss ..., val_accuracy ..., ...`` (4 significant digits)."""
    shown = ", ".join(f"{k} {row[k]:.4g}" for k in SHOWN if k in row)
    return f"epoch {row['epoch'] + 1}/{epochs}: {shown}"


def append_csv(path: Path, fields: list[str], row: dict[str, Any]) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow({k: row.get(k, "") for k in fields})


def tensorboard_writer(run: Path):
    """A TensorBoard writer into RUN/tensorboard when tensorboard is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(run / "tensorboard"))


class EpochRecords:
    """The records of a run folder, kept by the main process: one :meth:`add` per epoch."""

    def __init__(self, run: Path, epochs: int, progress: bool) -> None:
        self.run, self.epochs, self.progress = run, epochs, progress
        self.writer = tensorboard_writer(run)

    def add(self, row: dict[str, Any]) -> None:
        """Append the epoch's row to metrics.csv and TensorBoard; log its line with progress."""
        append_csv(self.run / METRICS_CSV, FIELDS, row)
        if self.writer is not None:
            for k, v in row.items():
                if k != "epoch" and isinstance(v, int | float) and v == v:
                    self.writer.add_scalar(k, v, row["epoch"])
        if self.progress:
            log.info(epoch_line(row, self.epochs))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
