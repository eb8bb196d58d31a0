"""`local-damage cv`: k-fold cross-validation of one or more training configs, as the paper's tables.

For every config (a *method*, named after its file or ``--name``) and every fold of
``CHIPS/splits.csv``, a model is trained in ``OUT/<method>/fold<K>`` with that fold held out
and then evaluated on it (see :mod:`local_damage.evaluation.evaluate`; no t-SNE). The folds' metrics become

- Table 2 (``table2.md/.csv``): accuracy and macro-F1 as mean (min-max) over folds, one row per
  method with its batch size and input size;
- Table 3 (``table3.md/.csv``): per-class F1 (mean over the folds where the class occurs) with
  the class's prevalence among the evaluated chips, one column per method, and a last row
  "f1-macro / accuracy";
- ``cv_results.json``: every fold's full metrics and the aggregates.

Markdown shows percentages with two decimals as in the paper; CSV and JSON keep fractions.
The command is resumable: a fold whose run folder has ``summary.json`` and ``metrics.json`` is
reused, one with only ``summary.json`` is evaluated, and one with a last checkpoint resumes
training. A fold that fails is reported at the end; the others still make the tables.
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.errors import LocalDamageError
from data_prep.spec import CLASS_NAMES
from data_prep.split import load_splits
from data_prep.store import atomic_path, read_manifest, safe_name, write_json
from local_damage.config import ConfigError, load_yaml, to_dict
from local_damage.evaluation.evaluate import METRICS_JSON, evaluate_chips
from local_damage.evaluation.torch_scorer import TorchScorer
from local_damage.metrics import classification_metrics
from local_damage.train.checkpoint import LAST_DIR
from local_damage.train.config import Config
from local_damage.train.loop import SUMMARY, train

log = logging.getLogger(__name__)

CV_RESULTS = "cv_results.json"
#: Exceptions that fail one fold without stopping the others.
FOLD_ERRORS = (FileNotFoundError, ValueError, KeyError, RuntimeError)


class CrossValidationError(LocalDamageError, ValueError):
    """Arguments that make the whole cross-validation impossible (bad config, no splits...)."""


def method_names(configs: Sequence[str | Path], names: Sequence[str] | None = None) -> list[str]:
    """The method name of each config: ``names`` when given, else the file stems.

    Raises:
        CrossValidationError: the counts differ, a name repeats, or a name is not a plain
            file name.
    """
    if names:
        if len(names) != len(configs):
            raise CrossValidationError(
                f"{len(names)} --name value(s) for {len(configs)} config(s); give one per config"
            )
        out = list(names)
    else:
        out = [Path(c).stem for c in configs]
    for name in out:
        if safe_name(name) != name:
            raise CrossValidationError(
                f"method name {name!r} is not a plain folder name; use letters, digits, . _ -"
            )
    repeated = sorted({n for n in out if out.count(n) > 1})
    if repeated:
        raise CrossValidationError(
            f"method name(s) {', '.join(repeated)} used twice; give distinct --name values"
        )
    return out


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    items: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            items.update(_flat(v, f"{prefix}{k}."))
        else:
            items[f"{prefix}{k}"] = v
    return items


def check_run_config(run: str | Path, cfg) -> None:
    """Check that ``run`` holds no run, or a run of ``cfg`` (so reusing it is sound).

    Raises:
        CrossValidationError: ``run/config.yaml`` differs from ``cfg``; names the keys.
    """
    path = Path(run) / "config.yaml"
    if not path.is_file():
        return
    saved, wanted = _flat(to_dict(load_yaml(Config, path))), _flat(to_dict(cfg))
    differences = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
    if differences:
        raise CrossValidationError(
            f"{run}: holds a run trained with another config (differs in "
            f"{', '.join(differences[:5])}); remove the folder or choose another --out"
        )


def check_run_holdout(run: str | Path, holdout: int | None) -> None:
    """Check that a finished run in ``run`` was trained without the same ``holdout`` fold.

    Raises:
        CrossValidationError: it held out another fold (or none).
    """
    path = Path(run) / SUMMARY
    if not path.is_file():
        return
    trained_without = json.loads(path.read_text()).get("holdout")
    if trained_without != holdout:
        raise CrossValidationError(
            f"{run}: holds a run trained with holdout {trained_without}, not {holdout}; "
            "remove the folder or choose another --out"
        )


def run_fold(
    cfg,
    chips: str | Path,
    run: str | Path,
    fold: int,
    views: int = 2,
    progress: bool = True,
    holdout: int | None = None,
) -> tuple[dict[str, Any], str]:
    """Train (or reuse) the run of one fold and evaluate it on that fold.

    Args:
        cfg: the resolved training config.
        chips: chip store folder with splits.csv.
        run: the fold's run folder.
        fold: the held-out fold.
        views: views for the representation metrics (see :func:`local_damage.evaluation.evaluate.evaluate`).
        progress: show training progress.
        holdout: a fold never trained on (the test tiles), as ``train --holdout``.

    Returns:
        ``(metrics, how)``: the fold's metrics (also in ``run/metrics.json``) and what was done:
        ``"reused"``, ``"evaluated"``, ``"resumed"`` or ``"trained"``.

    Raises:
        CrossValidationError: ``run`` holds a run of another config.
    """
    run = Path(run)
    check_run_config(run, cfg)
    check_run_holdout(run, holdout)
    has_summary = (run / SUMMARY).is_file()
    if has_summary and (run / METRICS_JSON).is_file():
        return json.loads((run / METRICS_JSON).read_text()), "reused"
    how = "evaluated"
    if not has_summary:
        resume = (run / LAST_DIR / "state.pt").is_file()
        train(cfg, chips, run, fold=fold, resume=resume, progress=progress, holdout=holdout)
        how = "resumed" if resume else "trained"
    scorer = TorchScorer(run)
    metrics = evaluate_chips(
        scorer,
        chips,
        run,
        fold=fold,
        views=views,
        tsne=False,
        batch_size=cfg.train.eval_batch_size,
        seed=cfg.train.seed,
    )
    return metrics, how


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {
        "mean": float(sum(values) / len(values)),
        "min": float(min(values)),
        "max": float(max(values)),
    }


def pooled_metrics(fold_metrics: dict[str, dict], class_names: Sequence[str]) -> dict | None:
    """Classification metrics of every fold's predictions taken together (out-of-fold).

    The folds' confusion matrices are summed and scored as one set of predictions, so a class
    that occurs in one fold only (minor damage in a single tile, say) counts once with all its
    buildings instead of swinging one fold's macro-F1. ``None`` when there are no folds.
    """
    if not fold_metrics:
        return None
    cm = sum(np.asarray(m["confusion_matrix"], dtype=np.int64) for m in fold_metrics.values())
    k = len(class_names)
    y_true = np.repeat(np.repeat(np.arange(k), k), cm.reshape(-1))
    y_pred = np.repeat(np.tile(np.arange(k), k), cm.reshape(-1))
    return classification_metrics(y_true, y_pred, class_names)


def summarise_method(fold_metrics: dict[str, dict], class_names: Sequence[str]) -> dict[str, Any]:
    """Aggregate one method's fold metrics.

    Args:
        fold_metrics: ``{fold: metrics}`` as written by the evaluation.
        class_names: the class names, in label order.

    Returns:
        ``{"folds": n, "accuracy", "macro_f1", "xview2_damage_f1", "max_abs_cos":
        {"mean", "min", "max"}, "per_class_f1": {name: mean F1 over the folds where the class
        occurs, or None}, "pooled": out-of-fold metrics (`pooled_metrics`)}``; ``max_abs_cos``
        is the largest ``|cos|`` between class means of ``z`` on each validation fold.
    """
    runs = list(fold_metrics.values())
    per_class: dict[str, float | None] = {}
    for name in class_names:
        scores = [m["per_class"][name]["f1"] for m in runs if name not in m["absent_classes"]]
        per_class[name] = _stats(scores)["mean"]
    cosines = [
        m["representation"]["max_offdiag_abs_cos"]
        for m in runs
        if (m.get("representation") or {}).get("max_offdiag_abs_cos") is not None
    ]
    return {
        "folds": len(runs),
        "accuracy": _stats([m["accuracy"] for m in runs]),
        "macro_f1": _stats([m["macro_f1"] for m in runs]),
        "xview2_damage_f1": _stats([m["xview2_damage_f1"] for m in runs]),
        "max_abs_cos": _stats(cosines),
        "per_class_f1": per_class,
        "pooled": pooled_metrics(fold_metrics, class_names),
    }


def prevalence(chips: str | Path, folds: Sequence[int], class_names: Sequence[str]) -> dict:
    """Share of each class among the labelled chips of ``folds`` (the chips evaluated)."""
    splits = load_splits(chips)
    ids = set(splits.loc[splits["fold"].isin(list(folds)), "chip_id"])
    frame = read_manifest(chips)
    labels = frame.loc[frame["chip_id"].isin(ids) & (frame["label"] >= 0), "label"]
    n = len(labels)
    counts = labels.value_counts()
    return {
        "n": int(n),
        "share": {
            name: (float(counts.get(c, 0)) / n if n else None) for c, name in enumerate(class_names)
        },
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}"


def _range(stats: dict) -> str:
    if stats["mean"] is None:
        return "n/a"
    return f"{_pct(stats['mean'])} ({_pct(stats['min'])}-{_pct(stats['max'])})"


def _pooled(summary: dict, keys: Sequence[str]) -> str:
    pooled = summary.get("pooled")
    if not pooled:
        return "n/a"
    return " / ".join(_pct(pooled[k]) for k in keys)


def _pooled_classes(summary: dict, names: Sequence[str]) -> str:
    pooled = summary.get("pooled")
    if not pooled:
        return "n/a"
    return " / ".join(
        _pct(pooled["per_class"][n]["f1"]) if n in pooled["per_class"] else "n/a" for n in names
    )


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def table2(results: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """Table 2: accuracy (and macro-F1) as mean (min-max) over folds, one row per method.

    Returns:
        ``(markdown, csv_rows)``; markdown in percent, CSV rows in fractions.
    """
    header = [
        "method",
        "loss",
        "BS",
        "input size",
        "folds",
        "accuracy %",
        "macro-F1 %",
        "pooled accuracy / macro-F1 %",
        "pooled minor / major F1 %",
        "max |cos|",
    ]
    rows, records = [], []
    for m in results["methods"]:
        s = m["summary"]
        size = m["input_size"]
        rows.append(
            [
                m["name"],
                m["loss"],
                str(m["batch_size"]),
                f"{size}x{size}",
                str(s["folds"]),
                _range(s["accuracy"]),
                _range(s["macro_f1"]),
                _pooled(s, ("accuracy", "macro_f1")),
                _pooled_classes(s, ("minor-damage", "major-damage")),
                "n/a" if s["max_abs_cos"]["mean"] is None else f"{s['max_abs_cos']['mean']:.3f}",
            ]
        )
        record = {
            "method": m["name"],
            "loss": m["loss"],
            "batch_size": m["batch_size"],
            "input_size": size,
            "folds": s["folds"],
        }
        for key in ("accuracy", "macro_f1"):
            for stat in ("mean", "min", "max"):
                record[f"{key}_{stat}"] = s[key][stat]
        pooled = s.get("pooled") or {}
        record["pooled_accuracy"] = pooled.get("accuracy")
        record["pooled_macro_f1"] = pooled.get("macro_f1")
        for name, scores in (pooled.get("per_class") or {}).items():
            record[f"pooled_f1_{name}"] = scores["f1"]
        record["max_abs_cos_mean"] = s["max_abs_cos"]["mean"]
        records.append(record)
    title = f"Accuracy over {len(results['folds'])}-fold cross-validation: mean (min-max)\n\n"
    return title + _markdown(header, rows), records


def table3(results: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """Table 3: per-class F1 with prevalence, one column per method, then macro-F1 / accuracy.

    Returns:
        ``(markdown, csv_rows)``; markdown in percent, CSV rows in fractions (the last two CSV
        rows are ``f1-macro`` and ``accuracy``).
    """
    names = [m["name"] for m in results["methods"]]
    share = results["prevalence"]["share"]
    rows, records = [], []
    for cls in results["class_names"]:
        f1s = [m["summary"]["per_class_f1"][cls] for m in results["methods"]]
        prev = share[cls]
        rows.append([cls, "n/a" if prev is None else f"{100 * prev:.2f}%", *map(_pct, f1s)])
        records.append({"class": cls, "prevalence": prev, **dict(zip(names, f1s, strict=True))})
    macro = [m["summary"]["macro_f1"]["mean"] for m in results["methods"]]
    acc = [m["summary"]["accuracy"]["mean"] for m in results["methods"]]
    rows.append(
        [
            "f1-macro / accuracy",
            "",
            *(f"{_pct(f)} / {_pct(a)}" for f, a in zip(macro, acc, strict=True)),
        ]
    )
    records.append(
        {"class": "f1-macro", "prevalence": None, **dict(zip(names, macro, strict=True))}
    )
    records.append({"class": "accuracy", "prevalence": None, **dict(zip(names, acc, strict=True))})
    title = f"Per-class F1 (mean over folds), {results['prevalence']['n']} evaluated chips\n\n"
    return title + _markdown(["class", "prevalence", *names], rows), records


def _write_csv(path: Path, records: list[dict[str, Any]]) -> None:
    with atomic_path(path, suffix=".csv") as tmp, open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(records[0]) if records else [])
        writer.writeheader()
        for record in records:
            writer.writerow({k: "" if v is None else v for k, v in record.items()})


def write_tables(results: dict[str, Any], out: str | Path) -> tuple[str, str]:
    """Write cv_results.json, table2.md/.csv and table3.md/.csv; return the two markdown tables."""
    out = Path(out)
    write_json(out / CV_RESULTS, results)
    tables = []
    for name, build in (("table2", table2), ("table3", table3)):
        markdown, records = build(results)
        with atomic_path(out / f"{name}.md", suffix=".md") as tmp:
            tmp.write_text(markdown)
        _write_csv(out / f"{name}.csv", records)
        tables.append(markdown)
    return tables[0], tables[1]


def cross_validate(
    configs: Sequence[str | Path],
    chips: str | Path,
    out: str | Path,
    folds: Sequence[int] | None = None,
    overrides: Sequence[str] = (),
    names: Sequence[str] | None = None,
    views: int = 2,
    progress: bool = True,
    holdout: int | None = None,
) -> dict[str, Any]:
    """Train and evaluate every config on every fold; write the tables to ``out``.

    Args:
        configs: training config YAML files (one method each).
        chips: chip store folder with splits.csv.
        out: output folder (runs in ``out/<method>/fold<K>``).
        folds: the folds to run (default: every fold of splits.csv).
        overrides: ``key=value`` overrides applied to every config.
        names: method names (default: the config file stems).
        views: 2 adds SAA/SAD to each fold's representation metrics; 1 skips the second view.
        progress: show training progress bars and per-epoch lines.
        holdout: a fold of splits.csv kept out of every training run and never evaluated (the
            test tiles of a model whose figures must not be tuned on); it cannot be in ``folds``.

    Returns:
        The results written to ``out/cv_results.json``: ``chips``, ``folds``, ``class_names``,
        ``prevalence``, ``methods`` (each with its ``folds`` metrics and ``summary``) and
        ``failed`` (method, fold, error of every fold that could not be run).

    Raises:
        CrossValidationError: a config cannot be loaded, names clash, a fold is not in
            splits.csv, or the store has no manifest or no (current) splits.csv.
    """
    chips, out = Path(chips), Path(out)
    labels = method_names(configs, names)
    loaded = []
    for path in configs:
        try:
            loaded.append(load_yaml(Config, path, overrides))
        except ConfigError as exc:
            raise CrossValidationError(str(exc)) from exc
    num_classes = {cfg.model.num_classes for cfg in loaded}
    if len(num_classes) != 1:
        raise CrossValidationError(
            f"the configs disagree on model.num_classes ({sorted(num_classes)}); one table needs one set of classes"
        )
    class_names = list(CLASS_NAMES[: num_classes.pop()])
    try:
        available = sorted(int(f) for f in load_splits(chips)["fold"].unique())
    except (FileNotFoundError, ValueError) as exc:  # no splits.csv, or a stale one
        raise CrossValidationError(str(exc)) from exc
    if folds is None:
        folds = available
    unknown = [f for f in folds if f not in available]
    if unknown:
        raise CrossValidationError(
            f"{chips / 'splits.csv'}: no fold(s) {', '.join(map(str, unknown))}; the folds are "
            f"{', '.join(map(str, available))}"
        )
    if holdout is not None:
        if holdout not in available:
            raise CrossValidationError(
                f"{chips / 'splits.csv'}: no fold {holdout} to hold out; the folds are "
                f"{', '.join(map(str, available))}"
            )
        folds = [f for f in folds if f != holdout]
        if not folds:
            raise CrossValidationError(f"no fold left to validate on besides held-out {holdout}")
    folds = list(dict.fromkeys(int(f) for f in folds))
    for name, cfg in zip(labels, loaded, strict=True):  # before any training, not midway
        for fold in folds:
            check_run_config(out / name / f"fold{fold}", cfg)
            check_run_holdout(out / name / f"fold{fold}", holdout)

    for name, cfg in zip(labels, loaded, strict=True):
        if cfg.train.keep == "best":
            log.warning(
                f"[{name}] train.keep=best: each fold is evaluated with the epoch of best macro-F1 "
                "on that same fold, an optimistic estimate; --set train.keep=last evaluates the "
                "last epoch (and --set train.patience=0 stops no run early on its fold)"
            )

    methods, failed = [], []
    for name, path, cfg in zip(labels, configs, loaded, strict=True):
        fold_metrics: dict[str, dict] = {}
        for fold in folds:
            run = out / name / f"fold{fold}"
            log.info(f"[{name} fold {fold}] {run}")
            try:
                metrics, how = run_fold(
                    cfg, chips, run, fold, views=views, progress=progress, holdout=holdout
                )
            except FOLD_ERRORS as exc:
                message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
                log.warning(f"[{name} fold {fold}] failed: {message}")
                failed.append({"method": name, "fold": fold, "error": message})
                continue
            log.info(
                f"[{name} fold {fold}] {how}: accuracy {metrics['accuracy']:.4f}, "
                f"macro-F1 {metrics['macro_f1']:.4f}"
            )
            fold_metrics[str(fold)] = metrics
        methods.append(
            {
                "name": name,
                "config": str(path),
                "loss": cfg.loss.method,
                "encoder": cfg.model.encoder,
                "batch_size": cfg.train.batch_size,
                "input_size": cfg.data.input_size,
                "folds": fold_metrics,
                "summary": summarise_method(fold_metrics, class_names),
            }
        )
    results = {
        "chips": str(chips),
        "folds": folds,
        "holdout": holdout,
        "overrides": list(overrides),
        "class_names": class_names,
        "prevalence": prevalence(chips, folds, class_names),
        "methods": methods,
        "failed": failed,
    }
    write_tables(results, out)
    return results
