"""The tables of `local-damage cv`: the paper's Table 2 and Table 3 and their files.

- Table 2 (``table2.md/.csv``): accuracy and macro-F1 as mean (min-max) over folds, one row per
  method with its batch size and input size;
- Table 3 (``table3.md/.csv``): per-class F1 (mean over the folds where the class occurs) with
  the class's prevalence among the evaluated chips, one column per method, and a last row
  "f1-macro / accuracy";
- ``cv_results.json``: every fold's full metrics and the aggregates.

Markdown shows percentages with two decimals as in the paper; CSV and JSON keep fractions.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from data_prep.store import atomic_path, write_json

CV_RESULTS = "cv_results.json"


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
