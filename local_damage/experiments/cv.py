"""`local-damage cv`: k-fold cross-validation of one or more training configs, as the paper's tables.

For every config (a *method*, named after its file or ``--name``) and every fold of
``CHIPS/splits.csv``, a model is trained in ``OUT/<method>/fold<K>`` with that fold held out
and then evaluated on it (see :mod:`runtime.evaluation.evaluate`; no t-SNE). The folds' metrics become

- Table 2 (``table2.md/.csv``): accuracy and macro-F1 as mean (min-max) over folds, one row per
  method with its batch size and input size;
- Table 3 (``table3.md/.csv``): per-class F1 (mean over the folds where the class occurs) with
  the class's prevalence among the evaluated chips, one column per method, and a last row
  "f1-macro / accuracy";
- ``cv_results.json``: every fold's full metrics and the aggregates;
- ``cv_table.md``: per method, accuracy, macro-F1, per-class F1, the share of buildings on
  intact tiles graded damaged and the ECE, as mean (min-max) over folds, pooled, per fold and per
  event; and ``<method>/oof_predictions.csv``, every fold's predictions (probabilities and raw
  logits) pooled (:mod:`local_damage.experiments.cv_report`).

With ``inner=K`` the configs are candidate recipes rather than methods: for each outer fold one
of them is chosen on ``K`` inner folds of its training tiles
(:mod:`local_damage.experiments.nested`) and only that one is trained on the training tiles and
scored on the test fold, as the method ``selected`` (runs in ``OUT/selected/fold<K>``).

Markdown shows percentages with two decimals as in the paper; CSV and JSON keep fractions.
The command is resumable: a fold whose run folder has ``summary.json`` and ``metrics.json`` is
reused, one with only ``summary.json`` is evaluated, and one with a last checkpoint resumes
training. A fold that fails is reported at the end; the others still make the tables.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.errors import LocalDamageError
from data_prep.spec import CLASS_NAMES
from data_prep.split import load_splits
from data_prep.store import read_manifest, safe_name
from local_damage.config import ConfigError, load_yaml, save_yaml, to_dict
from local_damage.evaluation.torch_scorer import TorchScorer
from local_damage.experiments.cv_report import protocol_summary, write_protocol_table
from local_damage.experiments.cv_tables import write_tables
from local_damage.experiments.nested import InnerChoice, choose_recipe, inner_root
from local_damage.train.checkpoint import LAST_DIR
from local_damage.train.config import Config
from local_damage.train.loaders import ChipSplit
from local_damage.train.loop import SUMMARY, train
from runtime.evaluation.evaluate import METRICS_JSON, EvaluationOptions, evaluate_chips
from runtime.grading import GRADE_RULE_KEY
from runtime.metrics import classification_metrics

log = logging.getLogger(__name__)

#: Exceptions that fail one fold without stopping the others.
FOLD_ERRORS = (FileNotFoundError, ValueError, KeyError, RuntimeError)


class CrossValidationError(LocalDamageError, ValueError):
    """Arguments that make the whole cross-validation impossible (bad config, no splits...)."""


@dataclass(frozen=True)
class CVOptions:
    """How the configs are cross-validated (the defaults: ``local-damage cv``'s).

    Attributes:
        folds: the folds to run (None: every fold of splits.csv).
        holdout: a fold of splits.csv kept out of every training run and never evaluated (the
            test tiles of a model whose figures must not be tuned on); it cannot be in ``folds``.
        views: 2 adds SAA/SAD to each fold's representation metrics; 1 skips the second view.
        inner: 0 reports every config as a method; ``K >= 2`` chooses one config per outer fold
            on ``K`` inner folds of its training tiles and reports the choices as ``selected``.
        inner_seed: seed of the inner folds' dealing.
        max_false_alarm: with ``inner``, None (choose on macro-F1 alone) or the ceiling on the
            mean inner share of intact buildings called damaged a chosen recipe may have
            (:func:`~local_damage.experiments.nested.pick`).
        costs: with ``inner``, None (each config graded with its own ``grade.false_alarm_cost``)
            or the false-alarm costs every config is tried under, the chosen one becoming the
            outer run's grade rule (:mod:`~local_damage.experiments.nested`).
        inner_by: with ``inner``, ``"area"`` (the outer split's tiles or blocks dealt into
            inner folds) or ``"event"`` (the ``inner`` largest training events held out in turn).
        progress: show training progress bars and per-epoch lines.
    """

    folds: Sequence[int] | None = None
    holdout: int | None = None
    views: int = 2
    inner: int = 0
    inner_seed: int = 0
    max_false_alarm: float | None = None
    costs: Sequence[float] | None = None
    inner_by: str = "area"
    progress: bool = True


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


#: Config keys that do not change what is trained: a run is reused under another value (and
#: evaluated again with it). The grade rule acts on the probabilities alone; the device and the
#: loader's workers only say where the same recipe runs (a chip's augmentation depends on the seed
#: and the epoch alone, `ChipPairDataset.set_epoch`), so a fold trained on a GPU with workers is
#: reused on a CPU without them.
NOT_TRAINING = ("grade.", "train.device", "data.num_workers")


def check_run_config(run: str | Path, cfg) -> None:
    """Check that ``run`` holds no run, or a run trained as ``cfg`` would train it (so reusing it
    is sound; the grade rule, :data:`NOT_TRAINING`, may differ).

    Raises:
        CrossValidationError: ``run/config.yaml`` differs from ``cfg``; names the keys.
    """
    path = Path(run) / "config.yaml"
    if not path.is_file():
        return
    saved, wanted = _flat(to_dict(load_yaml(Config, path))), _flat(to_dict(cfg))
    differences = sorted(
        k
        for k in set(saved) | set(wanted)
        if saved.get(k) != wanted.get(k) and not k.startswith(NOT_TRAINING)
    )
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
        views: views for the representation metrics (see :func:`runtime.evaluation.evaluate.evaluate`).
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
    cost = float(cfg.grade.false_alarm_cost)
    if has_summary and (run / METRICS_JSON).is_file():
        metrics = json.loads((run / METRICS_JSON).read_text())
        if graded_with(metrics) == cost:
            return metrics, "reused"
    if has_summary and load_yaml(Config, run / "config.yaml").grade != cfg.grade:
        save_yaml(cfg, run / "config.yaml")  # the run's own rule: what export carries
    how = "evaluated"
    if not has_summary:
        resume = (run / LAST_DIR / "state.pt").is_file()
        split = ChipSplit(fold=fold, holdout=holdout)
        train(cfg, chips, run, split, resume=resume, progress=progress)
        how = "resumed" if resume else "trained"
    scorer = TorchScorer(run)
    options = EvaluationOptions(
        views=views,
        tsne=False,
        batch_size=cfg.train.eval_batch_size,
        seed=cfg.train.seed,
        false_alarm_cost=cost,
    )
    metrics = evaluate_chips(scorer, chips, run, fold, options)
    return metrics, how


def graded_with(metrics: dict[str, Any]) -> float:
    """The false-alarm cost an evaluation's grades were given with (1 for one that records
    none: the most probable grade)."""
    rule = metrics.get(GRADE_RULE_KEY) or {}
    return float(rule.get("false_alarm_cost", 1.0))


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


def cross_validate(
    configs: Sequence[str | Path],
    chips: str | Path,
    out: str | Path,
    options: CVOptions | None = None,
    overrides: Sequence[str] = (),
    names: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Train and evaluate every config on every fold; write the tables to ``out``.

    Args:
        configs: training config YAML files (one method each).
        chips: chip store folder with splits.csv.
        out: output folder (runs in ``out/<method>/fold<K>``).
        options: the folds, held-out fold, views and inner folds (:class:`CVOptions`).
        overrides: ``key=value`` overrides applied to every config.
        names: method names (default: the config file stems).

    Returns:
        The results written to ``out/cv_results.json``: ``chips``, ``folds``, ``class_names``,
        ``prevalence``, ``methods`` (each with its ``folds`` metrics, ``summary`` and
        ``protocol`` (:func:`~local_damage.experiments.cv_report.protocol_summary`), and with
        ``inner`` its ``recipes`` per fold) and ``failed`` (method, fold, error of every fold that could not be run).

    Raises:
        CrossValidationError: a config cannot be loaded, names clash, a fold is not in
            splits.csv, or the store has no manifest or no (current) splits.csv.
    """
    chips, out, options = Path(chips), Path(out), options or CVOptions()
    folds, holdout, inner = options.folds, options.holdout, options.inner
    views, progress = options.views, options.progress
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
    if inner == 1 or inner < 0:
        raise CrossValidationError(
            f"--inner must be 0 (no recipe choice) or at least 2, got {inner}"
        )
    ceiling = options.max_false_alarm
    if ceiling is not None and not (inner and 0.0 <= ceiling <= 1.0):
        raise CrossValidationError(
            f"--max-false-alarm must be a share in [0, 1] and goes with --inner K, got {ceiling}"
            + ("" if inner else " without --inner")
        )
    if options.inner_by != "area" and not inner:
        raise CrossValidationError("--inner-by goes with --inner K")
    if options.costs is not None and not (inner and options.costs):
        raise CrossValidationError(
            "--costs lists the false-alarm costs tried on inner folds and goes with --inner K"
        )
    if inner and holdout is not None:
        raise CrossValidationError(
            "--inner and --holdout do not go together: each outer fold is a test fold"
        )
    for name, cfg in zip(labels, loaded, strict=True):  # before any training, not midway
        for fold in folds:
            if inner:
                for j in range(inner):
                    root = inner_root(out, options.inner_by)
                    check_run_config(root / f"outer{fold}" / name / f"fold{j}", cfg)
            else:
                check_run_config(out / name / f"fold{fold}", cfg)
                check_run_holdout(out / name / f"fold{fold}", holdout)

    for name, cfg in zip(labels, loaded, strict=True):
        if cfg.train.patience > 0 and not inner:
            log.warning(
                f"[{name}] train.patience={cfg.train.patience}: training may stop early on the "
                "test fold's macro-F1, a choice made on it; --set train.patience=0 stops no run early"
            )
        if cfg.train.keep == "best":
            log.warning(
                f"[{name}] train.keep=best: each fold is evaluated with the epoch of best macro-F1 "
                "on that same fold, an optimistic estimate; --set train.keep=last evaluates the "
                "last epoch (and --set train.patience=0 stops no run early on its fold)"
            )

    methods, failed = [], []
    if inner:
        methods.append(
            _selected_method(
                list(zip(labels, loaded, strict=True)),
                chips,
                out,
                folds,
                options,
                class_names,
                failed,
            )
        )
    for name, path, cfg in zip(labels, configs, loaded, strict=True):
        if inner:
            break
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
                "protocol": protocol_summary(
                    {int(f): out / name / f"fold{f}" for f in fold_metrics},
                    chips,
                    class_names,
                    out / name,
                ),
            }
        )
    results = {
        "chips": str(chips),
        "folds": folds,
        "holdout": holdout,
        "overrides": list(overrides),
        "inner": inner,
        "max_false_alarm": options.max_false_alarm if inner else None,
        "costs": None if not inner or options.costs is None else list(options.costs),
        "inner_by": options.inner_by if inner else None,
        "class_names": class_names,
        "prevalence": prevalence(chips, folds, class_names),
        "methods": methods,
        "failed": failed,
    }
    write_tables(results, out)
    write_protocol_table(methods, class_names, out)
    return results


def _selected_method(candidates, chips, out, folds, options, class_names, failed) -> dict[str, Any]:
    """Per outer fold: choose a candidate on inner folds, train it without the fold, score it."""
    fold_metrics: dict[str, dict] = {}
    recipes: dict[str, str] = {}
    chosen_configs: dict[str, Any] = {}
    for fold in folds:
        try:
            choice = InnerChoice(
                options.inner,
                options.inner_seed,
                options.progress,
                max_false_alarm=options.max_false_alarm,
                costs=options.costs,
                by=options.inner_by,
            )
            chosen, cfg, _ = choose_recipe(candidates, chips, out, fold, choice)
            run = out / "selected" / f"fold{fold}"
            metrics, how = run_fold(
                cfg, chips, run, fold, views=options.views, progress=options.progress
            )
        except FOLD_ERRORS as exc:
            message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            log.warning(f"[selected fold {fold}] failed: {message}")
            failed.append({"method": "selected", "fold": fold, "error": message})
            continue
        log.info(
            f"[selected fold {fold}] {chosen}, {how}: accuracy {metrics['accuracy']:.4f}, "
            f"macro-F1 {metrics['macro_f1']:.4f}"
        )
        fold_metrics[str(fold)] = metrics
        recipes[str(fold)] = chosen
        chosen_configs[str(fold)] = cfg
    first = candidates[0][1]
    return {
        "name": "selected",
        "config": ", ".join(n for n, _ in candidates),
        "loss": "/".join(sorted({c.loss.method for c in chosen_configs.values()})) or "n/a",
        "encoder": first.model.encoder,
        "batch_size": first.train.batch_size,
        "input_size": first.data.input_size,
        "recipes": recipes,
        "folds": fold_metrics,
        "summary": summarise_method(fold_metrics, class_names),
        "protocol": protocol_summary(
            {int(f): out / "selected" / f"fold{f}" for f in fold_metrics},
            chips,
            class_names,
            out / "selected",
        ),
    }
