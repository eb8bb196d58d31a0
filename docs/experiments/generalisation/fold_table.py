"""One method's cross-validation table from fold folders trained apart (on two machines, say):

    python docs/experiments/generalisation/fold_table.py CHIPS OUT NAME FOLD_DIR [FOLD_DIR ...]

``local-damage cv`` reuses a finished fold only when its ``config.yaml`` equals the command's
(where it ran, ``train.device`` and ``data.num_workers``, aside), so folds of one recipe trained
in two precisions (``train.amp``: float32 on one machine, bfloat16 on another) cannot be tabled by
one ``cv`` call. This script pools such folds as ``cv`` does
(:func:`local_damage.experiments.cv_report.protocol_summary`): it writes ``OUT/cv_table.md`` and
``OUT/oof_predictions.csv`` and prints, per fold, the test figures beside the figures on the
fold's own training buildings (``train_eval/metrics.json`` of ``fold_extras``), the gap that
shows memorisation. Each FOLD_DIR holds a fold's ``summary.json`` (its ``fold``),
``predictions.csv`` and ``metrics.json``; the folds must differ only in where they ran.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from local_damage.experiments.cv_report import protocol_summary, write_protocol_table

IGNORED = {"train.device", "data.num_workers", "train.deterministic"}


def _config(run: Path) -> dict:
    """The fold's config as training resolved it (keys added since take their defaults), flat."""
    import pandas as pd

    from local_damage.config import load_yaml, to_dict
    from local_damage.train.config import Config

    resolved = to_dict(load_yaml(Config, run / "config.yaml"))
    return pd.json_normalize(resolved).iloc[0].to_dict()


def main(chips: str, out: str, name: str, runs: list[str]) -> None:
    folds, devices = {}, {}
    first = None
    for r in map(Path, runs):
        summary = json.loads((r / "summary.json").read_text())
        folds[int(summary["fold"])] = r
        devices[int(summary["fold"])] = summary.get("device")
        cfg = _config(r)
        first = first or cfg
        differ = sorted(k for k in set(cfg) | set(first) if cfg.get(k) != first.get(k))
        if set(differ) - IGNORED:
            sys.exit(f"{r}: trained with another recipe (differs in {', '.join(differ)})")
    names = json.loads((next(iter(folds.values())) / "metrics.json").read_text())["class_names"]
    protocol = protocol_summary(folds, chips, names, Path(out))
    text = write_protocol_table([{"name": name, "protocol": protocol}], names, out)
    print(text)
    print(
        "| fold | device | test accuracy | test macro-F1 | training accuracy | training macro-F1 |"
    )
    print("|---|---|---|---|---|---|")
    for fold, r in sorted(folds.items()):
        test = json.loads((r / "metrics.json").read_text())
        train = json.loads((r / "train_eval" / "metrics.json").read_text())
        print(
            f"| {fold} | {devices[fold]} | {test['accuracy']:.3f} | {test['macro_f1']:.3f} | "
            f"{train['accuracy']:.3f} | {train['macro_f1']:.3f} |"
        )


if __name__ == "__main__":
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
