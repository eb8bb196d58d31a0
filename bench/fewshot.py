"""`local-damage bench fewshot`: the leave-one-event-out few-shot report.

For each event of a chip store held out in turn:

1. A base model is trained on the labelled chips of the other events (``OUT/<event>/base``,
   reused when finished, resumed from its last checkpoint when interrupted), a share of their
   tiles (``--val-share``) kept out as a validation slice. It is exported to ONNX
   (``OUT/<event>/base.onnx``, :func:`local_damage.export.model.export_run`) with a temperature and
   class prototypes fitted on that slice, as the bundled model carries them.
2. Per repeat, the event's labelled buildings are split at random into a pool and an evaluation
   set (the same for every arm and k of the repeat). From the pool, k labels are taken: the first
   k of a random order (``adapt-random``), or the suggestions (``adapt-suggested``) in rounds as
   an analyst gets them: the first round (the smallest k) by
   :func:`app.adapt.suggest.suggestion_order` with the base model (a random draw: the random arm's),
   each later round adding the top of the rest of the pool ranked with the head adapted to the
   labels so far (its uncertain buildings interleaved with the next of the random draw). The head is adapted to them with
   :func:`app.adapt.fit.adapt_head` (every head, the lowest cross-validated log-loss kept, as
   ``local-damage adapt`` does, with its rule for classes without a label, ``--unlabelled``) and
   the evaluation set is graded with it. Labels of a single
   class are refused by ``adapt``; the analyst then keeps the base model, and so does the report
   (the row says so).
3. ``finetune``: ``train --init`` from the base run on the random arm's k labels for
   ``--finetune-epochs`` epochs (batch size at most k, the last epoch kept), scored on the same
   evaluation set; its run folder is temporary.

``k = 0`` is the base model. Everything is written to ``OUT/fewshot.json``, ``OUT/fewshot.md``
and ``OUT/fewshot.png`` (:mod:`bench.fewshot_report`). An event's measurements are kept
in ``OUT/<event>/measurements.json`` and reused when the settings and base model are the same.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.errors import LocalDamageError

FEWSHOT_JSON = "fewshot.json"
FEWSHOT_MD = "fewshot.md"
FEWSHOT_PNG = "fewshot.png"
#: Written in a base run folder: the chips it was trained and validated on.
BASE_SPLIT = "fewshot-split.json"
#: Written in an event's folder: its measurements and the settings they were made with.
EVENT_JSON = "measurements.json"
#: Changes whenever what the arms measure changes, so that older measurements are not reused.
MEASURE_VERSION = 4  # 2: suggested labels in rounds; 4: random first round, then mixed
DEFAULT_K = (0, 5, 10, 20, 50)
DEFAULT_CONFIG = "configs/default.yaml"


class FewShotError(LocalDamageError, ValueError):
    """Input the report cannot run on; the message names the file and the problem."""


@dataclass
class Settings:
    """What the measurements depend on besides the base model."""

    k: list[int]
    repeats: int = 5
    seed: int = 0
    finetune_epochs: int = 10
    finetune_overrides: list[str] | None = None
    val_share: float = 0.1
    pool_share: float = 0.5
    min_eval: int = 20
    unlabelled: str = "discount"

    def check(self) -> None:
        if not self.k or any(k < 0 for k in self.k):
            raise FewShotError(f"--k must list numbers of labels >= 0, got {self.k}")
        if self.repeats < 1:
            raise FewShotError(f"--repeats must be at least 1, got {self.repeats}")
        if self.finetune_epochs < 0:
            raise FewShotError(f"--finetune-epochs must be >= 0, got {self.finetune_epochs}")
        if not 0 <= self.val_share < 1:
            raise FewShotError(f"--val-share must lie in [0, 1), got {self.val_share}")
        if not 0 < self.pool_share < 1:
            raise FewShotError(f"--pool-share must lie in (0, 1), got {self.pool_share}")
        if self.min_eval < 1:
            raise FewShotError(f"--min-eval must be at least 1, got {self.min_eval}")
        from app.adapt.fit import AdaptError, check_rule

        try:
            check_rule(self.unlabelled)
        except AdaptError as exc:
            raise FewShotError(f"--unlabelled: {exc}") from exc


# --------------------------------------------------------------------------------------------
# the store and the splits


def store_events(chips: str | Path):
    """The labelled rows of the store's manifest and its events, in order of name.

    Raises:
        FewShotError: no manifest, no event column, no labelled chip with an event name.
    """
    from data_prep.store import MANIFEST, read_manifest

    path = Path(chips) / MANIFEST
    try:
        frame = read_manifest(chips)
    except FileNotFoundError as exc:
        raise FewShotError(str(exc)) from exc
    if "event" not in frame.columns:
        raise FewShotError(f"{path}: no event column; the report holds out events")
    frame = frame[(frame["label"] >= 0) & (frame["event"].str.strip() != "")]
    events = sorted(set(frame["event"]))
    if not events:
        raise FewShotError(
            f"{path}: no labelled chip with an event name; the report holds out events of a "
            "labelled store (`local-damage prepare xbd` records them)"
        )
    return frame.reset_index(drop=True), events


def pool_size(n: int, settings: Settings) -> int | None:
    """How many of an event's ``n`` labelled buildings form the pool the labels come from, or
    None when the event is too small (fewer than max k + ``min_eval``)."""
    need = max(settings.k) + settings.min_eval
    if n < need:
        return None
    return int(min(max(max(settings.k), round(settings.pool_share * n)), n - settings.min_eval))


def base_split(frame, event: str, val_share: float, seed: int) -> tuple[list[str], list[str]]:
    """``(train_ids, val_ids)``: the labelled chips of every event but ``event``, whole tiles in
    a seeded random order moved to validation until ``val_share`` of the chips is reached (at
    least one tile stays in training)."""
    other = frame[frame["event"] != event]
    if val_share <= 0 or other.empty:
        return other["chip_id"].tolist(), []
    tiles = sorted(set(other["tile"])) if "tile" in other.columns else []
    rng = np.random.default_rng(seed)
    order = [tiles[i] for i in rng.permutation(len(tiles))]
    sizes = other.groupby("tile").size()
    val, taken = set(), 0
    for tile in order[:-1]:
        if taken >= val_share * len(other):
            break
        val.add(tile)
        taken += int(sizes[tile])
    is_val = other["tile"].isin(val)
    return other.loc[~is_val, "chip_id"].tolist(), other.loc[is_val, "chip_id"].tolist()


# --------------------------------------------------------------------------------------------
# the base model


def prepare_base(cfg, chips, folder: Path, ids, progress: bool) -> tuple[Path, Path, str]:
    """Train (or reuse, or resume) the base run of one held-out event and export it.

    Returns:
        ``(run, model.onnx, how)``, ``how`` one of ``reused``, ``resumed``, ``trained``.

    Raises:
        FewShotError: the folder holds a run of another config or other chips.
    """
    from local_damage.experiments.cv import CrossValidationError, check_run_config
    from local_damage.train import checkpoint as ckpt
    from local_damage.train.loop import SUMMARY, train

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
        from data_prep.store import write_json

        resume = (run / ckpt.LAST_DIR / "state.pt").is_file()
        run.mkdir(parents=True, exist_ok=True)
        write_json(split_path, wanted)
        train(cfg, chips, run, resume=resume, progress=progress, ids=(ids[0], ids[1]))
        how = "resumed" if resume else "trained"
    weights = run / ckpt.BEST
    fresh = onnx_path.is_file() and onnx_path.stat().st_mtime >= weights.stat().st_mtime
    if not fresh:
        export_base(run, onnx_path, chips, ids[1])
    return run, onnx_path, how


def export_base(run: Path, out: Path, chips, val_ids: Sequence[str]) -> Path:
    """Export ``run`` to ``out`` (parity-checked) with a temperature and ``ood`` prototypes
    fitted on the validation slice ``val_ids`` (none when it is empty, or when no temperature
    fits it), atomically; the calibration is :func:`local_damage.evaluation.calibrate.calibrate_model`'s.
    """
    import onnx

    from local_damage.evaluation.calibrate import calibrate_model
    from local_damage.export.model import export_run
    from runtime.contract import save_onnx

    with tempfile.TemporaryDirectory(prefix="fewshot-export-", dir=out.parent) as tmp:
        staged = Path(tmp) / "base.onnx"
        export_run(run, staged, chips=chips, parity_limit=64, calibration_limit=8)
        if val_ids:
            try:
                calibrate_model(
                    staged,
                    chips,
                    out,
                    chip_ids=list(val_ids),
                    selection="validation slice",
                    prototype_ids=list(val_ids),
                )
                return out
            except ValueError as exc:  # e.g. a slice the model separates perfectly
                print(f"{run}: not calibrated ({exc})", file=sys.stderr)
        save_onnx(onnx.load(str(staged)), out)
    return out


# --------------------------------------------------------------------------------------------
# the measurements of one event


def _scores(y: np.ndarray, pred: np.ndarray, names: Sequence[str]) -> dict[str, float]:
    from local_damage.metrics import classification_metrics

    m = classification_metrics(y, pred, names)
    return {"accuracy": round(float(m["accuracy"]), 6), "macro_f1": round(float(m["macro_f1"]), 6)}


def finetune(cfg, chips, base_run: Path, label_ids, eval_ids, epochs, overrides, seed, folder):
    """``(predictions in eval_ids order, note)`` of ``train --init base_run`` on ``label_ids``."""
    from local_damage.config import apply_overrides
    from local_damage.evaluation.scorers import TorchScorer
    from local_damage.train.loop import train

    batch = min(cfg.train.batch_size, len(label_ids))
    sets = [
        f"train.epochs={epochs}",
        f"train.batch_size={batch}",
        "train.keep=last",
        "train.patience=0",
        f"train.seed={seed}",
        *overrides,
    ]
    tuned = apply_overrides(cfg, sets)
    with tempfile.TemporaryDirectory(prefix="finetune-", dir=folder) as tmp:
        train(tuned, chips, tmp, init=base_run, progress=False, ids=(list(label_ids), []))
        scored = TorchScorer(tmp).score(chips, list(eval_ids), batch_size=cfg.train.eval_batch_size)
    where = {c: i for i, c in enumerate(scored.chip_ids)}
    logits = scored.logits[[where[c] for c in eval_ids]]
    if not np.isfinite(logits).all():
        return None, "fine-tuning diverged (non-finite logits)"
    return logits.argmax(1), f"{epochs} epoch(s), batch {batch}"


def measure_event(
    event: str, chips, cfg, base_run: Path, base_onnx: Path, settings: Settings, bar=None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every measurement of one held-out event (see the module docstring).

    Returns:
        ``(rows, splits)``: one row per repeat, k and arm (``labelled``: the chip ids given,
        ``accuracy`` and ``macro_f1`` of the evaluation set, ``model``: the head kept, ``note``),
        and per repeat the chip ids of the pool (in random order) and of the evaluation set.
    """
    from app.adapt.fit import METHODS, AdaptError, adapt_head
    from app.adapt.labelled import from_chip_store
    from app.adapt.model import base_of, base_prototypes
    from app.adapt.suggest import suggestion_order
    from runtime.predictor import Predictor

    predictor = Predictor(base_onnx)
    names = list(predictor.class_names)
    b = from_chip_store(chips, names, event=event)
    b = b.subset(b.labelled)
    p = predictor.predict(b.pre, b.post)
    raw = p.raw_logits if p.raw_logits is not None else p.logits
    y, ids, base_pred = b.labels, np.asarray(b.ids), p.probabilities.argmax(1)
    t0, _ = base_of(predictor.metadata)
    protos = base_prototypes(predictor.metadata, names)
    n_pool = pool_size(len(b), settings)
    rows: list[dict[str, Any]] = []
    splits: list[dict[str, Any]] = []
    for r in range(settings.repeats):
        rng = np.random.default_rng([settings.seed, r, zlib.crc32(event.encode())])
        perm = rng.permutation(len(b))
        pool, ev = perm[:n_pool], np.sort(perm[n_pool:])
        # the suggested labels come in rounds, as an analyst gets them: the first round ranked
        # with the base model, each later one with the head adapted to the labels so far
        suggested: list[int] = []
        head = None
        splits.append({"repeat": r, "pool": ids[pool].tolist(), "eval": ids[ev].tolist()})
        common = {"event": event, "repeat": r, "pool": int(n_pool), "n_eval": int(len(ev))}
        base = _scores(y[ev], base_pred[ev], names)
        for k in sorted(settings.k):
            if len(suggested) < k:
                taken = set(suggested)
                rest = np.asarray([i for i in pool if i not in taken], dtype=np.int64)
                prob = p.probabilities[rest]
                if head is not None:
                    prob = np.exp(head.log_probabilities(raw[rest], p.embedding[rest]))
                # the random share is drawn in the pool's own random order: the first round is
                # the random arm's draw, and a later round's random picks are the next of it
                ranked, _ = suggestion_order(
                    prob,
                    p.embedding[rest],
                    k - len(suggested),
                    p.embedding[suggested] if suggested else None,
                    adapted=head is not None,
                    order=np.arange(len(rest)),
                )
                suggested += rest[ranked].tolist()
            for arm in ("adapt-random", "adapt-suggested", "finetune"):
                if arm == "finetune" and not settings.finetune_epochs:
                    continue
                given = pool[:k] if arm != "adapt-suggested" else np.asarray(suggested[:k], int)
                row: dict[str, Any] = {**common, "k": int(k), "arm": arm}
                row["labelled"] = ids[given].tolist()
                row["labels_per_class"] = {
                    n: int(np.sum(y[given] == i)) for i, n in enumerate(names)
                }
                if k == 0:
                    row.update(base, model="base")
                elif arm == "finetune" and k < 2:
                    row.update(model=None, note="fine-tuning needs 2 labels")
                elif arm == "finetune":
                    pred, note = finetune(
                        cfg,
                        chips,
                        base_run,
                        row["labelled"],
                        ids[ev].tolist(),
                        settings.finetune_epochs,
                        settings.finetune_overrides or [],
                        cfg.train.seed + r,
                        base_onnx.parent,
                    )
                    row.update(_scores(y[ev], pred, names) if pred is not None else {})
                    row.update(model="finetuned", note=note)
                else:
                    try:
                        a = adapt_head(
                            raw[given],
                            p.embedding[given],
                            y[given],
                            len(names),
                            t0,
                            protos,
                            METHODS,
                            settings.seed,
                            settings.unlabelled,
                        )
                        lp = a.head.log_probabilities(raw[ev], p.embedding[ev])
                        row.update(_scores(y[ev], lp.argmax(1), names), model=a.head.method)
                        if arm == "adapt-suggested":
                            head = a.head
                    except AdaptError as exc:  # adapt refuses; the analyst keeps the base model
                        row.update(base, model="base", note=f"adapt refused: {exc}")
                        if arm == "adapt-suggested":
                            head = None
                rows.append(row)
                if k and bar is not None:
                    bar.update()
    return rows, splits


# --------------------------------------------------------------------------------------------
# the report


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
    from tqdm import tqdm

    from bench import fewshot_report as report
    from data_prep.store import atomic_path, safe_name, write_json
    from local_damage.config import ConfigError, apply_overrides, load_yaml
    from local_damage.train.config import Config

    settings = settings or Settings(list(DEFAULT_K))
    settings.k = sorted({int(k) for k in settings.k})
    settings.check()
    chips, out = Path(chips), Path(out)
    try:
        cfg = load_yaml(Config, config, overrides)
    except ConfigError as exc:
        raise FewShotError(str(exc)) from exc
    try:
        apply_overrides(cfg, settings.finetune_overrides or [])
    except ConfigError as exc:
        raise FewShotError(f"--finetune-set: {exc}") from exc
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
        2 + (settings.finetune_epochs > 0) for k in settings.k if k > 0
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
        from app.adapt.model import sha256

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


# --------------------------------------------------------------------------------------------
# command line


def _ks(text: str) -> list[int]:
    try:
        return [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers of labels such as 0,5,20, got {text!r}"
        ) from None


def add_parser(bench_sub: argparse._SubParsersAction) -> None:
    """Register ``local-damage bench fewshot``."""
    from app.adapt.fit import UNLABELLED_RULES

    p = bench_sub.add_parser(
        "fewshot",
        help="leave-one-event-out few-shot report: adapt and fine-tune on k labels of an unseen event",
        description=(
            "Hold out each event of CHIPS in turn: train a base model on the others "
            "(OUT/<event>/base, reused when finished), then per repeat take k labelled buildings "
            "of the held-out event (at random, and by the suggestion ranking), adapt the head to "
            "them (as `local-damage adapt`), fine-tune the network on the random ones (`train "
            "--init`), and score accuracy and macro-F1 on the rest of the event. Writes "
            "OUT/fewshot.json, OUT/fewshot.md (tables) and OUT/fewshot.png (macro-F1 against k), "
            "prints the table and the goal checks. See docs/adapt.md."
        ),
    )
    p.add_argument(
        "--chips", required=True, metavar="CHIPS", help="labelled chip store with events"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        metavar="YAML",
        help=f"training config of the base models (default {DEFAULT_CONFIG})",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of the config, e.g. --set train.epochs=5 (repeatable)",
    )
    p.add_argument(
        "--events", metavar="A,B", help="events to hold out, comma-separated (default: every event)"
    )
    p.add_argument(
        "--k",
        type=_ks,
        default=list(DEFAULT_K),
        metavar="K,K,...",
        help="numbers of labels (default 0,5,10,20,50; 0 is the base model)",
    )
    p.add_argument("--repeats", type=int, default=5, help="draws per k (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws and splits (default 0)")
    p.add_argument(
        "--finetune-epochs",
        type=int,
        default=10,
        metavar="N",
        help="epochs of `train --init` on the k labels (default 10; 0: no fine-tuning arm)",
    )
    p.add_argument(
        "--finetune-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field for fine-tuning only, e.g. --finetune-set optim.lr=1e-4",
    )
    p.add_argument(
        "--val-share",
        type=float,
        default=0.1,
        metavar="F",
        help="share of the training events' chips (whole tiles) kept out of training to "
        "calibrate the base model (default 0.1; 0: none, uncalibrated)",
    )
    p.add_argument(
        "--pool-share",
        type=float,
        default=0.5,
        metavar="F",
        help="share of the held-out event's buildings the labels are drawn from; the rest is "
        "evaluated (default 0.5; at least max k)",
    )
    p.add_argument(
        "--min-eval",
        type=int,
        default=20,
        metavar="N",
        help="fewest buildings left to evaluate on; a smaller event is skipped (default 20)",
    )
    p.add_argument(
        "--unlabelled",
        choices=UNLABELLED_RULES,
        default="discount",
        help="adapt's rule for classes without a label (as `local-damage adapt --unlabelled`; "
        "default discount)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bench import fewshot_report as report

    settings = Settings(
        k=args.k,
        repeats=args.repeats,
        seed=args.seed,
        finetune_epochs=args.finetune_epochs,
        finetune_overrides=list(args.finetune_set),
        val_share=args.val_share,
        pool_share=args.pool_share,
        min_eval=args.min_eval,
        unlabelled=args.unlabelled,
    )
    events = [e.strip() for e in args.events.split(",") if e.strip()] if args.events else None
    try:
        results = run_fewshot(
            args.chips, args.out, args.config, args.set, events, settings, not args.quiet
        )
    except FewShotError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ks = results["settings"]["k"]
    print("macro-F1 on the rest of the held-out event (mean +- sd)")
    print(report.table(results["summary"], ks, "macro_f1"))
    print("accuracy")
    print(report.table(results["summary"], ks, "accuracy"))
    print("goals:")
    print(report.format_goals(results["goals"]))
    for item in results["skipped"]:
        print(f"not measured: {item['event']}: {item['reason']}", file=sys.stderr)
    out = Path(args.out)
    print(f"wrote {out / FEWSHOT_JSON}, {out / FEWSHOT_MD}, {out / FEWSHOT_PNG}")
    return 0
