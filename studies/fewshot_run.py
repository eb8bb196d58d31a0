"""The leave-one-event-out few-shot report (see :mod:`studies.fewshot`): every held-out event's
base model and measurements, then the tables, plot and goal checks."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from app.adapt.model import sha256
from data_prep.store import atomic_path, safe_name, write_json
from local_damage.config import ConfigError, load_yaml
from local_damage.train.config import Config
from studies import fewshot_report as report
from studies.fewshot_base import prepare_base
from studies.fewshot_measure import measure_event
from studies.fewshot_settings import (
    DEFAULT_CONFIG,
    DEFAULT_K,
    EVENT_JSON,
    FEWSHOT_JSON,
    FEWSHOT_MD,
    FEWSHOT_PNG,
    MEASURE_VERSION,
    FewShotError,
    Settings,
    base_split,
    pool_size,
    store_events,
)


def run_fewshot(
    chips: str | Path,
    out: str | Path,
    config: str | Path | None = DEFAULT_CONFIG,
    overrides: Sequence[str] = (),
    events: Sequence[str] | None = None,
    settings: Settings | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the report and write ``OUT/fewshot.json``, ``.md`` and ``.png``; returns the results.

    Raises:
        FewShotError: a bad config, store, event list or setting, or no event left to measure.
    """
    settings = settings or Settings(list(DEFAULT_K))
    settings.k = sorted({int(k) for k in settings.k})
    settings.check()
    chips, out = Path(chips), Path(out)
    try:
        cfg = load_yaml(Config, config, overrides)
    except ConfigError as exc:
        raise FewShotError(str(exc)) from exc
    frame, available = store_events(chips)
    if len(available) < 2:
        raise FewShotError(
            f"{chips / 'manifest.csv'}: one event ({available[0]}); holding it out leaves "
            "nothing to train on, the report needs at least 2 events"
        )
    chosen = list(events) if events else available
    unknown = [e for e in chosen if e not in available]
    if unknown:
        raise FewShotError(
            f"{chips / 'manifest.csv'}: no labelled chip of event(s) {', '.join(unknown)}; its "
            f"events are {', '.join(available)}"
        )
    skipped, sizes = [], {}
    for event in chosen:
        n = int((frame["event"] == event).sum())
        if pool_size(n, settings) is None:
            need = max(settings.k) + settings.min_eval
            skipped.append(
                {
                    "event": event,
                    "reason": f"{n} labelled buildings, fewer than max k {max(settings.k)} + "
                    f"{settings.min_eval} to evaluate on ({need}); lower --k or --min-eval",
                }
            )
        else:
            sizes[event] = n
    if not sizes:
        reasons = "; ".join(f"{s['event']}: {s['reason']}" for s in skipped)
        raise FewShotError(f"no event can be measured ({reasons})")
    steps_per_event = 1 + settings.repeats * sum(
        2 + 2 * (settings.finetune_epochs > 0 and (not settings.tune_k or k in settings.tune_k))
        for k in settings.k
        if k > 0
    )
    bar = tqdm(total=steps_per_event * len(sizes), disable=not progress, unit="step")
    info, rows, splits = {}, [], {}
    wanted = {
        "settings": asdict(settings),
        "chips": str(chips.resolve()),
        "measure_version": MEASURE_VERSION,
    }
    for event in sizes:
        folder = out / safe_name(event)
        bar.set_description(f"{event}: base")
        ids = base_split(frame, event, settings.val_share, settings.seed)
        try:
            run, model, how = prepare_base(cfg, chips, folder, ids, progress)
        except (FileNotFoundError, ValueError, KeyError, RuntimeError) as exc:
            if isinstance(exc, FewShotError):
                raise
            skipped.append({"event": event, "reason": f"base model failed: {exc}"})
            print(f"[{event}] base model failed: {exc}", file=sys.stderr)
            bar.update(steps_per_event)
            continue
        print(f"[{event}] base {how}: {run}", file=sys.stderr)
        bar.update()
        cached, digest = folder / EVENT_JSON, sha256(model)
        saved = json.loads(cached.read_text()) if cached.is_file() else {}
        if saved.get("wanted") == wanted and saved.get("base_sha256") == digest:
            event_rows, splits[event] = saved["rows"], saved["splits"]
            print(f"[{event}] measurements reused: {cached}", file=sys.stderr)
            bar.update(steps_per_event - 1)
        else:
            bar.set_description(f"{event}: k labels")
            event_rows, splits[event] = measure_event(event, chips, cfg, run, model, settings, bar)
            write_json(
                cached,
                {
                    "wanted": wanted,
                    "base_sha256": digest,
                    "rows": event_rows,
                    "splits": splits[event],
                },
            )
        rows += event_rows
        n_pool = pool_size(sizes[event], settings)
        info[event] = {
            "n": sizes[event],
            "pool": n_pool,
            "eval": sizes[event] - n_pool,
            "base": how,
            "base_run": str(run),
            "base_model": str(model),
            "train_chips": len(ids[0]),
            "val_chips": len(ids[1]),
        }
    bar.close()
    if not info:
        raise FewShotError("no event could be measured: " + "; ".join(s["reason"] for s in skipped))
    summary = report.summarise(rows, settings.k)
    results = {
        "chips": str(chips),
        "config": str(config) if config else None,
        "overrides": list(overrides),
        "settings": asdict(settings),
        "events": info,
        "skipped": skipped,
        "measurements": rows,
        "splits": splits,
        "summary": summary,
        "goals": report.goals(summary, settings.k),
    }
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / FEWSHOT_JSON, results)
    with atomic_path(out / FEWSHOT_MD, suffix=".md") as tmp:
        tmp.write_text(report.markdown(results))
    report.plot(results, out / FEWSHOT_PNG)
    return results
